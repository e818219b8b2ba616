// The inner loops of the sparse FFN: for a list of neurons, compute each neuron's activation for
// a small group of tokens and accumulate a_i * down_t[i] into per-token partial outputs.
// Single-threaded and allocation-free; sparse_ffn.cc splits the work over threads.
#ifndef PIJ_CPU_BACKEND_SPARSE_FFN_KERNEL_H_
#define PIJ_CPU_BACKEND_SPARSE_FFN_KERNEL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <type_traits>
#include <vector>

#include "cpu_backend/simd.h"
#include "cpu_backend/sparse_ffn.h"

namespace pij::internal {

// Up to this many tokens share one pass over a neuron's rows: each loaded (and widened) weight
// vector feeds kMaxGroup FMAs, so prefill reads each row from memory once per 4 tokens at most,
// while the 2 * kMaxGroup accumulators still fit in registers.
constexpr int kMaxGroup = 4;

// fn(std::integral_constant<int, n>{}) for a token group of n in [1, kMaxGroup]: the kernels
// take the group size as a template parameter (registers per token).
template <class Fn>
inline void VisitGroup(int64_t n, Fn&& fn) {
  static_assert(kMaxGroup == 4, "one case per group size");
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// Dot products of one neuron's gate and up rows with kTok token rows. With one token the loop is
// unrolled kUnroll times so several independent FMA chains hide the FMA latency.
template <typename W, int kTok, bool kGated>
inline void NeuronDots(const W* gate_row, const W* up_row, const float* const* x, int64_t dim,
                       float* gate_dot, float* up_dot) {
  // The same unroll (so the same summation order per token) for every group size: a token's dot
  // products must not depend on how many tokens share its pass, or a sequence decoded in a batch
  // would differ from itself decoded alone. Two chains per accumulator still outrun memory.
  constexpr int kUnroll = 2;
  constexpr int kStep = simd::kLanes * kUnroll;
  simd::Vec acc_g[kTok][kUnroll];
  simd::Vec acc_u[kTok][kUnroll];
  for (int t = 0; t < kTok; ++t) {
    for (int u = 0; u < kUnroll; ++u) {
      acc_g[t][u] = simd::Zero();
      acc_u[t][u] = simd::Zero();
    }
  }
  int64_t d = 0;
  for (; d + kStep <= dim; d += kStep) {
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t off = d + u * simd::kLanes;
      const simd::Vec up_v = simd::Load(up_row + off);
      if constexpr (kGated) {
        const simd::Vec gate_v = simd::Load(gate_row + off);
        for (int t = 0; t < kTok; ++t) {
          const simd::Vec x_v = simd::Load(x[t] + off);
          acc_g[t][u] = simd::MulAdd(gate_v, x_v, acc_g[t][u]);
          acc_u[t][u] = simd::MulAdd(up_v, x_v, acc_u[t][u]);
        }
      } else {
        for (int t = 0; t < kTok; ++t) {
          acc_u[t][u] = simd::MulAdd(up_v, simd::Load(x[t] + off), acc_u[t][u]);
        }
      }
    }
  }
  // Whole vectors left over after the unrolled loop.
  for (; d + simd::kLanes <= dim; d += simd::kLanes) {
    const simd::Vec up_v = simd::Load(up_row + d);
    for (int t = 0; t < kTok; ++t) {
      const simd::Vec x_v = simd::Load(x[t] + d);
      if constexpr (kGated) acc_g[t][0] = simd::MulAdd(simd::Load(gate_row + d), x_v, acc_g[t][0]);
      acc_u[t][0] = simd::MulAdd(up_v, x_v, acc_u[t][0]);
    }
  }
  for (int t = 0; t < kTok; ++t) {
    simd::Vec g = acc_g[t][0];
    simd::Vec v = acc_u[t][0];
    for (int u = 1; u < kUnroll; ++u) {
      g = simd::Add(g, acc_g[t][u]);
      v = simd::Add(v, acc_u[t][u]);
    }
    float g_sum = simd::ReduceSum(g);
    float u_sum = simd::ReduceSum(v);
    // Scalar tail (dim not a multiple of the lane count), as explicit fmas: `sum += w * x` was
    // contracted into an fma in some instantiations and not in others (GCC for Zen 4, D = 200:
    // 8 tail values), so a token's dot differed between a decode call and a batch.
    for (int64_t e = d; e < dim; ++e) {
      if constexpr (kGated) g_sum = std::fma(ToF32(gate_row[e]), x[t][e], g_sum);
      u_sum = std::fma(ToF32(up_row[e]), x[t][e], u_sum);
    }
    gate_dot[t] = g_sum;
    up_dot[t] = u_sum;
  }
}

// y[k] += coef[k] * down_row for the n active tokens of a group; each down vector is loaded once.
template <typename W>
inline void AccumulateDown(const W* down_row, int64_t dim, int n, const float* coef,
                           float* const* y) {
  int64_t d = 0;
  if (n == 1) {  // decode: the common case, kept free of the inner token loop
    const simd::Vec c = simd::Set1(coef[0]);
    float* y0 = y[0];
    for (; d + simd::kLanes <= dim; d += simd::kLanes) {
      simd::Store(y0 + d, simd::MulAdd(c, simd::Load(down_row + d), simd::Load(y0 + d)));
    }
  } else {
    simd::Vec c[kMaxGroup];
    for (int k = 0; k < n; ++k) c[k] = simd::Set1(coef[k]);
    for (; d + simd::kLanes <= dim; d += simd::kLanes) {
      const simd::Vec down_v = simd::Load(down_row + d);
      for (int k = 0; k < n; ++k) {
        simd::Store(y[k] + d, simd::MulAdd(c[k], down_v, simd::Load(y[k] + d)));
      }
    }
  }
  for (; d < dim; ++d) {
    const float w = ToF32(down_row[d]);
    for (int k = 0; k < n; ++k) y[k][d] = std::fma(coef[k], w, y[k][d]);  // fma: see NeuronDots
  }
}

// One neuron, tokens [t0, t0 + kTok), criterion kScores or kOracle: coef[t] = a_i of token t
// where the neuron is active for it (active[t]; counted), 0 elsewhere. Returns whether any token
// uses it (with kScores, an unwanted neuron's rows are never read).
template <typename W, int kTok, bool kGated>
inline bool NeuronCoefs(const FfnWeights<W>& w, const FfnTokens& tokens, const SparseFfnParams& p,
                        int32_t i, int64_t t0, float* coef, bool* active, int32_t* counts) {
  const int64_t row = static_cast<int64_t>(i) * w.dim;
  const bool by_scores = p.criterion == Criterion::kScores;
  bool wanted[kTok];
  if (by_scores) {
    bool any = false;
    for (int t = 0; t < kTok; ++t) {
      wanted[t] = SelectedByScore(tokens.score_rows[t0 + t][i], p.threshold);
      any = any || wanted[t];
    }
    if (!any) {  // no token of this group needs the neuron: its rows stay untouched
      std::fill_n(coef, kTok, 0.0f);
      std::fill_n(active, kTok, false);
      return false;
    }
  }
  float gate_dot[kTok];
  float up_dot[kTok];
  NeuronDots<W, kTok, kGated>(kGated ? w.gate + row : nullptr, w.up + row,
                              tokens.x_rows.data() + t0, w.dim, gate_dot, up_dot);
  const float b_up = w.b_up != nullptr ? w.b_up[i] : 0.0f;
  bool any = false;
  for (int t = 0; t < kTok; ++t) {
    const float up = up_dot[t] + b_up;
    const float a =
        kGated ? GatedActivate(p.activation, FloorGate(gate_dot[t], p.gate_floor), up)
               : Activate(p.activation, up);
    active[t] = by_scores ? wanted[t] : ActiveByMagnitude(a, p.threshold);
    coef[t] = active[t] ? a : 0.0f;
    counts[t0 + t] += active[t];
    any = any || active[t];
  }
  return any;
}

// One neuron, tokens [t0, t0 + kTok): decides per token whether the neuron is active and
// accumulates its contribution into that token's partial output row and count.
template <typename W, int kTok, bool kGated>
inline void ProcessNeuron(const FfnWeights<W>& w, const FfnTokens& tokens,
                          const SparseFfnParams& p, int32_t i, int64_t t0, float* y_partial,
                          int32_t* counts) {
  const int64_t dim = w.dim;
  const int64_t row = static_cast<int64_t>(i) * dim;
  float coef[kTok];
  float* active_y[kTok];
  int n = 0;
  if (p.criterion == Criterion::kActivations) {  // a_i given: only the down row is read
    for (int t = 0; t < kTok; ++t) {
      const float a = tokens.score_rows[t0 + t][i];
      if (!ActiveByMagnitude(a, p.threshold)) continue;
      ++counts[t0 + t];
      coef[n] = a;
      active_y[n] = y_partial + (t0 + t) * dim;
      ++n;
    }
    if (n > 0) AccumulateDown(w.down_t + row, dim, n, coef, active_y);
    return;
  }
  bool active[kTok];
  if (!NeuronCoefs<W, kTok, kGated>(w, tokens, p, i, t0, coef, active, counts)) return;
  float packed[kTok];
  for (int t = 0; t < kTok; ++t) {
    if (!active[t]) continue;
    packed[n] = coef[t];
    active_y[n] = y_partial + (t0 + t) * dim;
    ++n;
  }
  AccumulateDown(w.down_t + row, dim, n, packed, active_y);
}

// Accumulates the contributions of `neurons` for all tokens into y_partial [T, D] (zeroed by the
// caller) and counts [T]. Neurons are the outer loop so each weight row comes from memory once;
// token groups reuse it from L1/L2.
// Active neurons are scattered, so their rows are short runs with gaps that the hardware
// prefetcher does not follow: without help each neuron starts with a DRAM round trip (measured:
// 50% active read 7 GB/s vs 26 GB/s dense). Requesting the rows of a neuron some places ahead
// keeps several neurons' loads in flight while the current one computes.
// Distances and cache levels (measured on the 2-core AMD EPYC VM, one thread):
//  - gate/up/down rows (kScores, kOracle): into L1 (prefetcht0), 6 neurons ahead; into L2 was no
//    faster for three rows per neuron;
//  - down rows only (kActivations): into L2 (prefetcht1), 8 neurons ahead: 47% of 1536 rows of
//    576 bf16 read at 12.6 GB/s vs 6.9 GB/s into L1 and 5.6 GB/s without prefetching (dense
//    streaming: 14 GB/s), as L1's few miss buffers no longer cap the loads in flight.
// The distances are tuning knobs (PIJ_PREFETCH_AHEAD=n, PIJ_PREFETCH_AHEAD_DOWN=n, read once)
// for ablations.
inline int64_t EnvDistance(const char* name, long fallback) {
  const char* env = std::getenv(name);
  const long v = env != nullptr ? std::strtol(env, nullptr, 10) : fallback;
  return static_cast<int64_t>(std::clamp<long>(v, 0, 64));
}
inline int64_t PrefetchAhead() {
  static const int64_t ahead = EnvDistance("PIJ_PREFETCH_AHEAD", 6);
  return ahead;
}
inline int64_t PrefetchAheadDown() {
  static const int64_t ahead = EnvDistance("PIJ_PREFETCH_AHEAD_DOWN", 8);
  return ahead;
}
constexpr int64_t kCacheLine = 64;

template <int kLocality, typename W>
inline void PrefetchRow(const W* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(W));
  for (int64_t off = 0; off < bytes; off += kCacheLine) __builtin_prefetch(p + off, 0, kLocality);
}

