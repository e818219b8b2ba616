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

}  // namespace pij::qsparse

#endif  // PIJ_CPU_BACKEND_QSPARSE_COMMON_H_
