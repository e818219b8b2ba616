// Neuron activation estimates from 4-bit copies of the gate and up rows: the "q4" predictor.
//
// A gated FFN's neuron contributes a_i = act(gate_i . x) * (up_i . x + b_up_i); sparse decode
// wants the neurons with large |a_i| before reading their full-precision rows. A low-rank MLP
// cannot see the product of two projections well (SwiGLU), so this predictor computes the product
// itself, from 4-bit weights and 8-bit activations: it reads about a fifth of the bytes of the
// bf16 gate and up rows, and on a model shipped as Q4_1 its weights are exact.
//
// Weight format (asymmetric, llama.cpp Q4_1-like), per row of `dim` weights padded with zeros to
// `pairs = ceil(dim / 64)` pairs of 32-weight blocks:
//   q:  uint8 [pairs * 32]; byte j of pair p holds weight 64p + j in its low nibble and
//       weight 64p + 32 + j in its high nibble (so one 32-byte load yields 64 weights in order);
//   dm: F16 [4 * pairs] = scales d[2 * pairs] then minimums m[2 * pairs]; weight = m_b + d_b * q.
// A neuron's rows are contiguous: q [F, G, pairs * 32], dm [F, G, 4 * pairs], G = 2 (gate, up)
// for gated FFNs and 1 (up) otherwise. Activations are quantized per 32-block to int8 with a
// float scale (Q8), so a block's dot is d * xd * sum(q * xq) + m * xd * sum(xq).
// Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_Q4_ESTIMATE_H_
#define PIJ_CPU_BACKEND_Q4_ESTIMATE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

inline constexpr int64_t kQ4Block = 32;
inline constexpr int64_t kQ4PairBytes = 32;  // two blocks of nibbles

inline int64_t Q4Pairs(int64_t dim) { return (dim + 2 * kQ4Block - 1) / (2 * kQ4Block); }

// One token's activations in Q8: q [pairs * 64] (zero padded), per block the scale d and
// c = d * sum(q) (the factor of the block's minimum).
struct Q8Row {
  std::vector<int8_t> q;
  std::vector<float> d, c;
};

void QuantizeQ8(const float* x, int64_t dim, Q8Row& out);

// One row's dot with a Q8 row: sum_b d_b * xd_b * sum(q * xq) + m_b * xc_b.
float Q4DotQ8(const uint8_t* q, const F16* dm, const Q8Row& x, int64_t pairs);

// A neuron's gate and up dots with the same Q8 row, sharing the activation loads.
void Q4GateUpDotsQ8(const uint8_t* q_gate, const F16* dm_gate, const uint8_t* q_up,
                    const F16* dm_up, const Q8Row& x, int64_t pairs, float* gate, float* up);

struct Q4EstimateArgs {
  const uint8_t* q = nullptr;  // [F, G, pairs * 32]
  const F16* dm = nullptr;     // [F, G, 4 * pairs]
  const float* b_up = nullptr;  // [F] or nullptr
  int64_t num_neurons = 0, dim = 0;
  bool gated = true;
  Activation activation = Activation::kSilu;
  bool signed_output = false;  // a_i itself instead of |a_i|
};

// Tokens -> Q8 rows (scratch grows, never shrinks).
void QuantizeTokens(std::span<const float* const> x_rows, int64_t dim, std::vector<Q8Row>& scratch);

// Single-threaded: the estimates of neurons [lo, hi) for every token in q8, written to
// out[t * F + i] (|a| or a, per args.signed_output).
void Q4EstimateRange(const Q4EstimateArgs& args, std::span<const Q8Row> q8, int64_t lo,
                     int64_t hi, float* out);

// scores[t * F + i] = |act(gate_i . x_t) * (up_i . x_t + b_up_i)| (gated) or
// |act(up_i . x_t + b_up_i)|, estimated (without the absolute value if args.signed_output). Neurons are split into contiguous ranges; each score is
// computed by one task in a fixed order, so results do not depend on the thread count.
// `scratch` holds the tokens' Q8 rows between calls (no allocation in steady state).
void Q4Scores(const Q4EstimateArgs& args, std::span<const float* const> x_rows, float* scores,
              std::vector<Q8Row>& scratch, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_Q4_ESTIMATE_H_