// down_only: the kActivations criterion, which never reads gate and up rows (into L2, see above).
template <typename W, bool kGated>
inline void PrefetchNeuron(const FfnWeights<W>& w, int32_t i, bool down_only) {
  const int64_t row = static_cast<int64_t>(i) * w.dim;
  if (down_only) {
    PrefetchRow<2>(w.down_t + row, w.dim);
    return;
  }
  if constexpr (kGated) PrefetchRow<3>(w.gate + row, w.dim);
  PrefetchRow<3>(w.up + row, w.dim);
  PrefetchRow<3>(w.down_t + row, w.dim);
}

// y += sum_k coef[k] * rows[k] for kRows rows in one pass over y: y is loaded and stored once
// per kRows rows instead of once per row. Per element the FMAs run in row order, exactly as
// kRows single-row passes would: the result is bitwise the same.
template <int kRows, typename W>
inline void AccumulateRows(const W* const* rows, const float* coef, int64_t dim, float* y) {
  simd::Vec c[kRows];
  for (int k = 0; k < kRows; ++k) c[k] = simd::Set1(coef[k]);
  int64_t d = 0;
  for (; d + simd::kLanes <= dim; d += simd::kLanes) {
    simd::Vec acc = simd::Load(y + d);
    for (int k = 0; k < kRows; ++k) acc = simd::MulAdd(c[k], simd::Load(rows[k] + d), acc);
    simd::Store(y + d, acc);
  }
  for (; d < dim; ++d) {
    for (int k = 0; k < kRows; ++k) y[d] = std::fma(coef[k], ToF32(rows[k][d]), y[d]);
  }
}

