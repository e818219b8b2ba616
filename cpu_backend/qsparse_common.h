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
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_kernels.h"
#include "cpu_backend/thread_pool.h"

namespace pij::qsparse {

// Pieces: at least this many candidate neurons each, at most kMaxPieces (enough for the thread
// counts decode runs at; fixed so that the partition never depends on the pool).
constexpr int64_t kNeuronsPerPiece = 64;
constexpr int64_t kMaxPieces = 16;
// Decode down rows per pass over y (as sparse_ffn_kernel.h's kDownGroup).
constexpr int kDownGroup = 8;

constexpr int64_t kCacheLine = 64;
// Neurons ahead whose gate/up rows are requested while the current one's are read.
constexpr size_t kGateUpAhead = 4;

// Whether a neuron's gate turns on for some token: relu-family a_i is 0 wherever gate <= floor
// (0, or FATReLU's gate threshold), so a neuron off for every token needs no up row (NaN counts
// as on: it must reach the output).
inline bool GateOn(const float* gate, int64_t ntok, float floor) {
  bool on = false;
  for (int64_t t = 0; t < ntok; ++t) on |= !(gate[t] <= floor);
  return on;
}

inline void PrefetchL2(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += kCacheLine) __builtin_prefetch(p + off, 0, 2);
}

// out[m][j * ntok + t] = row_at(m, j) . x_t for the n listed neurons j and kRows matrices m of
// format F; row_at(m, j) for n <= j < n + n_next: the neurons listed next, whose rows are
// requested ahead. `streamed`: the n rows are consecutive rows of one array per matrix.
// Decode takes two neurons per tile (2 * kRows independent dot chains: one row alone is bound by
// its chain's FMA latency); several tokens already give a tile independent chains, so they take
// one neuron at a time (fewer tile shapes to compile). A tile's arithmetic per (row, token) is
// the same whatever the tile, so are the bits.
// Reading ahead: consecutive rows (every neuron of the oracle's pass, dense runs of candidates)
// are kRows streams, read with qlinear's stream prefetch, which also runs on into the next
// pieces' rows (the hardware prefetcher stops at each 4 KiB page). With this and the pieces' runs
// per thread (QSparseFfn), the decode estimate pass over SmolLM2's gate and up takes 1.15x
// ops.qlinear_many's time over the same rows, against 1.30x with per-neuron requests and pieces
// handed out one by one (2 threads, Cascade Lake, min of ~350 interleaved runs over the 30
// layers). Scattered rows (the hardware prefetcher does not follow gaps): at decode the next
// pair's rows are requested as this pair's are read (qkern::CompanionPrefetch; with the down
// rows' prefetch, one synthetic 7B layer at ~10% active, 2 threads, rotating over 32 layers:
// median 0.85 -> 0.76 ms with Q4_0 down rows and 0.85 -> 0.83 ms with down groups, 5 paired
// rounds); in token tiles the rows of the neuron kGateUpAhead places further are requested whole
// first.
template <class F, int kRows, class RowAt>
void NeuronDots(const RowAt& row_at, size_t n, size_t n_next, bool streamed, const QActView* xs,
                int64_t ntok, int64_t dim, float* const* out) {
  constexpr int kPair = 2;
  const int64_t nblocks = dim / F::kBlock;
  const int64_t row_bytes = nblocks * F::kBytes;
  float dots[kRows * qkern::kMaxTokens];
  if (n == 0) return;
  const size_t step = ntok == 1 ? kPair : 1;
  for (size_t j = 0; j < n; j += step) {
    const int group = static_cast<int>(std::min(step, n - j));
    const uint8_t* rows[kPair * kRows];  // row q * kRows + m: neuron j + q, matrix m
    for (int q = 0; q < group; ++q) {
      for (int m = 0; m < kRows; ++m) rows[q * kRows + m] = row_at(m, j + q);
    }
    if (group == kPair) {  // decode
      float pair_dots[kPair * kRows];
      if (streamed) {
        qkern::DotTile<F, kPair * kRows, 1, qkern::kStreamAhead>(rows, xs, nblocks, pair_dots);
      } else {
        // the next pair's rows (listed, then next) are requested as this pair's are read
        const uint8_t* ahead[kPair * kRows];
        int n_ahead = 0;
        for (int q = 0; q < kPair; ++q) {
          const size_t a = j + kPair + q;
          if (a >= n + n_next) break;
          for (int m = 0; m < kRows; ++m) ahead[q * kRows + m] = row_at(m, a);
          ++n_ahead;
        }
        for (int q = n_ahead; q < kPair && n_ahead > 0; ++q) {  // one neuron left: twice
          for (int m = 0; m < kRows; ++m) ahead[q * kRows + m] = ahead[m];
        }
        qkern::DotTile<F, kPair * kRows, 1>(rows, xs, nblocks, pair_dots,
                                            n_ahead > 0 ? ahead : nullptr);
      }
      for (int r = 0; r < kPair * kRows; ++r) out[r % kRows][j + r / kRows] = pair_dots[r];
      continue;
    }
    for (int q = 0; q < group && !streamed; ++q) {  // tokens in tiles: whole rows ahead
      const size_t a = j + q + kGateUpAhead;
      if (a < n + n_next) {
        for (int m = 0; m < kRows; ++m) PrefetchL2(row_at(m, a), row_bytes);
      }
    }
    for (int64_t t = 0; t < ntok;) {
      const int64_t c = qkern::TokenTile<F, kRows>(rows, xs, t, ntok, nblocks, dots);
      for (int m = 0; m < kRows; ++m) {
        for (int k = 0; k < c; ++k) out[m][j * ntok + t + k] = dots[m * c + k];
      }
      t += c;
    }
  }
}

