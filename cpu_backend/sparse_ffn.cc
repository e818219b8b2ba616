#include "cpu_backend/sparse_ffn.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_backend/sparse_ffn_kernel.h"

namespace pij {
namespace {

// Below this many output elements the final reduction runs on the caller: waking the pool costs
// more than summing a few partial rows.
constexpr int64_t kParallelReduceMin = 1 << 15;

// Fills scratch.neurons with the neurons the kernel must visit: all of them for kOracle (every
// activation is needed to decide), else the union over tokens of scores > threshold (kScores)
// or |scores| > threshold (kActivations); a NaN score selects its neuron (pij_math.h).
void CollectNeurons(const FfnTokens& tokens, const SparseFfnParams& p, int64_t num_neurons,
                    SparseFfnScratch& scratch) {
  std::vector<int32_t>& neurons = scratch.neurons;
  neurons.clear();
  neurons.reserve(num_neurons);
  if (p.criterion == Criterion::kOracle) {
    for (int64_t i = 0; i < num_neurons; ++i) neurons.push_back(static_cast<int32_t>(i));
    return;
  }
  const bool magnitude = p.criterion == Criterion::kActivations;
  const float threshold = p.threshold;
  auto selected = [magnitude, threshold](float v) {
    return magnitude ? ActiveByMagnitude(v, threshold) : SelectedByScore(v, threshold);
  };
  if (tokens.score_rows.size() == 1) {
    const float* s = tokens.score_rows[0];
    for (int64_t i = 0; i < num_neurons; ++i) {
      if (selected(s[i])) neurons.push_back(static_cast<int32_t>(i));
    }
    return;
  }
  scratch.marks.assign(num_neurons, 0);
  uint8_t* marks = scratch.marks.data();
  for (const float* s : tokens.score_rows) {
    for (int64_t i = 0; i < num_neurons; ++i) marks[i] |= static_cast<uint8_t>(selected(s[i]));
  }
  for (int64_t i = 0; i < num_neurons; ++i) {
    if (marks[i]) neurons.push_back(static_cast<int32_t>(i));
  }
}

}  // namespace

template <typename W>
void SparseFfn(const FfnWeights<W>& weights, const FfnTokens& tokens, const SparseFfnParams& params,
               ThreadPool& pool, SparseFfnScratch& scratch, float* y, int32_t* n_active) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.x_rows.size());
  const int64_t dim = weights.dim;
  const int64_t out_size = num_tokens * dim;
  CollectNeurons(tokens, params, weights.num_neurons, scratch);

  // One piece per thread, each a fixed range of neuron ids [F*k/P, F*(k+1)/P): a token's
  // contributions are summed in the same pieces and order whatever other tokens share the call
  // (splitting the union of active neurons instead balanced better when active neurons cluster,
  // but a sequence then got other bits decoded in a batch than alone).
  const int64_t num_pieces = std::max<int64_t>(1, std::min<int64_t>(weights.num_neurons,
                                                                     pool.NumThreads()));
  if (static_cast<int64_t>(scratch.partial_y.size()) < (num_pieces - 1) * out_size) {
    scratch.partial_y.resize((num_pieces - 1) * out_size);
  }
  if (static_cast<int64_t>(scratch.partial_count.size()) < num_pieces * num_tokens) {
    scratch.partial_count.resize(num_pieces * num_tokens);
  }
  const std::span<const int32_t> all(scratch.neurons);
  float* partial_y = scratch.partial_y.data();
  int32_t* partial_count = scratch.partial_count.data();
  pool.Run(0, num_pieces, [&](int64_t piece, int /*worker*/) {
    // Piece 0 accumulates straight into y; the others into their own scratch partials.
    float* out = piece == 0 ? y : partial_y + (piece - 1) * out_size;
    int32_t* counts = partial_count + piece * num_tokens;
    std::fill_n(out, out_size, 0.0f);
    std::fill_n(counts, num_tokens, 0);
    const int64_t first = weights.num_neurons * piece / num_pieces;
    const int64_t last = weights.num_neurons * (piece + 1) / num_pieces;
    const int64_t lo = std::lower_bound(all.begin(), all.end(), first) - all.begin();
    const int64_t hi = std::lower_bound(all.begin(), all.end(), last) - all.begin();
    if (hi > lo) {
      internal::AccumulateNeurons(weights, tokens, params, all.subspan(lo, hi - lo), out, counts);
    }
  });

  // y = ((piece 0 + piece 1) + ...) + b_down, always in piece order: deterministic.
  auto reduce = [&](int64_t lo, int64_t hi) {
    for (int64_t piece = 1; piece < num_pieces; ++piece) {
      const float* src = partial_y + (piece - 1) * out_size;
      for (int64_t j = lo; j < hi; ++j) y[j] += src[j];
    }
    if (weights.b_down != nullptr) {
      for (int64_t j = lo; j < hi; ++j) y[j] += weights.b_down[j % dim];
    }
  };
  if (out_size < kParallelReduceMin || pool.NumThreads() == 1) {
    reduce(0, out_size);
  } else {
    const int64_t chunks = pool.NumThreads();
    pool.Run(0, chunks, [&](int64_t c, int /*worker*/) {
      reduce(out_size * c / chunks, out_size * (c + 1) / chunks);
    });
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t total = 0;
    for (int64_t piece = 0; piece < num_pieces; ++piece) total += partial_count[piece * num_tokens + t];
    n_active[t] = total;
  }
}

template void SparseFfn<float>(const FfnWeights<float>&, const FfnTokens&, const SparseFfnParams&,
                               ThreadPool&, SparseFfnScratch&, float*, int32_t*);
template void SparseFfn<Bf16>(const FfnWeights<Bf16>&, const FfnTokens&, const SparseFfnParams&,
                              ThreadPool&, SparseFfnScratch&, float*, int32_t*);
template void SparseFfn<F16>(const FfnWeights<F16>&, const FfnTokens&, const SparseFfnParams&,
                             ThreadPool&, SparseFfnScratch&, float*, int32_t*);

}  // namespace pij