// Decode (one token) with the activations given: y += sum_k act[i_k] * down_t[i_k] over
// `neurons` (all active), kDownGroup rows per pass over y (see AccumulateRows), in list order.
// No prefetching here: the callers request the rows ahead. Measured on SmolLM2 shapes (52% of
// 1536 rows of 576 bf16 per layer, benchmarks/cpp/q4_ffn_layers.cc): the q4 FFN 1.1-1.2x faster
// than with one row per pass, whose y loads and stores competed with the row loads.
constexpr int kDownGroup = 8;

template <typename W>
void AccumulateActiveDown(const W* down_t, int64_t dim, const float* act,
                          std::span<const int32_t> neurons, float* y) {
  const W* rows[kDownGroup];
  float coef[kDownGroup];
  const size_t n = neurons.size();
  size_t k = 0;
  for (; k + kDownGroup <= n; k += kDownGroup) {
    for (int j = 0; j < kDownGroup; ++j) {
      const int32_t i = neurons[k + j];
      rows[j] = down_t + static_cast<int64_t>(i) * dim;
      coef[j] = act[i];
    }
    AccumulateRows<kDownGroup>(rows, coef, dim, y);
  }
  // The last < kDownGroup rows one at a time (same FMA order per element as a group).
  for (; k < n; ++k) {
    const int32_t i = neurons[k];
    rows[0] = down_t + static_cast<int64_t>(i) * dim;
    coef[0] = act[i];
    AccumulateRows<1>(rows, coef, dim, y);
  }
}

