#include "cpu_backend/q4_ffn.h"

#include <algorithm>
#include <cmath>

#include "cpu_backend/sparse_ffn_kernel.h"

namespace pij {
namespace {

// Neurons estimated per step before their active down rows are requested: small enough that the
// requests go out early, large enough that the estimate loop stays tight.
constexpr int64_t kEstimateBlock = 16;

}  // namespace

template <typename W>
void Q4SparseFfn(const Q4EstimateArgs& est, const W* down_t, const float* b_down, float threshold,
                 std::span<const float* const> x_rows, float* y, int32_t* n_active,
                 Q4FfnScratch& scratch, ThreadPool& pool) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  const int64_t f = est.num_neurons;
  const int64_t dim = est.dim;
  const int64_t out_size = num_tokens * dim;
  if (num_tokens == 0) return;
  Q4EstimateArgs args = est;
  args.signed_output = true;
  QuantizeTokens(x_rows, dim, scratch.q8);
  const std::span<const Q8Row> q8(scratch.q8.data(), static_cast<size_t>(num_tokens));
  if (static_cast<int64_t>(scratch.act.size()) < num_tokens * f) scratch.act.resize(num_tokens * f);
  // One range per thread: each range's partial output is [T, D], so more ranges cost memory and
  // reduction time; neuron activity is spread evenly enough over indices for balance.
  const int64_t ranges = std::clamp<int64_t>(f, 1, pool.NumThreads());
  if (static_cast<int64_t>(scratch.partial_y.size()) < (ranges - 1) * out_size) {
    scratch.partial_y.resize((ranges - 1) * out_size);
  }
  if (static_cast<int64_t>(scratch.partial_count.size()) < ranges * num_tokens) {
    scratch.partial_count.resize(ranges * num_tokens);
  }
  if (static_cast<int64_t>(scratch.active.size()) < ranges) scratch.active.resize(ranges);

  float* act = scratch.act.data();
  std::vector<const float*>& act_rows = scratch.act_rows;
  act_rows.resize(static_cast<size_t>(num_tokens));
  for (int64_t t = 0; t < num_tokens; ++t) act_rows[t] = act + t * f;
  FfnWeights<W> w;
  w.down_t = down_t;
  w.num_neurons = f;
  w.dim = dim;
  const FfnTokens tokens{x_rows, std::span<const float* const>(act_rows)};
  SparseFfnParams params;
  params.criterion = Criterion::kActivations;
  params.threshold = threshold;

  pool.Run(0, ranges, [&](int64_t r, int /*worker*/) {
    const int64_t lo = f * r / ranges;
    const int64_t hi = f * (r + 1) / ranges;
    std::vector<int32_t>& active = scratch.active[r];
    active.clear();
    float* out = r == 0 ? y : scratch.partial_y.data() + (r - 1) * out_size;
    int32_t* counts = scratch.partial_count.data() + r * num_tokens;
    std::fill_n(out, out_size, 0.0f);
    std::fill_n(counts, num_tokens, 0);
    for (int64_t b = lo; b < hi; b += kEstimateBlock) {
      const int64_t e = std::min(hi, b + kEstimateBlock);
      Q4EstimateRange(args, q8, b, e, act);
      for (int64_t i = b; i < e; ++i) {
        bool any = false;
        for (int64_t t = 0; t < num_tokens && !any; ++t) {
          any = ActiveByMagnitude(act[t * f + i], threshold);
        }
        if (!any) continue;
        active.push_back(static_cast<int32_t>(i));
        internal::PrefetchRow<2>(down_t + i * dim, dim);  // into L2, read after the estimates
      }
    }
    if (num_tokens == 1) {  // decode: every listed neuron is active for the one token
      internal::AccumulateActiveDown(down_t, dim, act, active, out);
      counts[0] = static_cast<int32_t>(active.size());
    } else {
      internal::AccumulateNeurons(w, tokens, params, active, out, counts);
    }
  });

  // y = ((range 0 + range 1) + ...) + b_down, in range order: deterministic.
  for (int64_t r = 1; r < ranges; ++r) {
    const float* src = scratch.partial_y.data() + (r - 1) * out_size;
    for (int64_t j = 0; j < out_size; ++j) y[j] += src[j];
  }
  if (b_down != nullptr) {
    for (int64_t j = 0; j < out_size; ++j) y[j] += b_down[j % dim];
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t total = 0;
    for (int64_t r = 0; r < ranges; ++r) total += scratch.partial_count[r * num_tokens + t];
    n_active[t] = total;
  }
}

template void Q4SparseFfn<float>(const Q4EstimateArgs&, const float*, const float*, float,
                                 std::span<const float* const>, float*, int32_t*, Q4FfnScratch&,
                                 ThreadPool&);
template void Q4SparseFfn<Bf16>(const Q4EstimateArgs&, const Bf16*, const float*, float,
                                std::span<const float* const>, float*, int32_t*, Q4FfnScratch&,
                                ThreadPool&);
template void Q4SparseFfn<F16>(const Q4EstimateArgs&, const F16*, const float*, float,
                               std::span<const float* const>, float*, int32_t*, Q4FfnScratch&,
                               ThreadPool&);

}  // namespace pij
