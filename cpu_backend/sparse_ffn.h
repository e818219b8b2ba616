// Sparse FFN on the CPU: y[t] = b_down + sum over neurons i active for token t of a_i(x_t) * down_t[i]
//   gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)
//   non-gated: a_i = act(up_i . x + b_up_i)
// Weights are neuron-major ([F, D] each, the down projection transposed) so one neuron's rows are
// contiguous, and the kernel reads only the rows of active neurons. Float32 accumulation for
// float32, bfloat16 and float16 weights. Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_SPARSE_FFN_H_
#define PIJ_CPU_BACKEND_SPARSE_FFN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

// How the active set is decided.
//   kScores: neuron i is active for token t iff scores[t][i] > threshold (predictor logits, or a
//            0/1 mask with threshold 0.5). Inactive rows are never read.
//   kOracle: every a_i(x_t) is computed; active iff |a_i| > threshold (threshold 0: a_i != 0).
//   kActivations: scores[t][i] already holds a_i (e.g. the q4 predictor's signed estimate);
//            active iff |a_i| > threshold, and a_i is the coefficient, so only the active
//            neurons' down rows are read: gate and up rows are never touched.
enum class Criterion : int32_t { kScores = 0, kOracle = 1, kActivations = 2 };

template <typename W>
struct FfnWeights {
  const W* gate = nullptr;       // [F, D]; nullptr for a non-gated FFN
  const W* up = nullptr;         // [F, D]
  const W* down_t = nullptr;     // [F, D]
  const float* b_up = nullptr;   // [F] or nullptr
  const float* b_down = nullptr; // [D] or nullptr
  int64_t num_neurons = 0;       // F
  int64_t dim = 0;               // D
};

// Token rows by pointer, so callers can broadcast one row to several tokens (vmap) without copies.
struct FfnTokens {
  std::span<const float* const> x_rows;      // T rows of D floats
  std::span<const float* const> score_rows;  // T rows of F floats; empty for kOracle
};

struct SparseFfnParams {
  Activation activation = Activation::kSilu;
  Criterion criterion = Criterion::kScores;
  float threshold = 0.0f;
  float gate_floor = 0.0f;  // FATReLU's gate threshold (FloorGate, pij_math.h); relu/drelu only
};

// Per-call working memory, kept by the caller across calls so the hot path does no heap work once
// the largest shape has been seen.
struct SparseFfnScratch {
  std::vector<int32_t> neurons;        // the union of active neurons, ascending
  std::vector<uint8_t> marks;          // [F] union flags (prefill)
  std::vector<float> partial_y;        // [tasks - 1, T, D] (task 0 accumulates into y)
  std::vector<int32_t> partial_count;  // [tasks, T]
};

// Computes y [T, D] and n_active [T] (active neurons per token). Deterministic: the active list is
// split into contiguous, equal pieces (one per thread; the split depends only on the inputs and
// the thread count), each piece accumulates into its own partial, and partials are summed in piece
// order. So the output is bitwise identical run to run for a given thread count.
// Preconditions (checked by the caller): non-null rows of the stated sizes, T >= 1.
template <typename W>
void SparseFfn(const FfnWeights<W>& weights, const FfnTokens& tokens, const SparseFfnParams& params,
               ThreadPool& pool, SparseFfnScratch& scratch, float* y, int32_t* n_active);

extern template void SparseFfn<float>(const FfnWeights<float>&, const FfnTokens&,
                                      const SparseFfnParams&, ThreadPool&, SparseFfnScratch&,
                                      float*, int32_t*);
extern template void SparseFfn<Bf16>(const FfnWeights<Bf16>&, const FfnTokens&,
                                     const SparseFfnParams&, ThreadPool&, SparseFfnScratch&, float*,
                                     int32_t*);
extern template void SparseFfn<F16>(const FfnWeights<F16>&, const FfnTokens&,
                                    const SparseFfnParams&, ThreadPool&, SparseFfnScratch&, float*,
                                    int32_t*);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_SPARSE_FFN_H_