template <typename W>
void AccumulateDownOneToken(const FfnWeights<W>& w, const float* act, float threshold,
                            std::span<const int32_t> neurons, float* y, int32_t* count) {
  const int64_t dim = w.dim;
  const int64_t n = static_cast<int64_t>(neurons.size());
  const int64_t ahead = PrefetchAheadDown();
  constexpr int64_t kChunk = 64;  // neurons filtered per step; their active rows then accumulate
  int32_t active[kChunk];
  for (int64_t k = 0; k < std::min<int64_t>(ahead, n); ++k) {
    PrefetchRow<2>(w.down_t + static_cast<int64_t>(neurons[k]) * dim, dim);
  }
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    int m = 0;
    for (int64_t k = c; k < e; ++k) {
      if (k + ahead < n) {
        PrefetchRow<2>(w.down_t + static_cast<int64_t>(neurons[k + ahead]) * dim, dim);
      }
      if (ActiveByMagnitude(act[neurons[k]], threshold)) active[m++] = neurons[k];
    }
    *count += m;
    AccumulateActiveDown(w.down_t, dim, act, std::span<const int32_t>(active, m), y);
  }
}

// Several tokens: y[t] += sum_k coef[k][t] * rows[k] over a block of m neurons, with a tile of
// kTok tokens x kVec vectors of y held in registers across the block (one y load and store per
// block instead of per neuron). Per element the FMAs still run in neuron order from the same
// start, as AccumulateDown's: a token's sum is bitwise what it gets decoded alone (a zero coef,
// an inactive token, adds an exact 0 to a nonzero sum).
template <typename W, int kTok, int kVec>
inline void DownTile(const W* const* rows, int m, const float* coef, int64_t stride,
                     float* const* y, int64_t d) {
  simd::Vec acc[kTok][kVec];
  for (int t = 0; t < kTok; ++t) {
    for (int v = 0; v < kVec; ++v) acc[t][v] = simd::Load(y[t] + d + v * simd::kLanes);
  }
  for (int k = 0; k < m; ++k) {
    simd::Vec w[kVec];
    for (int v = 0; v < kVec; ++v) w[v] = simd::Load(rows[k] + d + v * simd::kLanes);
    for (int t = 0; t < kTok; ++t) {
      const simd::Vec c = simd::Set1(coef[k * stride + t]);
      for (int v = 0; v < kVec; ++v) acc[t][v] = simd::MulAdd(c, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < kTok; ++t) {
    for (int v = 0; v < kVec; ++v) simd::Store(y[t] + d + v * simd::kLanes, acc[t][v]);
  }
}

template <typename W, int kTok>
inline void DownBlock(const W* const* rows, int m, const float* coef, int64_t stride,
                      float* const* y, int64_t dim) {
  constexpr int kVec = simd::kLanes >= 16 ? 4 : 2;  // 16 or 8 accumulators with 4 tokens
  int64_t d = 0;
  for (; d + kVec * simd::kLanes <= dim; d += kVec * simd::kLanes) {
    DownTile<W, kTok, kVec>(rows, m, coef, stride, y, d);
  }
  for (; d + simd::kLanes <= dim; d += simd::kLanes) {
    DownTile<W, kTok, 1>(rows, m, coef, stride, y, d);
  }
  for (; d < dim; ++d) {  // as AccumulateDown's scalar tail
    for (int k = 0; k < m; ++k) {
      const float w = ToF32(rows[k][d]);
      for (int t = 0; t < kTok; ++t) y[t][d] = std::fma(coef[k * stride + t], w, y[t][d]);
    }
  }
}

// Neurons per DownBlock.
constexpr int kDownBlockNeurons = 8;

template <typename W, bool kGated>
void AccumulateNeuronsBlocked(const FfnWeights<W>& w, const FfnTokens& tokens,
                              const SparseFfnParams& p, std::span<const int32_t> neurons,
                              float* y_partial, int32_t* counts) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.x_rows.size());
  const int64_t n = static_cast<int64_t>(neurons.size());
  const int64_t dim = w.dim;
  thread_local std::vector<float> coef_store;
  if (static_cast<int64_t>(coef_store.size()) < kDownBlockNeurons * num_tokens) {
    coef_store.resize(kDownBlockNeurons * num_tokens);
  }
  float* coef = coef_store.data();  // [neuron of the block][token]
  const W* rows[kDownBlockNeurons];
  int m = 0;
  auto flush = [&] {
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kMaxGroup) {
      float* y[kMaxGroup];
      const int64_t nt = std::min<int64_t>(kMaxGroup, num_tokens - t0);
      for (int64_t t = 0; t < nt; ++t) y[t] = y_partial + (t0 + t) * dim;
      VisitGroup(nt, [&](auto k) {
        DownBlock<W, decltype(k)::value>(rows, m, coef + t0, num_tokens, y, dim);
      });
    }
    m = 0;
  };
  const int64_t ahead = PrefetchAhead();
  for (int64_t k = 0; k < std::min<int64_t>(ahead, n); ++k) {
    PrefetchNeuron<W, kGated>(w, neurons[k], false);
  }
  bool active[kMaxGroup];
  for (int64_t k = 0; k < n; ++k) {
    const int32_t i = neurons[k];
    if (k + ahead < n) PrefetchNeuron<W, kGated>(w, neurons[k + ahead], false);
    float* c = coef + m * num_tokens;
    bool any = false;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kMaxGroup) {
      VisitGroup(std::min<int64_t>(kMaxGroup, num_tokens - t0), [&](auto g) {
        any |= NeuronCoefs<W, decltype(g)::value, kGated>(w, tokens, p, i, t0, c + t0, active,
                                                         counts);
      });
    }
    if (!any) continue;
    rows[m++] = w.down_t + static_cast<int64_t>(i) * dim;
    if (m == kDownBlockNeurons) flush();
  }
  if (m > 0) flush();
}

