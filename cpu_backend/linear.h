// Dense matrix-vector products on the thread pool: y[t, o] = x[t] . w[o] (+ bias[o]), weights
// stored [O, D] (row o contiguous) in float32, bfloat16 or float16, float32 accumulation.
// Decode reads every weight once per token, so its speed is memory bandwidth: XLA's CPU dot reads
// float32 below bandwidth and has no fast bfloat16 path, while this kernel streams each row once
// at the width it is stored. Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_LINEAR_H_
#define PIJ_CPU_BACKEND_LINEAR_H_

#include <cstdint>
#include <span>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

// x_rows: T rows of `dim` floats. y: [T, out_dim]. bias: [out_dim] or nullptr.
// Output rows are split into contiguous ranges, one per thread; every y element is written by
// exactly one task with a fixed summation order, so results do not depend on the thread count.
template <typename W>
void Linear(const W* w, const float* bias, int64_t out_dim, int64_t dim,
            std::span<const float* const> x_rows, float* y, ThreadPool& pool);

// One output of LinearMany: y[t, o] = x[t] . w[o] (+ bias[o]) for o < out_dim.
template <typename W>
struct LinearOut {
  const W* w;
  const float* bias;  // nullptr: none
  int64_t out_dim;
  float* y;  // [T, out_dim]
};

// Several products of the same x in one pool job (e.g. attention's q, k and v): their rows are
// split as one range, so the small matrices of a decode step cost one dispatch instead of three
// and keep every thread busy. Same rows, same order, same results as separate Linear calls.
template <typename W>
void LinearMany(std::span<const LinearOut<W>> outs, int64_t dim,
                std::span<const float* const> x_rows, ThreadPool& pool);

extern template void LinearMany<float>(std::span<const LinearOut<float>>, int64_t,
                                       std::span<const float* const>, ThreadPool&);
extern template void LinearMany<Bf16>(std::span<const LinearOut<Bf16>>, int64_t,
                                      std::span<const float* const>, ThreadPool&);
extern template void LinearMany<F16>(std::span<const LinearOut<F16>>, int64_t,
                                     std::span<const float* const>, ThreadPool&);

extern template void Linear<float>(const float*, const float*, int64_t, int64_t,
                                   std::span<const float* const>, float*, ThreadPool&);
extern template void Linear<Bf16>(const Bf16*, const float*, int64_t, int64_t,
                                  std::span<const float* const>, float*, ThreadPool&);
extern template void Linear<F16>(const F16*, const float*, int64_t, int64_t,
                                 std::span<const float* const>, float*, ThreadPool&);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_LINEAR_H_