// y += sum_k coef[k] * down_at(k) over n down rows of format F (neuron rows along D), kDownGroup
// rows per pass over y; each pass requests the next pass's rows as it reads its own (the first
// pass's were requested by the caller when their neurons turned out active).
template <class F, class RowAt>
void AxpyDownRows(const RowAt& down_at, const float* coef, size_t n, int64_t dim, float* y) {
  const int64_t nblocks = dim / F::kBlock;
  const uint8_t* rows[kDownGroup];
  const uint8_t* ahead[kDownGroup];
  size_t k = 0;
  for (; k + kDownGroup <= n; k += kDownGroup) {
    const size_t rest = n - k - kDownGroup;
    for (int j = 0; j < kDownGroup; ++j) {
      rows[j] = down_at(k + j);
      ahead[j] = rest == 0 ? nullptr : down_at(k + kDownGroup + std::min<size_t>(j, rest - 1));
    }
    qkern::AxpyRows<F, kDownGroup>(rows, coef + k, nblocks, y, rest == 0 ? nullptr : ahead);
  }
  for (; k < n; ++k) {
    rows[0] = down_at(k);
    qkern::AxpyRows<F, 1>(rows, coef + k, nblocks, y);
  }
}

inline int64_t NumPieces(int64_t candidates) {
  return std::clamp<int64_t>((candidates + kNeuronsPerPiece - 1) / kNeuronsPerPiece, 1, kMaxPieces);
}

// The first neuron id after piece k of `pieces` over f neurons, pieces ending at multiples of
// `align` (32 where coefs are rounded per 32 ids, so a group rounds together).
inline int64_t PieceEnd(int64_t k, int64_t pieces, int64_t f, int64_t align) {
  return (f / align) * (k + 1) / pieces * align;
}

// Split pieces [0, ends.size()) into `tasks` runs of consecutive pieces with about equal
// candidate counts (ends: the running count at each piece's end): run r is [runs[r], runs[r + 1]).
inline void PieceRuns(std::span<const int64_t> ends, int64_t tasks, std::vector<int64_t>& runs) {
  const int64_t pieces = static_cast<int64_t>(ends.size());
  const int64_t total = ends.back();
  runs.assign(tasks + 1, pieces);
  runs[0] = 0;
  int64_t k = 0;
  for (int64_t r = 1; r < tasks; ++r) {
    // the first piece whose end passes r / tasks of the candidates closes run r - 1; at least
    // one piece per run, so every task has work when there are as many pieces as tasks
    k = std::max(k + 1, std::min(pieces - (tasks - r),
                                 static_cast<int64_t>(std::lower_bound(ends.begin(), ends.end(),
                                                                       total * r / tasks) -
                                                      ends.begin()) + 1));
    runs[r] = k;
  }
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
