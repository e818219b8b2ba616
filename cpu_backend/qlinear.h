// Quantized matrix products on the thread pool: y[t, o] = x[t] . dequant(w[o]) (+ bias[o]) with w
// stored as a GGUF tensor's raw blocks, [O, row_bytes] in any format of quant_formats.h, and x
// quantized to int8 per block (quant_act.h), as llama.cpp computes. Decode (T = 1) streams every
// row once; prefill reads a block of rows once per group of up to 64 tokens (the rows stay in
// cache while every 4-token tile of the group passes over them). Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_QLINEAR_H_
#define PIJ_CPU_BACKEND_QLINEAR_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

struct QLinearOut {
  const uint8_t* w;    // [out_dim, QRowBytes(qtype, dim)]
  QType qtype;
  const float* bias;   // [out_dim] or nullptr
  int64_t out_dim;
  float* y;            // [T, out_dim]
  // The rows interleaved by 16 (quant_interleaved.h: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; out_dim a
  // multiple of 16), the same bytes rearranged; false: the file's rows.
  bool interleaved = false;
  // The columns layout (qcolumns.h: input-channel-major, out_dim a multiple of 64): only the
  // input channels whose 8-bit activation is nonzero are read.
  bool columns = false;
};

// Activations of the call, per block size (32: legacy formats, 256: K-quants).
struct QLinearScratch {
  QActs act32, act256;
  std::vector<QActView> views32, views256;  // per token
  std::vector<float> partial;  // the columns layout's partial sums (qcolumns.h)
};

// Several products of the same x rows in one pool job (attention's q, k, v): their rows are split
// as one range. Preconditions (checked by the caller): dim a multiple of every qtype's block, row
// tables of `dim` floats. Every y element is computed by one task in a fixed order: results are
// bitwise identical whatever the thread count.
void QLinearMany(std::span<const QLinearOut> outs, int64_t dim,
                 std::span<const float* const> x_rows, QLinearScratch& scratch, ThreadPool& pool);

// Rows [lo, hi) of one product for the quantized tokens xs (T views), y [T, out_dim]; for
// interleaved rows lo and hi are multiples of 16, for columns of 64 (or hi = out_dim).
void QLinearRows(const QLinearOut& out, int64_t dim, std::span<const QActView> xs, int64_t lo,
                 int64_t hi);

// dst = src's rows interleaved by 16 (quant_interleaved.h; checkpoint/quants.py `interleave` is
// the same map): src and dst uint8 [rows, row_bytes], t interleavable, rows a multiple of 16
// and row_bytes of the block (checked by the caller).
void InterleaveRows(const uint8_t* src, QType t, int64_t rows, int64_t row_bytes, uint8_t* dst,
                    ThreadPool& pool);

// Tests: out (interleaved rows, as QLinearMany computes them) through the portable per-lane
// loops instead of the build's vector code, one token at a time; the two must agree bitwise.
void QLinearInterleavedPortable(const QLinearOut& out, int64_t dim,
                                std::span<const float* const> x_rows);

// The float values of `rows` rows of `cols` weights in format t (tests).
void DequantizeRows(const uint8_t* blocks, QType t, int64_t rows, int64_t cols, float* out);

// out[k] = the float values of row ids[k] of blocks (an embedding lookup on a quantized table).
// Precondition (checked by the caller): every id is a row of blocks.
void DequantizeGather(const uint8_t* blocks, QType t, int64_t cols, std::span<const int32_t> ids,
                      float* out);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_QLINEAR_H_
