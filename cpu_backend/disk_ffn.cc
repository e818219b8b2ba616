#include "cpu_backend/disk_ffn.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include "cpu_backend/qsparse_common.h"
#include "cpu_backend/quant_kernels.h"
#include "cpu_backend/simd.h"

namespace pij {
namespace {

using qsparse::kDownGroup;
using qsparse::GateOn;
using qsparse::kGateUpAhead;
using qsparse::PrefetchL2;
using qsparse::ZeroBelowZero;

// Prefill tokens per pass (as qsparse_ffn.cc): the partial outputs are [pieces, chunk, D].
constexpr int64_t kTokenChunk = 32;
// Candidates per activation step (qsparse_ffn.cc's kEstimateBlock).
constexpr int64_t kBlock = 16;

// One call's view of the layer: where each candidate's rows are.
struct LayerRows {
  const BundleLayout& l;
  const NeuronLease& lease;
  const uint8_t* Gate(int32_t c) const { return l.Gate(lease.bundle[c]); }
  const uint8_t* Up(int32_t c) const { return l.Up(lease.bundle[c]); }
  const uint8_t* Down(int32_t c) const { return l.Down(lease.bundle[c]); }
};

// The a_i of the n candidates `cs` for tokens [t0, t0 + ntok) into w.act[j * ntok + t], as
// qsparse_ffn.cc's Activations computes them over rows (`next`: the candidates listed after
// them, whose rows are requested ahead).
void Activations(const LayerRows& r, const float* b_up, const DiskFfnParams& p,
                 const DiskFfnScratch& s, std::span<const int32_t> cs,
                 std::span<const int32_t> next, int64_t t0, int64_t ntok,
                 DiskFfnScratch::Worker& w) {
  const BundleLayout& l = r.l;
  float* gate = w.gate.data();
  float* up = w.up.data();
  const size_t n = cs.size();
  const QActView* gx = s.gate_views.data() + t0;
  const QActView* ux = s.up_views.data() + t0;
  const auto cand = [&](size_t j) { return j < n ? cs[j] : next[j - n]; };
  const auto gate_row = [&](int, size_t j) { return r.Gate(cand(j)); };
  const auto up_row = [&](int, size_t j) { return r.Up(cand(j)); };
  const auto both_rows = [&](int m, size_t j) { return m == 0 ? r.Gate(cand(j)) : r.Up(cand(j)); };
  if (l.gated && ZeroBelowZero(p.activation) && p.criterion == Criterion::kScores &&
      l.gate_type == l.up_type) {
    // predicted neurons mostly fire: gate and up rows in one tile (qsparse_ffn.cc), the up value
    // of a neuron whose gate no token turns on zeroed. Here (a bundle's gate and up rows are
    // adjacent) it measured as the gate-first pass below: one SYNTHETIC 7B layer, 10% selected
    // of which 90% fire, every neuron in memory, 2 threads, 16 layers per program, 3 interleaved
    // processes: median 0.641 ms one tile, 0.638 gate first (benchmarks/offload_kernel.py);
    // kept as qsparse_ffn.cc's, one arithmetic to reason about
    VisitQType(l.up_type, [&]<class F>(F) {
      float* outs[2] = {gate, up};
      qsparse::NeuronDots<F, 2>(both_rows, n, next.size(), false, ux, ntok, l.dim, outs);
    });
    for (size_t j = 0; j < n; ++j) {
      if (!GateOn(gate + j * ntok, ntok, p.gate_floor)) std::fill_n(up + j * ntok, ntok, 0.0f);
    }
  } else if (l.gated && ZeroBelowZero(p.activation)) {
    // a_i is exactly 0 wherever relu(gate) is: up rows only of neurons some token turns on
    VisitQType(l.gate_type, [&]<class F>(F) {
      qsparse::NeuronDots<F, 1>(gate_row, n, next.size(), false, gx, ntok, l.dim, &gate);
    });
    int32_t on_cs[kBlock];
    int64_t on_pos[kBlock];
    int64_t n_on = 0;
    for (size_t j = 0; j < n; ++j) {
      if (GateOn(gate + j * ntok, ntok, p.gate_floor)) {
        on_pos[n_on] = static_cast<int64_t>(j);
        on_cs[n_on++] = cs[j];
      }
    }
    float* on_up = w.act.data();  // scratch of the same size, written again below
    VisitQType(l.up_type, [&]<class F>(F) {
      qsparse::NeuronDots<F, 1>([&](int, size_t j) { return r.Up(on_cs[j]); },
                                static_cast<size_t>(n_on), 0, false, ux, ntok, l.dim, &on_up);
    });
    std::fill_n(up, n * ntok, 0.0f);
    for (int64_t k = 0; k < n_on; ++k) std::copy_n(on_up + k * ntok, ntok, up + on_pos[k] * ntok);
  } else if (l.gated && l.gate_type == l.up_type) {
    VisitQType(l.up_type, [&]<class F>(F) {
      float* outs[2] = {gate, up};
      qsparse::NeuronDots<F, 2>(both_rows, n, next.size(), false, ux, ntok, l.dim, outs);
    });
  } else {
    if (l.gated) {
      VisitQType(l.gate_type, [&]<class F>(F) {
        qsparse::NeuronDots<F, 1>(gate_row, n, next.size(), false, gx, ntok, l.dim, &gate);
      });
    }
    VisitQType(l.up_type, [&]<class F>(F) {
      qsparse::NeuronDots<F, 1>(up_row, n, next.size(), false, ux, ntok, l.dim, &up);
    });
  }
  if (b_up != nullptr) {
    for (size_t j = 0; j < n; ++j) {
      for (int64_t t = 0; t < ntok; ++t) up[j * ntok + t] += b_up[cs[j]];
    }
  }
  if (l.gated && p.gate_floor > 0.0f) {  // FATReLU, as qsparse_ffn.cc
    for (size_t k = 0; k < n * ntok; ++k) gate[k] = FloorGate(gate[k], p.gate_floor);
  }
  // whole vectors over the padded arrays, as qsparse_ffn.cc: every value through the same code
  float* a = w.act.data();
  for (int64_t k = 0; k < static_cast<int64_t>(n) * ntok; k += simd::kLanes) {
    const simd::Vec u = simd::Load(up + k);
    const simd::Vec v = l.gated ? simd::GatedActivate(p.activation, simd::Load(gate + k), u)
                                : simd::Activate(p.activation, u);
    simd::Store(a + k, v);
  }
}

// y += sum_k coef[k] * down row of candidate cs[k] (in neuron id order), as qsparse_ffn.cc's
// AccumulateDown sums neuron rows, or down groups (the layer's scale planes and the candidates'
// code rows: the groups' arithmetic).
void AccumulateDown(const LayerRows& r, const uint8_t* planes, std::span<const int32_t> ids,
                    std::span<const int32_t> cs, std::span<const float> coef, float* y) {
  const BundleLayout& l = r.l;
  if (!l.down_groups) {
    VisitQType(l.down_type, [&]<class F>(F) {
      qsparse::AxpyDownRows<F>([&](size_t k) { return r.Down(cs[k]); }, coef.data(), cs.size(),
                               l.dim, y);
    });
    return;
  }
  VisitQType(l.down_type, [&]<class F>(F) {
    if constexpr (F::kBlock == 32 && DownGroupScaleBytes(F::kType) > 0) {
      const int64_t plane_bytes = DownGroupScaleBytes(F::kType) * l.dim;
      int32_t lanes[32];
      const uint8_t* rows[32];
      for (size_t i = 0, j; i < ids.size(); i = j) {
        const int32_t g = ids[i] / 32;
        for (j = i; j < ids.size() && ids[j] / 32 == g; ++j) {
          lanes[j - i] = ids[j] % 32;
          rows[j - i] = r.Down(cs[j]);
        }
        const int n = static_cast<int>(j - i);
        const uint8_t* group_planes = planes + g * plane_bytes;
        if constexpr (DownGroupPairs(F::kType)) {
          const uint8_t* by_lane[32] = {};
          for (int k = 0; k < n; ++k) by_lane[lanes[k]] = rows[k];
          qkern::AxpyPairs<F>(group_planes, qkern::CodePairRows{by_lane}, l.dim / 32, lanes,
                              coef.data() + i, n, y);
        } else {
          qkern::AxpyGroup<F>(group_planes, rows, l.dim / 32, coef.data() + i, n, y);
        }
      }
    }
  });
}

}  // namespace

std::string DiskSparseFfn(NeuronStore& store, int64_t layer, std::span<const float* const> x_rows,
                          std::span<const float* const> score_rows,
                          std::span<const float* const> next_rows, const DiskFfnParams& p,
                          float* y, int32_t* n_active, DiskFfnScratch& s, ThreadPool& pool) {
  const BundleLayout& l = store.layout();
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  const int64_t dim = l.dim, f = l.num_neurons;
  if (num_tokens == 0) return "";
  const int64_t up_block = GetQTypeInfo(l.up_type).block;
  const int64_t gate_block = l.gated ? GetQTypeInfo(l.gate_type).block : up_block;
  qsparse::QuantizeTokens(x_rows, dim, up_block, gate_block, s, pool);
  // candidates: every neuron (oracle), or those some token's score selects
  std::vector<int32_t>& cands = s.candidates;
  cands.clear();
  if (p.criterion == Criterion::kOracle) {
    for (int64_t i = 0; i < f; ++i) cands.push_back(static_cast<int32_t>(i));
  } else {
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
  std::string error;
  if (!store.Acquire(layer, cands, num_tokens, s.lease, &error)) return error;
  if (!next_rows.empty() && layer + 1 < l.num_layers) {
    s.ahead.clear();
    for (int64_t i = 0; i < f; ++i) {
      bool on = false;
      for (const float* row : next_rows) on |= SelectedByScore(row[i], p.threshold);
      if (on) s.ahead.push_back(static_cast<int32_t>(i));
    }
    store.Prefetch(layer + 1, s.ahead, num_tokens);
  }
  const int64_t nc = static_cast<int64_t>(cands.size());
  const LayerRows rows{l, s.lease};
  const uint8_t* planes = l.down_groups ? store.Planes(layer) : nullptr;

  // pieces: qsparse_ffn.cc's fixed id ranges (ending at multiples of 32 where coefs are rounded
  // per 32 ids or summed in down groups), a run of consecutive pieces per thread
  const bool round_coefs = !l.down_groups && DownGroupPairs(l.down_type) && f % 32 == 0;
  const int64_t pieces = qsparse::NumPieces(f);
  const int64_t align = round_coefs || l.down_groups ? 32 : 1;
  s.cand_ends.resize(pieces);
  for (int64_t k = 0; k < pieces; ++k) {
    s.cand_ends[k] = std::lower_bound(cands.begin(), cands.end(),
                                      qsparse::PieceEnd(k, pieces, f, align)) - cands.begin();
  }
  const int64_t tasks = std::min<int64_t>(pieces, pool.NumThreads());
  qsparse::PieceRuns(s.cand_ends, tasks, s.piece_runs);
  const int64_t chunk = std::min(num_tokens, kTokenChunk);
  const int64_t padded = (kBlock * chunk + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
  s.workers.resize(pool.NumThreads());
  for (DiskFfnScratch::Worker& w : s.workers) {
    for (std::vector<float>* v : {&w.gate, &w.up, &w.act}) {
      if (static_cast<int64_t>(v->size()) < padded) v->assign(padded, 0.0f);
    }
  }
  if (static_cast<int64_t>(s.acts.size()) < nc * chunk) s.acts.resize(nc * chunk);
  if (static_cast<int64_t>(s.partial_y.size()) < pieces * chunk * dim) {
    s.partial_y.resize(pieces * chunk * dim);
  }
  if (static_cast<int64_t>(s.partial_count.size()) < pieces * chunk) {
    s.partial_count.resize(pieces * chunk);
  }
  const float* b_up = store.BUp(layer);
  const bool oracle = p.criterion == Criterion::kOracle;
  std::atomic<bool> failed{false};
  const int64_t down_bytes = l.DownBytes();

  // The a_i of candidates [lo, hi) (16 at a time) that are in memory; wait: also those whose
  // reads are running (waiting for each), else they are left !done. Returns whether all are done.
  auto activate = [&](int64_t lo, int64_t hi, int64_t t0, int64_t ntok, bool wait,
                      DiskFfnScratch::Worker& w) {
    int32_t block[kBlock];
    int64_t waited_ns = 0;
    bool all = true;
    for (int64_t c = lo; c < hi;) {
      int64_t nb = 0;
      for (; c < hi && nb < kBlock; ++c) {
        if (s.done[c]) continue;
        if (!oracle && num_tokens > 1) {  // none of this chunk's tokens wants it: never summed
          bool wanted = false;
          for (int64_t t = t0; t < t0 + ntok && !wanted; ++t) {
            wanted = SelectedByScore(score_rows[t][cands[c]], p.threshold);
          }
          if (!wanted) {
            s.done[c] = 1;
            continue;
          }
        }
        if (const std::atomic<uint32_t>* pending = s.lease.pending[c]; pending != nullptr) {
          uint32_t state = pending->load(std::memory_order_acquire);
          if (state == kSlotLoading && !wait) {
            all = false;
            continue;
          }
          if (state == kSlotLoading) {
            const auto w0 = std::chrono::steady_clock::now();
            NeuronStore::Wait(pending);
            waited_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - w0).count();
            state = pending->load(std::memory_order_acquire);
          }
          if (state != kSlotReady) {
            failed.store(true);
            continue;
          }
        }
        block[nb++] = static_cast<int32_t>(c);
      }
      if (nb == 0) continue;
      // the candidates after this block, whose rows are requested ahead (some may be pending:
      // a request for a slot being read only costs the request)
      int32_t next[kGateUpAhead];
      int64_t nn = 0;
      for (int64_t k = c; k < hi && nn < static_cast<int64_t>(kGateUpAhead); ++k) {
        next[nn++] = static_cast<int32_t>(k);
      }
      Activations(rows, b_up, p, s, std::span<const int32_t>(block, nb),
                  std::span<const int32_t>(next, nn), t0, ntok, w);
      for (int64_t j = 0; j < nb; ++j) {
        std::copy_n(w.act.data() + j * ntok, ntok, s.acts.data() + block[j] * ntok);
        s.done[block[j]] = 1;
      }
    }
    if (waited_ns > 0) store.AddWaitNs(waited_ns);
    return all;
  };

  // Piece k's down sums into its partial output, its counts: per token its active neurons in id
  // order (every candidate's a_i known).
  auto sum_piece = [&](int64_t k, int64_t t0, int64_t ntok, DiskFfnScratch::Worker& w) {
    const int64_t lo = k == 0 ? 0 : s.cand_ends[k - 1], hi = s.cand_ends[k];
    float* out = s.partial_y.data() + k * ntok * dim;
    int32_t* cnt = s.partial_count.data() + k * ntok;
    std::fill_n(out, ntok * dim, 0.0f);
    std::fill_n(cnt, ntok, 0);
    std::vector<int32_t>& active = w.active;
    std::vector<int32_t>& ids = w.ids;
    std::vector<float>& coef = w.coef;
    for (int64_t t = 0; t < ntok; ++t) {
      active.clear();
      ids.clear();
      coef.clear();
      for (int64_t c = lo; c < hi; ++c) {
        const bool on = oracle ? ActiveByMagnitude(s.acts[c * ntok + t], p.threshold)
                               : SelectedByScore(score_rows[t0 + t][cands[c]], p.threshold);
        if (!on) continue;
        ++cnt[t];
        const float a = s.acts[c * ntok + t];
        if (a == 0.0f) continue;  // selected, but its row would add exact zeros: not read
        if (active.size() < static_cast<size_t>(kDownGroup)) {  // the first pass's rows
          PrefetchL2(rows.Down(static_cast<int32_t>(c)), down_bytes);
        }
        active.push_back(static_cast<int32_t>(c));
        ids.push_back(cands[c]);
        coef.push_back(a);
      }
      if (round_coefs) qsparse::RoundCoefsPer32(ids, coef);
      AccumulateDown(rows, planes, ids, active, coef, out + t * dim);
    }
  };

  for (int64_t t0 = 0; t0 < num_tokens && !failed.load(); t0 += chunk) {
    const int64_t ntok = std::min(chunk, num_tokens - t0);
    s.done.assign(nc, 0);
    // Per thread a run of pieces: each piece's candidates in memory, then its down sums; a
    // piece with reads still running is finished after the run's others (waiting for them).
    pool.Run(0, tasks, [&](int64_t task, int worker) {
      DiskFfnScratch::Worker& w = s.workers[worker];
      w.late.clear();
      for (int64_t k = s.piece_runs[task]; k < s.piece_runs[task + 1]; ++k) {
        const int64_t lo = k == 0 ? 0 : s.cand_ends[k - 1];
        if (activate(lo, s.cand_ends[k], t0, ntok, /*wait=*/false, w)) {
          if (failed.load()) return;
          sum_piece(k, t0, ntok, w);
        } else {
          w.late.push_back(k);
        }
      }
      for (const int64_t k : w.late) {
        const int64_t lo = k == 0 ? 0 : s.cand_ends[k - 1];
        activate(lo, s.cand_ends[k], t0, ntok, /*wait=*/true, w);
        if (failed.load()) return;
        sum_piece(k, t0, ntok, w);
      }
    });
    if (failed.load()) break;
    // y = (piece 0 + piece 1) + ..., in piece order: deterministic
    const int64_t out_size = ntok * dim;
    const float* partial = s.partial_y.data();
    const int32_t* counts = s.partial_count.data();
    float* yc = y + t0 * dim;
    std::copy(partial, partial + out_size, yc);
    for (int64_t k = 1; k < pieces; ++k) {
      const float* src = partial + k * out_size;
      for (int64_t j = 0; j < out_size; ++j) yc[j] += src[j];
    }
    for (int64_t t = 0; t < ntok; ++t) {
      int32_t total = 0;
      for (int64_t k = 0; k < pieces; ++k) total += counts[k * ntok + t];
      n_active[t0 + t] = total;
    }
  }
  // every read of this call has ended before its slots go back (a failed call too)
  for (int64_t c = 0; c < nc; ++c) {
    if (s.lease.pending[c] != nullptr) NeuronStore::Wait(s.lease.pending[c]);
  }
  store.Release(s.lease);
  if (failed.load()) return "reading neuron bundles: " + store.ReadError();
  return "";
}

}  // namespace pij
