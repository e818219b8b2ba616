// The q4 FFN: the q4 predictor's estimates *are* the activations (SparsityConfig.gate_up = "q4").
//   a_i(x) = q4 estimate of act(gate_i . x) * (up_i . x + b_up_i)   (cpu_backend/q4_estimate.h)
//   y = b_down + sum over i with |a_i| > threshold of a_i * down_t[i]
// One call per layer instead of an estimate call plus a sparse FFN call: every thread estimates a
// contiguous range of neurons, prefetches the down rows of the ones that clear the threshold into
// L2 while it goes on estimating, then accumulates those rows into its own partial output. The
// down reads overlap the (compute-bound) estimate, and the active set never leaves the thread.
// Deterministic: the ranges depend only on F and the thread count, and partials are summed in
// range order, so the output is bitwise identical run to run for a given thread count.
// Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_Q4_FFN_H_
#define PIJ_CPU_BACKEND_Q4_FFN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/q4_estimate.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

struct Q4FfnScratch {
  std::vector<Q8Row> q8;            // the tokens in Q8
  std::vector<float> act;           // [T, F] the signed estimates
  std::vector<const float*> act_rows;  // [T] rows of act
  std::vector<float> partial_y;     // [ranges - 1, T, D] (range 0 accumulates into y)
  std::vector<int32_t> partial_count;  // [ranges, T]
  std::vector<std::vector<int32_t>> active;  // per range: its neurons active for any token
};

// y [T, D] and n_active [T] for the tokens x_rows. est: the q4 rows (est.gated must be true or
// false as they were built; est.signed_output is ignored). down_t [F, D] (float32, bfloat16 or
// float16), b_down [D] or nullptr. Preconditions (checked by the caller): shapes as stated.
template <typename W>
void Q4SparseFfn(const Q4EstimateArgs& est, const W* down_t, const float* b_down, float threshold,
                 std::span<const float* const> x_rows, float* y, int32_t* n_active,
                 Q4FfnScratch& scratch, ThreadPool& pool);

extern template void Q4SparseFfn<float>(const Q4EstimateArgs&, const float*, const float*, float,
                                        std::span<const float* const>, float*, int32_t*,
                                        Q4FfnScratch&, ThreadPool&);
extern template void Q4SparseFfn<Bf16>(const Q4EstimateArgs&, const Bf16*, const float*, float,
                                       std::span<const float* const>, float*, int32_t*,
                                       Q4FfnScratch&, ThreadPool&);
extern template void Q4SparseFfn<F16>(const Q4EstimateArgs&, const F16*, const float*, float,
                                      std::span<const float* const>, float*, int32_t*,
                                      Q4FfnScratch&, ThreadPool&);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_Q4_FFN_H_
