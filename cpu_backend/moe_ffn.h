// The mixture-of-experts FFN on quantized experts (models/moe.py): per token only its k routed
// experts' rows are read and computed, the tokens of a call grouped by expert so each expert's
// rows are read once for all its tokens. Built from qlinear.h's row products (the file's block
// formats, int8 activations as llama.cpp computes; AVX-512, AVX2 and portable paths there).
// Under input sparsity each expert's matrices are in the columns layout (qcolumns.h) and read
// only the channels of their inputs that are nonzero (x masked by the caller, h here by
// per-expert thresholds). ReLU experts with their down projection in down groups are sparse
// inside as well: each routed
// expert is the dense FFN's exact oracle (qsparse_ffn.h), so only the neurons whose gate fires
// read their up row and their down group. The experts are stacked (a layer's arrays) or each
// where an expert store keeps it (expert_store.h: `sources`, whose reads may still be running:
// the experts in memory are computed first, each other one once its reads end; the result is
// the same bits either way). Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_MOE_FFN_H_
#define PIJ_CPU_BACKEND_MOE_FFN_H_

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/qsparse_ffn.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

// A layer's experts: gate and up [E, F, QRowBytes(t, D)] (expert e's F rows of D weights), down
// [E, D, QRowBytes(t, F)] (expert e's D rows of F weights), each expert's rows as the GGUF file
// stores them or, where the flag says so, interleaved by 16 (quant_interleaved.h: Q4_0, Q4_1,
// Q8_0; the matvec layout, ~3x the file rows' speed at one token).
// Expert e's matrices when they are not stacked: its gate, up and down bytes (each in its
// stacked layout, one expert's part), and the read flags (bundle_reader.h) to wait for before
// they are read (none: in memory).
struct MoeExpertSource {
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  std::span<const std::atomic<uint32_t>* const> pending;
};

struct MoeExperts {
  const uint8_t* gate;  // stacked, unless `sources`
  const uint8_t* up;
  const uint8_t* down;
  QType gate_t, up_t, down_t;
  int64_t n_experts, d_ff, dim;
  bool gate_il = false, up_il = false, down_il = false;
  // Each expert's matrix in the columns layout instead (qcolumns.h: [E, rows, ColumnsRowBytes],
  // rows a multiple of 64): only the input channels whose 8-bit activation is nonzero are read
  // (input sparsity, sparsity/input_sparsity.py; gate and up read the x they are given).
  bool gate_col = false, up_col = false, down_col = false;
  Activation activation = Activation::kSilu;  // silu or relu: act(gate . x) * (up . x)
  // [E, F] or nullptr: down's input h = act(g) * u is zeroed where |h| < mid_thresholds[e, j]
  // (input sparsity of the experts' down projections; the dense path only).
  const float* mid_thresholds = nullptr;
  // down as each expert's down groups, [E, F / 32, D * block bytes] (checkpoint.quants
  // .down_groups; a 32-weight format): the sparse path, relu only. Up rows may then be the
  // file's (only the neurons whose gate fires read theirs) under an interleaved gate.
  bool down_groups = false;
  // [E] where each expert is (the routed ones set), or nullptr: stacked at gate, up, down.
  const MoeExpertSource* sources = nullptr;
};

// Reused across calls (grows, never shrinks).
struct MoeScratch {
  std::vector<int32_t> order, start, fill, slot;  // pairs grouped by expert; group starts [E+1]
  std::vector<float> g, u, y;                      // [P, F], [P, F], [P, D] per (token, expert)
  std::vector<const float*> rows;
  QActs x_gate, x_up, h;
  std::vector<QActView> v_gate, v_up, v_h;
  QSparseFfnScratch sparse;  // the sparse path's, one routed expert at a time
  // [P] per (token, expert): the nonzero channels of down's input (the sparse path: the
  // neurons that fire)
  std::vector<int32_t> n_active;
  std::vector<int32_t> experts;   // the routed experts, those in memory first
  std::atomic<bool> failed{false};
  std::atomic<int64_t> wait_ns{0};  // time spent waiting for sources' reads
};

// y[t] = sum_j weights[t, j] * down[e]^T (act(gate[e] . x_t) * (up[e] . x_t)), e = ids[t, j],
// j in order (a fixed sum: results do not depend on the thread count); an id of -1 is an
// expert another shard holds (expert parallelism): that pair adds nothing here. Preconditions
// (checked by the caller): ids in [-1, E); D a multiple of gate's and up's blocks, F of down's; with
// down_groups: relu, a 32-weight down format, D and F multiples of 32.
// Returns false when a source's read failed (y is then unspecified); s.wait_ns counts the time
// the call waited for reads. kept [N] (or nullptr): per token the nonzero channels of down's
// input (after mid_thresholds; the sparse path: the neurons that fire) summed over its pairs.
bool MoeFfn(const MoeExperts& w, std::span<const float* const> x_rows, const int32_t* ids,
            const float* weights, int64_t k, float* y, MoeScratch& s, ThreadPool& pool,
            int32_t* kept = nullptr);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_MOE_FFN_H_
