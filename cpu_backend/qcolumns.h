// Quantized matrices stored input-channel-major ("columns"), so that a product y = W x reads only
// the weights of the input channels whose 8-bit activation is nonzero: the kernel behind input
// sparsity (a stock SwiGLU model's q/k/v, o, gate/up and down projections with their small inputs
// zeroed, sparsity/input_sparsity.py), and exact for any x (a channel whose activation rounds to
// 0 contributes 0 to llama.cpp's integer dot too, so skipping it changes no bit of the sums).
//
// Layout of a GGUF matrix W [O, I] in format t, O a multiple of kColTile (64), per block b of the
// format's block (32 input channels for Q4_0 / Q4_1 / Q8_0, a 256-channel super-block for Q4_K
// and Q6_K), blocks one after another:
//   head   the block's per-row scale fields as planes over the O rows (the file's values,
//          decoded where the file packs them):
//            Q4_0, Q8_0  d f16 [O]                 Q4_1  d f16 [O], m f16 [O]
//            Q4_K        d f16 [O], dmin f16 [O], sc u8 [8][O], m u8 [8][O]   (6-bit fields)
//            Q6_K        d f16 [O], sc s8 [16][O]
//   codes  per input channel j of the block (from a line boundary, channels an odd number of
//          lines apart: qcolumns.cc ChannelStride), its O codes, one tile of 64 rows after
//          another:
//            4-bit (Q4_0, Q4_1, Q4_K): 32 bytes a tile, byte k = row s(k) | row s(k) + 32 << 4
//            8-bit (Q8_0 as q ^ 0x80, Q6_K as q in [0, 64)): 64 bytes a tile, byte k = row s8(k)
//          with s(16l + 4q + m) = 8q + 4l + m and s8(32h + k) = 32h + s(k) (l, h < 2; q, m < 4):
//          the order in which two levels of byte/word unpacking of four channels' tiles put each
//          row's four codes in one int32 lane, rows in order (see qcolumns.cc).
// Nothing is re-quantized: every weight keeps the file's code and scale (Q4_K's 6-bit fields are
// unpacked, +4 bytes per row per 256 weights; Q6_K's 6-bit codes are stored in a byte each, +30%
// on those tensors; the padding to lines adds ~0.5% on a 7B model's matrices). The matrix is kept
// as uint8 [O, ColumnsRowBytes(t, O, I)] (its last bytes unused).
//
// The product, per token: activations quantized per block as for the row kernels (quant_act.h);
// per block the nonzero channels in groups of four (a zero-activation channel pads a group);
// per 64-row tile and group: the four channels' codes interleaved per row and one integer dot
// per 16 rows (one token and at most 2048 rows: each group's channels read whole, one after
// another, the sums kept in memory between groups, the next block's runs prefetched meanwhile;
// else the tiles in turn, each a line of every channel); per (sub-)block the integer sums
// scaled in float as llama.cpp scales them. A thread
// takes whole tiles; every y element is computed in one fixed order whatever the thread count and
// the sparsity: results are bitwise the same for the same x.
#ifndef PIJ_CPU_BACKEND_QCOLUMNS_H_
#define PIJ_CPU_BACKEND_QCOLUMNS_H_

#include <cstdint>
#include <span>

#include <vector>

#include "cpu_backend/qlinear.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

constexpr int64_t kColTile = 64;

// The formats with a columns layout.
constexpr bool ColumnsType(QType t) {
  return t == QType::kQ4_0 || t == QType::kQ4_1 || t == QType::kQ8_0 || t == QType::kQ4_K ||
         t == QType::kQ6_K;
}
// Whether a [rows, cols] matrix in t can be arranged in columns.
bool CanArrangeColumns(QType t, int64_t rows, int64_t cols);
// Bytes per row of the arranged matrix (uint8 [rows, ColumnsRowBytes]).
int64_t ColumnsRowBytes(QType t, int64_t rows, int64_t cols);

// dst (uint8 [rows, ColumnsRowBytes(t, rows, cols)]) = src (the file's rows, uint8 [rows,
// QRowBytes(t, cols)]) in the columns layout. Precondition: CanArrangeColumns (checked by the
// caller).
void ArrangeColumns(const uint8_t* src, QType t, int64_t rows, int64_t cols, uint8_t* dst,
                    ThreadPool& pool);

// The float values of an arranged matrix, [rows, cols] (tests; what the file's rows dequantize to).
void DequantizeColumns(const uint8_t* w, QType t, int64_t rows, int64_t cols, float* out);

// y[t, o] = x_t . W[o] (+ bias[o]) for rows o in [lo, hi) (multiples of kColTile, or hi = rows)
// of an arranged matrix with `rows` rows, tokens xs quantized per the format's block (views with
// the sums per 32 values for the 32-weight formats, per 16 for the K-quants). y [T, rows].
// portable: the per-lane loops every vector path must equal bitwise (tests).
void QLinearColumnsRows(const uint8_t* w, QType t, int64_t rows, int64_t cols,
                        std::span<const QActView> xs, int64_t lo, int64_t hi, const float* bias,
                        float* y, bool portable = false);

// Split along the input: y[t, :] = the partial product of blocks [b_lo, b_hi) only (no bias),
// every row. Blocks of the format: ColumnsBlocks(t, cols).
void QLinearColumnsBlocks(const uint8_t* w, QType t, int64_t rows, int64_t cols,
                          std::span<const QActView> xs, int64_t b_lo, int64_t b_hi, float* y);
int64_t ColumnsBlocks(QType t, int64_t cols);

// Decode (one token) of matrices in the columns layout sharing x (x32, x256: its activations per
// 32 and 256 values), as one pool job: each matrix split along its input into one block range
// per thread over all its rows, the ranges' partial sums added in range order after (the same
// bits for the same thread count). Split by rows instead, a [4096, 14336] down projection gave
// each of 2 threads 1 KiB runs of each channel and ran at 0.4-0.6x the rows kernel dense; along
// the input, whole 2 KiB columns, 0.7x dense and 1.3x at half the channels (2 threads).
void QLinearColumnsDecode(std::span<const QLinearOut> outs, int64_t dim, const QActView& x32,
                          const QActView& x256, std::vector<float>& scratch, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_QCOLUMNS_H_
