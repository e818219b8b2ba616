#include "cpu_backend/qsparse_ffn.h"

#include <algorithm>
#include <cmath>

#include "cpu_backend/qsparse_common.h"
#include "cpu_backend/quant_interleaved.h"
#include "cpu_backend/quant_kernels.h"
#include "cpu_backend/simd.h"

namespace pij {
namespace {

using qsparse::kDownGroup;
using qsparse::GateOn;
using qsparse::kGateUpAhead;
using qsparse::NumPieces;
using qsparse::PrefetchL2;
using qsparse::RoundCoefsPer32;
using qsparse::ZeroBelowZero;
// Prefill tokens per pass: the partial outputs are [pieces, chunk, D].
constexpr int64_t kTokenChunk = 32;
// Neurons estimated per step before their down rows are requested (as q4_ffn.cc).
constexpr int64_t kEstimateBlock = 16;
static_assert(kEstimateBlock == qkern::kInterleave, "an interleaved group is one estimate block");
// Below this many output values the final reduction runs on the caller.
constexpr int64_t kParallelReduceMin = 1 << 15;
// NeuronDots (qsparse_common.h) over rows of the model's arrays: `neurons`, then `next`.
template <class F, int kRows>
void ArrayDots(const uint8_t* const* mats, std::span<const int32_t> neurons,
               std::span<const int32_t> next, const QActView* xs, int64_t ntok, int64_t dim,
               float* const* out) {
  const size_t n = neurons.size();
  if (n == 0) return;
  const int64_t row_bytes = dim / F::kBlock * F::kBytes;
  // (one neuron alone is not a stream: it still requests the next block's rows)
  const bool streamed = n > 1 && neurons[n - 1] - neurons[0] == static_cast<int64_t>(n) - 1;
  const auto row_at = [&](int m, size_t j) {
    return mats[m] + (j < n ? neurons[j] : next[j - n]) * row_bytes;
  };
  qsparse::NeuronDots<F, kRows>(row_at, n, next.size(), streamed, xs, ntok, dim, out);
}

// out[j * ntok + t] = row j of the 16-row group `group` (interleaved, quant_interleaved.h) . x_t:
// the oracle's estimate block of 16 consecutive neurons in one tile per token (decode: streamed
// ahead, as the groups are read in order) or per 4 tokens.
template <class F>
void GroupDots(const uint8_t* mat, int64_t group, const QActView* xs, int64_t ntok, int64_t dim,
               float* out) {
  if constexpr (qkern::Interleavable(F::kType)) {
    constexpr int64_t kG = qkern::kInterleave;
    const int64_t nblocks = dim / F::kBlock;
    const uint8_t* g = mat + group * nblocks * F::kBytes * kG;
    float dots[qkern::kMaxTokens * kG];
    for (int64_t t = 0; t < ntok;) {
      const int64_t n = qkern::InterleavedTokenTile<F>(g, nblocks, xs, t, ntok, dots);
      for (int64_t k = 0; k < n; ++k) {
        for (int64_t j = 0; j < kG; ++j) out[j * ntok + t + k] = dots[k * kG + j];
      }
      t += n;
    }
  }
}

// The neurons' a_i for tokens [t0, t0 + ntok): act [j * ntok + t].
void Activations(const QFfnWeights& w, const QSparseFfnParams& p, const QSparseFfnScratch& s,
                 std::span<const int32_t> neurons, std::span<const int32_t> next, int64_t t0,
                 int64_t ntok, QSparseFfnScratch::Piece& piece) {
  float* gate = piece.gate.data();
  float* up = piece.up.data();
  const bool gated = w.gate != nullptr;
  if (w.up_interleaved) {  // one group: neurons are its 16 ids (QSparseFfn aligns blocks)
    const int64_t group = neurons[0] / qkern::kInterleave;
    if (gated) {
      VisitQType(w.gate_type, [&]<class F>(F) {
        GroupDots<F>(w.gate, group, s.gate_views.data() + t0, ntok, w.dim, gate);
      });
    }
    VisitQType(w.up_type, [&]<class F>(F) {
      GroupDots<F>(w.up, group, s.up_views.data() + t0, ntok, w.dim, up);
    });
  } else if (gated && ZeroBelowZero(p.activation) && p.criterion == Criterion::kScores &&
             !w.gate_interleaved && w.gate_type == w.up_type) {
    // Predicted neurons mostly fire (a predictor's precision: 0.9 on the synthetic 7B), so the
    // up rows the gate-first pass below would skip are few, and reading a neuron's gate and up
    // rows in one tile keeps twice the rows in flight: one 7B layer at ~10% active, 2 threads,
    // 0.75 -> 0.69 ms (8 interleaved rounds, /proc/cpuinfo: Xeon with AMX). a_i is the same: the
    // up value of a neuron whose gate no token turns on is zeroed, never used (a poisoned
    // row is read but its NaN is dropped).
    VisitQType(w.up_type, [&]<class F>(F) {
      const uint8_t* mats[2] = {w.gate, w.up};
      float* outs[2] = {gate, up};
      ArrayDots<F, 2>(mats, neurons, next, s.up_views.data() + t0, ntok, w.dim, outs);
    });
    for (size_t j = 0; j < neurons.size(); ++j) {
      if (!GateOn(gate + j * ntok, ntok, p.gate_floor)) std::fill_n(up + j * ntok, ntok, 0.0f);
    }
  } else if (gated && ZeroBelowZero(p.activation)) {
    // relu(gate) is exactly 0 where gate <= 0, and so is a_i whatever the up row holds: read
    // the gate rows first (a whole interleaved group, or the neurons' rows), then the up rows
    // only of neurons some token's gate turns on (a ReLU model's up reads fall with its
    // sparsity; the up values of the others are never used, nor read: a poisoned row stays
    // unread, tests/test_ops_qsparse_ffn.py).
    if (w.gate_interleaved) {  // one group: neurons are its 16 ids (QSparseFfn aligns blocks)
      VisitQType(w.gate_type, [&]<class F>(F) {
        GroupDots<F>(w.gate, neurons[0] / qkern::kInterleave, s.gate_views.data() + t0, ntok,
                     w.dim, gate);
      });
    } else {
      VisitQType(w.gate_type, [&]<class F>(F) {
        ArrayDots<F, 1>(&w.gate, neurons, next, s.gate_views.data() + t0, ntok, w.dim, &gate);
      });
    }
    int32_t on_ids[kEstimateBlock];
    int64_t on_pos[kEstimateBlock];
    int64_t n_on = 0;
    for (size_t j = 0; j < neurons.size(); ++j) {
      if (GateOn(gate + j * ntok, ntok, p.gate_floor)) {
        on_pos[n_on] = static_cast<int64_t>(j);
        on_ids[n_on++] = neurons[j];
      }
    }
    float* on_up = piece.act.data();  // scratch of the same size, written again below
    VisitQType(w.up_type, [&]<class F>(F) {
      ArrayDots<F, 1>(&w.up, std::span<const int32_t>(on_ids, n_on), {},
                       s.up_views.data() + t0, ntok, w.dim, &on_up);
    });
    std::fill_n(up, neurons.size() * ntok, 0.0f);
    for (int64_t k = 0; k < n_on; ++k) {  // back to the neurons' slots
      std::copy_n(on_up + k * ntok, ntok, up + on_pos[k] * ntok);
    }
  } else if (gated && w.gate_type == w.up_type) {  // one pass: the two rows share the loads
    VisitQType(w.up_type, [&]<class F>(F) {
      const uint8_t* mats[2] = {w.gate, w.up};
      float* outs[2] = {gate, up};
      ArrayDots<F, 2>(mats, neurons, next, s.up_views.data() + t0, ntok, w.dim, outs);
    });
  } else {
    if (gated) {
      VisitQType(w.gate_type, [&]<class F>(F) {
        ArrayDots<F, 1>(&w.gate, neurons, next, s.gate_views.data() + t0, ntok, w.dim, &gate);
      });
    }
    VisitQType(w.up_type, [&]<class F>(F) {
      ArrayDots<F, 1>(&w.up, neurons, next, s.up_views.data() + t0, ntok, w.dim, &up);
    });
  }
  const int64_t n = static_cast<int64_t>(neurons.size()) * ntok;
  if (w.b_up != nullptr) {
    for (size_t j = 0; j < neurons.size(); ++j) {
      for (int64_t t = 0; t < ntok; ++t) up[j * ntok + t] += w.b_up[neurons[j]];
    }
  }
  if (gated && p.gate_floor > 0.0f) {  // FATReLU: gates at or below the floor turn off
    for (int64_t k = 0; k < n; ++k) gate[k] = FloorGate(gate[k], p.gate_floor);
  }
  // Whole vectors over the padded arrays: every value goes through the same vector code.
  float* act = piece.act.data();
  for (int64_t k = 0; k < n; k += simd::kLanes) {
    const simd::Vec u = simd::Load(up + k);
    const simd::Vec a = gated ? simd::GatedActivate(p.activation, simd::Load(gate + k), u)
                              : simd::Activate(p.activation, u);
    simd::Store(act + k, a);
  }
}

// Whether the coefs of 4-bit neuron rows are rounded to 8 bits per group of 32 ids before their
// float sum, as PowerInfer's Q4_0 axpy rounds them (Q8_0 per 32 neurons) and as down groups and
// the dense down matvec round their input: Q4_0 / Q4_1 rows, F a multiple of 32.
bool RoundsRowCoefs(const QFfnWeights& w) {
  return !w.down_groups && DownGroupPairs(w.down_type) && w.num_neurons % 32 == 0;
}

// Decode: y += sum over the listed (neuron, coef) of coef * down row, kDownGroup rows per pass.
void AccumulateDown(const QFfnWeights& w, std::span<const int32_t> neurons,
                    std::span<const float> coef, float* y) {
  if (w.down_groups) {  // the neurons are in id order: each group's run is summed in one pass
    VisitQType(w.down_type, [&]<class F>(F) {
      if constexpr (F::kBlock == 32) {
        const int64_t group_bytes = w.dim * F::kBytes;
        int32_t lanes[32];
        for (size_t i = 0, j; i < neurons.size(); i = j) {
          const int32_t g = neurons[i] / 32;
          for (j = i; j < neurons.size() && neurons[j] / 32 == g; ++j) lanes[j - i] = neurons[j] % 32;
          const uint8_t* group = w.down + g * group_bytes;
          const uint8_t* rows = group + DownGroupScaleBytes(F::kType) * w.dim;
          const int n = static_cast<int>(j - i);
          if constexpr (DownGroupPairs(F::kType)) {
            qkern::AxpyPairs<F>(group, qkern::GroupPairRows{rows, w.dim}, w.dim / 32, lanes,
                                coef.data() + i, n, y);
          } else {
            const int64_t row_bytes = w.dim / 32 * (F::kBytes - DownGroupScaleBytes(F::kType));
            const uint8_t* lane_rows[32];
            for (int k = 0; k < n; ++k) lane_rows[k] = rows + lanes[k] * row_bytes;
            qkern::AxpyGroup<F>(group, lane_rows, w.dim / 32, coef.data() + i, n, y);
          }
        }
      }
    });
    return;
  }
  VisitQType(w.down_type, [&]<class F>(F) {
    const int64_t row_bytes = w.dim / F::kBlock * F::kBytes;
    qsparse::AxpyDownRows<F>([&](size_t k) { return w.down + neurons[k] * row_bytes; },
                             coef.data(), neurons.size(), w.dim, y);
  });
}

// One piece's candidates for the tokens [t0, t0 + ntok) into its partial y [ntok, D] and counts.
void RunPiece(const QFfnWeights& w, std::span<const float* const> score_rows,
              const QSparseFfnParams& p, QSparseFfnScratch& s, std::span<const int32_t> cands,
              int64_t t0, int64_t ntok, QSparseFfnScratch::Piece& piece, float* out,
              int32_t* counts) {
  const int64_t dim = w.dim;
  const bool oracle = p.criterion == Criterion::kOracle;
  // What one active neuron's down sum reads: its row, or in groups its quant row or its pair's
  // (the group's scale planes are requested with its first active neuron).
  const int64_t block_bytes = GetQTypeInfo(w.down_type).bytes;
  const int64_t block_scale = w.down_groups ? DownGroupScaleBytes(w.down_type) : 0;
  const int64_t scale_bytes = block_scale * dim;  // a group's scale planes
  const bool pairs = w.down_groups && DownGroupPairs(w.down_type);
  const bool round_coefs = RoundsRowCoefs(w);
  const int64_t down_bytes = w.down_groups
                                 ? dim / 32 * (block_bytes - block_scale) * (pairs ? 2 : 1)
                                 : QRowBytes(w.down_type, dim);
  int32_t last_group = -1, last_row = -1;
  int64_t rows_requested = 0;
  std::fill_n(out, ntok * dim, 0.0f);
  std::fill_n(counts, ntok, 0);
  if (static_cast<int64_t>(piece.active.size()) < ntok) {
    piece.active.resize(ntok);
    piece.coef.resize(ntok);
  }
  for (int64_t t = 0; t < ntok; ++t) {
    piece.active[t].clear();
    piece.coef[t].clear();
  }
  int32_t block[kEstimateBlock];
  for (size_t b = 0; b < cands.size(); b += kEstimateBlock) {
    const size_t e = std::min(cands.size(), b + kEstimateBlock);
    int64_t nb = 0;
    for (size_t k = b; k < e; ++k) {  // scores: skip neurons no token of this chunk wants
      bool wanted = oracle;
      for (int64_t t = 0; t < ntok && !wanted; ++t) {
        wanted = SelectedByScore(score_rows[t0 + t][cands[k]], p.threshold);
      }
      if (wanted) block[nb++] = cands[k];
    }
    if (nb == 0) continue;
    const std::span<const int32_t> neurons(block, nb);
    // The next candidates, whose rows NeuronDots requests ahead (for scores, some may be skipped).
    const std::span<const int32_t> next =
        cands.subspan(e, std::min(kGateUpAhead, cands.size() - e));
    Activations(w, p, s, neurons, next, t0, ntok, piece);
    const float* act = piece.act.data();
    for (int64_t j = 0; j < nb; ++j) {
      bool any = false;
      for (int64_t t = 0; t < ntok; ++t) {
        const float a = act[j * ntok + t];
        const bool on = oracle ? ActiveByMagnitude(a, p.threshold)
                               : SelectedByScore(score_rows[t0 + t][block[j]], p.threshold);
        if (!on) continue;
        ++counts[t];
        if (a == 0.0f) continue;  // selected, but its row would add exact zeros: not read
        piece.active[t].push_back(block[j]);
        piece.coef[t].push_back(a);
        any = true;
      }
      if (!any) continue;  // the active rows are read after the estimates: requested now
      if (!w.down_groups) {  // the first pass's rows; each pass requests the next's (Down)
        if (++rows_requested <= kDownGroup) {
          PrefetchL2(w.down + block[j] * down_bytes, down_bytes);
        }
        continue;
      }
      const uint8_t* group = w.down + (block[j] / 32) * dim * block_bytes;
      if (block[j] / 32 != last_group) PrefetchL2(group, scale_bytes);
      last_group = block[j] / 32;
      const int32_t row = pairs ? block[j] / 2 : block[j];  // (a pair's row is requested once)
      if (row != last_row) {
        PrefetchL2(group + scale_bytes + (row % (pairs ? 16 : 32)) * down_bytes, down_bytes);
      }
      last_row = row;
    }
  }
  // Each token's rows summed alone, in id order (the same calls whatever the batch).
  for (int64_t t = 0; t < ntok; ++t) {
    if (round_coefs) RoundCoefsPer32(piece.active[t], piece.coef[t]);
    AccumulateDown(w, piece.active[t], piece.coef[t], out + t * dim);
  }
}

void CollectCandidates(const QFfnWeights& w, std::span<const float* const> score_rows,
                       const QSparseFfnParams& p, QSparseFfnScratch& s) {
  const int64_t f = w.num_neurons;
  std::vector<int32_t>& cands = s.candidates;
  cands.clear();
  if (p.criterion == Criterion::kOracle) {
    for (int64_t i = 0; i < f; ++i) cands.push_back(static_cast<int32_t>(i));
    return;
  }
  s.marks.assign(f, 0);
  for (const float* row : score_rows) {
    for (int64_t i = 0; i < f; ++i) {
      s.marks[i] |= static_cast<uint8_t>(SelectedByScore(row[i], p.threshold));
    }
  }
  for (int64_t i = 0; i < f; ++i) {
    if (s.marks[i]) cands.push_back(static_cast<int32_t>(i));
  }
}

}  // namespace

void QSparseFfn(const QFfnWeights& w, std::span<const float* const> x_rows,
                std::span<const float* const> score_rows, const QSparseFfnParams& params, float* y,
                int32_t* n_active, QSparseFfnScratch& s, ThreadPool& pool) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  const int64_t dim = w.dim;
  if (num_tokens == 0) return;
  // The tokens quantized once for each block size the gate and up formats need.
  const int64_t up_block = GetQTypeInfo(w.up_type).block;
  const int64_t gate_block = w.gate != nullptr ? GetQTypeInfo(w.gate_type).block : up_block;
  qsparse::QuantizeTokens(x_rows, dim, up_block, gate_block, s, pool);
  CollectCandidates(w, score_rows, params, s);
  const std::span<const int32_t> cands(s.candidates);
  // Pieces are fixed ranges of neuron ids (not of the candidate list), so a token's sum runs in
  // the same pieces and order whatever other tokens share the call: batched decoding gives each
  // sequence the bits it gets alone.
  const int64_t pieces = NumPieces(w.num_neurons);
  // cand_ends[k]: the candidates before piece k + 1's first neuron id. Pieces end at a group's
  // end where coefs are rounded per 32 ids (down groups, RoundsRowCoefs): a group's round together.
  std::vector<int64_t>& cand_ends = s.cand_ends;
  cand_ends.resize(pieces);
  // Interleaved gate/up: pieces end at a group's end, so each estimate block is one group.
  const int64_t align =
      w.down_groups || RoundsRowCoefs(w) ? 32 : w.gate_interleaved || w.up_interleaved ? 16 : 1;
  for (int64_t k = 0; k < pieces; ++k) {
    const int64_t last = qsparse::PieceEnd(k, pieces, w.num_neurons, align);
    cand_ends[k] = std::lower_bound(cands.begin(), cands.end(), last) - cands.begin();
  }
  // Each thread takes a run of consecutive pieces (with about its share of the candidates): its
  // rows are one stream, where pieces handed out one by one made every piece a new stream to
  // ramp up on. Which thread runs a piece changes no bit.
  const int64_t tasks = std::min<int64_t>(pieces, pool.NumThreads());
  qsparse::PieceRuns(cand_ends, tasks, s.piece_runs);
  const int64_t chunk = std::min(num_tokens, kTokenChunk);
  if (static_cast<int64_t>(s.partial_y.size()) < pieces * chunk * dim) {
    s.partial_y.resize(pieces * chunk * dim);
  }
  if (static_cast<int64_t>(s.partial_count.size()) < pieces * chunk) {
    s.partial_count.resize(pieces * chunk);
  }
  if (static_cast<int64_t>(s.pieces.size()) < pieces) s.pieces.resize(pieces);
  const int64_t padded = (kEstimateBlock * chunk + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
  for (int64_t k = 0; k < pieces; ++k) {
    for (std::vector<float>* v : {&s.pieces[k].gate, &s.pieces[k].up, &s.pieces[k].act}) {
      if (static_cast<int64_t>(v->size()) < padded) v->assign(padded, 0.0f);
    }
  }

  for (int64_t t0 = 0; t0 < num_tokens; t0 += chunk) {
    const int64_t ntok = std::min(chunk, num_tokens - t0);
    const int64_t out_size = ntok * dim;
    float* partial = s.partial_y.data();
    int32_t* counts = s.partial_count.data();
    pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
      for (int64_t k = s.piece_runs[task]; k < s.piece_runs[task + 1]; ++k) {
        const int64_t lo = k == 0 ? 0 : cand_ends[k - 1];
        RunPiece(w, score_rows, params, s, cands.subspan(lo, cand_ends[k] - lo), t0, ntok,
                 s.pieces[k], partial + k * out_size, counts + k * ntok);
      }
    });
    // y = ((piece 0 + piece 1) + ...) + b_down, in piece order: deterministic.
    float* yc = y + t0 * dim;
    auto reduce = [&](int64_t lo, int64_t hi) {
      std::copy(partial + lo, partial + hi, yc + lo);
      for (int64_t k = 1; k < pieces; ++k) {
        const float* src = partial + k * out_size;
        for (int64_t j = lo; j < hi; ++j) yc[j] += src[j];
      }
      if (w.b_down != nullptr) {
        for (int64_t j = lo; j < hi; ++j) yc[j] += w.b_down[j % dim];
      }
    };
    if (out_size * pieces < kParallelReduceMin || pool.NumThreads() == 1) {
      reduce(0, out_size);
    } else {
      const int64_t tasks = pool.NumThreads();
      pool.Run(0, tasks, [&](int64_t c, int /*worker*/) {
        reduce(out_size * c / tasks, out_size * (c + 1) / tasks);
      });
    }
    for (int64_t t = 0; t < ntok; ++t) {
      int32_t total = 0;
      for (int64_t k = 0; k < pieces; ++k) total += counts[k * ntok + t];
      n_active[t0 + t] = total;
    }
  }
}

}  // namespace pij