template <typename W, bool kGated>
void AccumulateNeuronsImpl(const FfnWeights<W>& w, const FfnTokens& tokens,
                           const SparseFfnParams& p, std::span<const int32_t> neurons,
                           float* y_partial, int32_t* counts) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.x_rows.size());
  const int64_t n = static_cast<int64_t>(neurons.size());
  const bool down_only = p.criterion == Criterion::kActivations;
  if (down_only && num_tokens == 1) {
    AccumulateDownOneToken(w, tokens.score_rows[0], p.threshold, neurons, y_partial, counts);
    return;
  }
  if (!down_only && num_tokens > 1) {
    AccumulateNeuronsBlocked<W, kGated>(w, tokens, p, neurons, y_partial, counts);
    return;
  }
  const int64_t ahead = down_only ? PrefetchAheadDown() : PrefetchAhead();
  for (int64_t k = 0; k < std::min<int64_t>(ahead, n); ++k) {
    PrefetchNeuron<W, kGated>(w, neurons[k], down_only);
  }
  for (int64_t k = 0; k < n; ++k) {
    const int32_t i = neurons[k];
    if (k + ahead < n) PrefetchNeuron<W, kGated>(w, neurons[k + ahead], down_only);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kMaxGroup) {
      VisitGroup(std::min<int64_t>(kMaxGroup, num_tokens - t0), [&](auto g) {
        ProcessNeuron<W, decltype(g)::value, kGated>(w, tokens, p, i, t0, y_partial, counts);
      });
    }
  }
}

template <typename W>
void AccumulateNeurons(const FfnWeights<W>& w, const FfnTokens& tokens, const SparseFfnParams& p,
                       std::span<const int32_t> neurons, float* y_partial, int32_t* counts) {
  if (w.gate != nullptr) {
    AccumulateNeuronsImpl<W, true>(w, tokens, p, neurons, y_partial, counts);
  } else {
    AccumulateNeuronsImpl<W, false>(w, tokens, p, neurons, y_partial, counts);
  }
}

}  // namespace pij::internal

#endif  // PIJ_CPU_BACKEND_SPARSE_FFN_KERNEL_H_
