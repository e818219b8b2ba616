// Pieces of the quantized sparse FFN shared by the kernels that sum neuron rows the same way:
// qsparse_ffn.cc (rows in the model's arrays) and disk_ffn.cc (rows in a neuron store, wherever
// they live). Both split the neurons into the same fixed id ranges ("pieces"), round 4-bit rows'
// coefficients per 32 ids and sum down rows kDownGroup at a time in id order, so a store's layer
// gives the bits of ops.qsparse_ffn over the same rows (tests/test_offload_kernel.py).
#ifndef PIJ_CPU_BACKEND_QSPARSE_COMMON_H_
#define PIJ_CPU_BACKEND_QSPARSE_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <span>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_kernels.h"

namespace pij::qsparse {

// Pieces: at least this many candidate neurons each, at most kMaxPieces (enough for the thread
// counts decode runs at; fixed so that the partition never depends on the pool).
constexpr int64_t kNeuronsPerPiece = 64;
constexpr int64_t kMaxPieces = 16;
// Decode down rows per pass over y (as sparse_ffn_kernel.h's kDownGroup).
constexpr int kDownGroup = 8;

inline int64_t NumPieces(int64_t candidates) {
  return std::clamp<int64_t>((candidates + kNeuronsPerPiece - 1) / kNeuronsPerPiece, 1, kMaxPieces);
}

// The first neuron id after piece k of `pieces` over f neurons, pieces ending at multiples of
// `align` (32 where coefs are rounded per 32 ids, so a group rounds together).
inline int64_t PieceEnd(int64_t k, int64_t pieces, int64_t f, int64_t align) {
  return (f / align) * (k + 1) / pieces * align;
}

// Whether act(g) * u is exactly 0 for every g <= 0 (ReLU-family gates: relu, drelu).
constexpr bool ZeroBelowZero(Activation a) {
  return a == Activation::kRelu || a == Activation::kDrelu;
}

// coef[k] of neurons[k] (in id order) -> its 8-bit rounding per run of one group of 32 ids, as
// QuantizeBlock rounds the group's 32 values with the others 0 (qkern::QuantizeLanes), the
// reference's round_activations; a run holding a NaN or inf becomes NaN.
inline void RoundCoefsPer32(std::span<const int32_t> neurons, std::span<float> coef) {
  int32_t lanes[32];
  int8_t q[32];
  for (size_t i = 0, j; i < neurons.size(); i = j) {
    for (j = i; j < neurons.size() && neurons[j] / 32 == neurons[i] / 32; ++j) {
      lanes[j - i] = neurons[j] % 32;
    }
    int32_t q_sum;
    const float d = qkern::QuantizeLanes(lanes, coef.data() + i, static_cast<int>(j - i), q, &q_sum);
    for (size_t k = i; k < j; ++k) coef[k] = static_cast<float>(q[lanes[k - i]]) * d;
  }
}

// The tokens quantized once for each block size the up and gate formats need (up_block,
// gate_block: 32 or 256), and per token a view of each: both kernels' scratch (act32, act256,
// up_views, gate_views).
template <class Scratch>
void QuantizeTokens(std::span<const float* const> x_rows, int64_t dim, int64_t up_block,
                    int64_t gate_block, Scratch& s, ThreadPool& pool) {
  QActs& up_acts = up_block == 256 ? s.act256 : s.act32;
  QActs& gate_acts = gate_block == 256 ? s.act256 : s.act32;
  QuantizeActs(x_rows, dim, up_block, up_acts, pool);
  if (gate_block != up_block) QuantizeActs(x_rows, dim, gate_block, gate_acts, pool);
  const size_t num_tokens = x_rows.size();
  s.up_views.resize(num_tokens);
  s.gate_views.resize(num_tokens);
  for (size_t t = 0; t < num_tokens; ++t) {
    s.up_views[t] = up_acts.View(static_cast<int64_t>(t), up_block == 256 ? 16 : 32);
    s.gate_views[t] = gate_acts.View(static_cast<int64_t>(t), gate_block == 256 ? 16 : 32);
  }
}

}  // namespace pij::qsparse

#endif  // PIJ_CPU_BACKEND_QSPARSE_COMMON_H_
