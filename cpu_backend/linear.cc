#include "cpu_backend/linear.h"

#include <algorithm>

#include "cpu_backend/sparse_ffn_kernel.h"

namespace pij {
namespace {

// Below this many weight elements one thread finishes before a wake-up would pay off.
constexpr int64_t kParallelMinElements = 1 << 15;
// Rows per task: several tasks per thread even out cores that run at different speeds, while each
// task still streams a long contiguous stretch of the weight matrix.
constexpr int64_t kTasksPerThread = 4;
// From this many tokens rows are taken in pairs (RowPair). One token streams the weights from
// memory, where a second row's loads only add register pressure.
constexpr int64_t kPairMinTokens = 2;

// Rows o and o + 1 for all tokens: the gated dot kernel's two rows share each token's loads,
// and compute each (row, token) dot exactly as the one-row kernel does (same chains, same
// reduction), so pairing never changes a bit.
template <typename W>
void RowPair(const W* w, const float* bias, int64_t out_dim, int64_t dim,
             std::span<const float* const> x_rows, float* y, int64_t o) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  const W* row0 = w + o * dim;
  const W* row1 = row0 + dim;
  const float b0 = bias != nullptr ? bias[o] : 0.0f;
  const float b1 = bias != nullptr ? bias[o + 1] : 0.0f;
  float dots0[internal::kMaxGroup];
  float dots1[internal::kMaxGroup];
  for (int64_t t0 = 0; t0 < num_tokens; t0 += internal::kMaxGroup) {
    const float* const* x = x_rows.data() + t0;
    const int64_t n = std::min<int64_t>(internal::kMaxGroup, num_tokens - t0);
    internal::VisitGroup(n, [&](auto g) {
      internal::NeuronDots<W, decltype(g)::value, true>(row0, row1, x, dim, dots0, dots1);
    });
    for (int64_t t = 0; t < n; ++t) {
      y[(t0 + t) * out_dim + o] = dots0[t] + b0;
      y[(t0 + t) * out_dim + o + 1] = dots1[t] + b1;
    }
  }
}

template <typename W>
void Rows(const W* w, const float* bias, int64_t out_dim, int64_t dim,
          std::span<const float* const> x_rows, float* y, int64_t lo, int64_t hi) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  if (num_tokens >= kPairMinTokens) {  // several tokens: compute-bound, pairs of rows
    for (; lo + 2 <= hi; lo += 2) RowPair(w, bias, out_dim, dim, x_rows, y, lo);
  }
  float unused[internal::kMaxGroup];
  float dots[internal::kMaxGroup];
  for (int64_t o = lo; o < hi; ++o) {
    const W* row = w + o * dim;
    const float b = bias != nullptr ? bias[o] : 0.0f;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += internal::kMaxGroup) {
      const float* const* x = x_rows.data() + t0;
      const int64_t n = std::min<int64_t>(internal::kMaxGroup, num_tokens - t0);
      // one pass over the row serves up to kMaxGroup tokens
      internal::VisitGroup(n, [&](auto g) {
        internal::NeuronDots<W, decltype(g)::value, false>(nullptr, row, x, dim, unused, dots);
      });
      for (int64_t t = 0; t < n; ++t) y[(t0 + t) * out_dim + o] = dots[t] + b;
    }
  }
}

}  // namespace

template <typename W>
void LinearMany(std::span<const LinearOut<W>> outs, int64_t dim,
                std::span<const float* const> x_rows, ThreadPool& pool) {
  int64_t total = 0;
  for (const LinearOut<W>& o : outs) total += o.out_dim;
  // Rows [lo, hi) of the outputs' rows laid end to end.
  auto rows = [&](int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (const LinearOut<W>& o : outs) {
      const int64_t a = std::max(lo, base), b = std::min(hi, base + o.out_dim);
      if (a < b) Rows(o.w, o.bias, o.out_dim, dim, x_rows, o.y, a - base, b - base);
      base += o.out_dim;
    }
  };
  if (total * dim < kParallelMinElements || pool.NumThreads() == 1) {
    rows(0, total);
    return;
  }
  const int64_t tasks = std::min<int64_t>(total, pool.NumThreads() * kTasksPerThread);
  pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
    rows(total * task / tasks, total * (task + 1) / tasks);
  });
}

template <typename W>
void Linear(const W* w, const float* bias, int64_t out_dim, int64_t dim,
            std::span<const float* const> x_rows, float* y, ThreadPool& pool) {
  const LinearOut<W> out{w, bias, out_dim, y};
  LinearMany(std::span<const LinearOut<W>>(&out, 1), dim, x_rows, pool);
}

template void LinearMany<float>(std::span<const LinearOut<float>>, int64_t,
                                std::span<const float* const>, ThreadPool&);
template void LinearMany<Bf16>(std::span<const LinearOut<Bf16>>, int64_t,
                               std::span<const float* const>, ThreadPool&);
template void LinearMany<F16>(std::span<const LinearOut<F16>>, int64_t,
                              std::span<const float* const>, ThreadPool&);
template void Linear<float>(const float*, const float*, int64_t, int64_t,
                            std::span<const float* const>, float*, ThreadPool&);
template void Linear<Bf16>(const Bf16*, const float*, int64_t, int64_t,
                           std::span<const float* const>, float*, ThreadPool&);
template void Linear<F16>(const F16*, const float*, int64_t, int64_t,
                          std::span<const float* const>, float*, ThreadPool&);

}  // namespace pij
