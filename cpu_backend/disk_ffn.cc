#include "cpu_backend/disk_ffn.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include "cpu_backend/qsparse_common.h"
#include "cpu_backend/quant_kernels.h"
#include "cpu_backend/simd.h"

namespace pij {
namespace {

// Prefill tokens per pass (as qsparse_ffn.cc): the partial outputs are [pieces, chunk, D].
constexpr int64_t kTokenChunk = 32;
// Candidates per task of the activation pass: small, so a task rarely waits for many reads.
constexpr int64_t kUnit = 16;
// Candidates ahead whose gate and up rows are requested while one is computed (bundles are
// scattered: the hardware prefetcher does not follow them), as qsparse_ffn.cc's kGateUpAhead.
constexpr int64_t kAhead = 4;
constexpr int64_t kCacheLine = 64;

inline void PrefetchL2(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += kCacheLine) __builtin_prefetch(p + off, 0, 2);
}

// out[j * ntok + t] = rows[j] . x_t for n rows of format F (two rows per tile at decode: the
// same bits per (row, token) as any other tile, quant_kernels.h).
template <class F>
void RowDots(const uint8_t* const* rows, int64_t n, const QActView* xs, int64_t ntok,
             int64_t dim, float* out) {
  const int64_t nblocks = dim / F::kBlock;
  if (ntok == 1) {
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) qkern::DotTile<F, 2, 1>(rows + j, xs, nblocks, out + j);
    if (j < n) qkern::DotTile<F, 1, 1>(rows + j, xs, nblocks, out + j);
    return;
  }
  float dots[qkern::kMaxTokens];
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t t = 0; t < ntok;) {
      const int64_t c = qkern::TokenTile<F, 1>(rows + j, xs, t, ntok, nblocks, dots);
      for (int64_t k = 0; k < c; ++k) out[j * ntok + t + k] = dots[k];
      t += c;
    }
  }
}

void Dots(QType type, const uint8_t* const* rows, int64_t n, const QActView* xs, int64_t ntok,
          int64_t dim, float* out) {
  VisitQType(type, [&]<class F>(F) { RowDots<F>(rows, n, xs, ntok, dim, out); });
}

// a_i of `n` candidates (bundles b[0, n), ids) for tokens [t0, t0 + ntok) into
// w.act[j * ntok + t], as qsparse_ffn.cc's Activations computes them.
void Activations(const BundleLayout& l, const float* b_up, const DiskFfnParams& p,
                 const DiskFfnScratch& s, const uint8_t* const* b, const int32_t* ids, int64_t n,
                 int64_t t0, int64_t ntok, DiskFfnScratch::Worker& w) {
  const uint8_t* rows[kUnit];
  float* gate = w.gate.data();
  float* up = w.up.data();
  const QActView* gx = s.gate_views.data() + t0;
  const QActView* ux = s.up_views.data() + t0;
  if (l.gated) {
    for (int64_t j = 0; j < n; ++j) rows[j] = l.Gate(b[j]);
    Dots(l.gate_type, rows, n, gx, ntok, l.dim, gate);
  }
  if (l.gated && qsparse::ZeroBelowZero(p.activation)) {
    // a_i is exactly 0 wherever relu(gate) is: up rows only of neurons some token turns on
    int64_t n_on = 0;
    int32_t pos[kUnit];
    for (int64_t j = 0; j < n; ++j) {
      bool on = false;
      for (int64_t t = 0; t < ntok; ++t) on |= !(gate[j * ntok + t] <= 0.0f);  // NaN: on
      if (on) {
        pos[n_on] = static_cast<int32_t>(j);
        rows[n_on++] = l.Up(b[j]);
      }
    }
    float* on_up = w.act.data();  // scratch, written again below
    Dots(l.up_type, rows, n_on, ux, ntok, l.dim, on_up);
    std::fill_n(up, n * ntok, 0.0f);
    for (int64_t k = 0; k < n_on; ++k) std::copy_n(on_up + k * ntok, ntok, up + pos[k] * ntok);
  } else {
    for (int64_t j = 0; j < n; ++j) rows[j] = l.Up(b[j]);
    Dots(l.up_type, rows, n, ux, ntok, l.dim, up);
  }
  if (b_up != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t t = 0; t < ntok; ++t) up[j * ntok + t] += b_up[ids[j]];
    }
  }
  // whole vectors over the padded arrays, as qsparse_ffn.cc: every value through the same code
  float* a = w.act.data();
  for (int64_t k = 0; k < n * ntok; k += simd::kLanes) {
    const simd::Vec u = simd::Load(up + k);
    const simd::Vec v = l.gated ? simd::GatedActivate(p.activation, simd::Load(gate + k), u)
                                : simd::Activate(p.activation, u);
    simd::Store(a + k, v);
  }
}

// y += sum_k coef[k] * down row of bundle rows[k], kDownGroup rows per pass (qsparse_ffn.cc's
// AccumulateDown on neuron rows).
void AccumulateDown(const BundleLayout& l, std::span<const uint8_t* const> bundles,
                    std::span<const float> coef, float* y) {
  VisitQType(l.down_type, [&]<class F>(F) {
    const int64_t nblocks = l.dim / F::kBlock;
    const size_t n = bundles.size();
    const uint8_t* rows[qsparse::kDownGroup];
    size_t k = 0;
    const int64_t down_bytes = l.DownBytes();
    for (size_t j = 0; j < std::min<size_t>(n, qsparse::kDownGroup); ++j) {
      PrefetchL2(l.Down(bundles[j]), down_bytes);
    }
    for (; k + qsparse::kDownGroup <= n; k += qsparse::kDownGroup) {
      // the next group's rows are requested while this one is summed (scattered rows: the
      // hardware prefetcher does not follow them)
      for (size_t j = k + qsparse::kDownGroup; j < std::min(n, k + 2 * qsparse::kDownGroup); ++j) {
        PrefetchL2(l.Down(bundles[j]), down_bytes);
      }
      for (int j = 0; j < qsparse::kDownGroup; ++j) rows[j] = l.Down(bundles[k + j]);
      qkern::AxpyRows<F, qsparse::kDownGroup>(rows, coef.data() + k, nblocks, y);
    }
    for (; k < n; ++k) {
      rows[0] = l.Down(bundles[k]);
      qkern::AxpyRows<F, 1>(rows, coef.data() + k, nblocks, y);
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
      for (int64_t i = 0; i < f; ++i) s.marks[i] |= static_cast<uint8_t>(SelectedByScore(row[i], p.threshold));
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
    store.Prefetch(layer + 1, s.ahead);
  }
  const int64_t nc = static_cast<int64_t>(cands.size());
  // the compute order: resident bundles first, then the others as their reads complete
  s.order.clear();
  for (int64_t c = 0; c < nc; ++c) {
    if (s.lease.pending[c] == nullptr) s.order.push_back(static_cast<int32_t>(c));
  }
  const size_t resident = s.order.size();
  for (int64_t c = 0; c < nc; ++c) {
    if (s.lease.pending[c] != nullptr) s.order.push_back(static_cast<int32_t>(c));
  }
  std::sort(s.order.begin() + resident, s.order.end(), [&](int32_t a, int32_t b) {
    return s.lease.position[a] < s.lease.position[b];
  });

  // pieces: qsparse_ffn.cc's fixed id ranges (aligned to 32 where 4-bit rows' coefs are rounded)
  const bool round_coefs = DownGroupPairs(l.down_type) && f % 32 == 0;
  const int64_t pieces = qsparse::NumPieces(f);
  const int64_t align = round_coefs ? 32 : 1;
  s.cand_ends.resize(pieces);
  for (int64_t k = 0; k < pieces; ++k) {
    s.cand_ends[k] = std::lower_bound(cands.begin(), cands.end(),
                                      qsparse::PieceEnd(k, pieces, f, align)) - cands.begin();
  }
  const int64_t chunk = std::min(num_tokens, kTokenChunk);
  const int64_t padded = (kUnit * chunk + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
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
  if (static_cast<int64_t>(s.pieces.size()) < pieces) s.pieces.resize(pieces);
  const float* b_up = store.BUp(layer);
  const bool oracle = p.criterion == Criterion::kOracle;
  const int64_t units = (nc + kUnit - 1) / kUnit;
  std::atomic<bool> failed{false};
  s.done.assign(nc, 0);

  // a_i of the candidates at order[lo, hi) that are in memory (wait: block for the others;
  // else skip them, they stay !done for the pieces' pass), gate/up rows requested kAhead ahead
  auto activate = [&](const int32_t* order, int64_t n, int64_t t0, int64_t ntok, bool wait,
                      DiskFfnScratch::Worker& w) {
    const uint8_t* bundles[kUnit];
    int32_t ids[kUnit], which[kUnit];
    int64_t m = 0, waited = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int32_t c = order[k];
      if (s.done[c]) continue;
      if (k + kAhead < n) PrefetchL2(s.lease.bundle[order[k + kAhead]], l.GateBytes() + l.UpBytes());
      if (const std::atomic<uint32_t>* pending = s.lease.pending[c]; pending != nullptr) {
        const uint32_t state = pending->load(std::memory_order_acquire);
        if (state == kSlotLoading && !wait) continue;
        if (state == kSlotLoading) {
          const auto w0 = std::chrono::steady_clock::now();
          NeuronStore::Wait(pending);
          waited += std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - w0).count();
        }
        if (pending->load(std::memory_order_acquire) != kSlotReady) {
          failed.store(true);
          continue;
        }
      }
      bundles[m] = s.lease.bundle[c];
      ids[m] = cands[c];
      which[m++] = c;
      if (m == kUnit || k + 1 == n) {
        Activations(l, b_up, p, s, bundles, ids, m, t0, ntok, w);
        for (int64_t j = 0; j < m; ++j) {
          std::copy_n(w.act.data() + j * ntok, ntok, s.acts.data() + which[j] * ntok);
          s.done[which[j]] = 1;
        }
        m = 0;
      }
    }
    if (m > 0) {
      Activations(l, b_up, p, s, bundles, ids, m, t0, ntok, w);
      for (int64_t j = 0; j < m; ++j) {
        std::copy_n(w.act.data() + j * ntok, ntok, s.acts.data() + which[j] * ntok);
        s.done[which[j]] = 1;
      }
    }
    if (waited > 0) store.AddWaitNs(waited);
  };

  for (int64_t t0 = 0; t0 < num_tokens && !failed.load(); t0 += chunk) {
    const int64_t ntok = std::min(chunk, num_tokens - t0);
    if (t0 > 0) std::fill(s.done.begin(), s.done.end(), 0);
    // 1. while the reads run: every candidate already in memory (resident first, then the
    //    pending ones whose reads have completed, in file order), in units over the pool
    pool.Run(0, units, [&](int64_t unit, int worker) {
      const int64_t lo = unit * kUnit, hi = std::min(nc, lo + kUnit);
      activate(s.order.data() + lo, hi - lo, t0, ntok, /*wait=*/false, s.workers[worker]);
    });
    // 2. per piece: the rest of its candidates (waiting for their reads), then per token its
    //    active neurons in id order, their down rows summed
    const int64_t out_size = ntok * dim;
    float* partial = s.partial_y.data();
    int32_t* counts = s.partial_count.data();
    pool.Run(0, pieces, [&](int64_t k, int worker) {
      const int64_t lo = k == 0 ? 0 : s.cand_ends[k - 1], hi = s.cand_ends[k];
      DiskFfnScratch::Worker& w = s.workers[worker];
      w.todo.clear();
      for (int64_t c = lo; c < hi; ++c) {
        if (!s.done[c]) w.todo.push_back(static_cast<int32_t>(c));
      }
      activate(w.todo.data(), static_cast<int64_t>(w.todo.size()), t0, ntok, /*wait=*/true, w);
      if (failed.load()) return;
      DiskFfnScratch::Piece& piece = s.pieces[k];
      if (static_cast<int64_t>(piece.active.size()) < ntok) {
        piece.active.resize(ntok);
        piece.coef.resize(ntok);
        piece.rows.resize(ntok);
      }
      float* out = partial + k * out_size;
      int32_t* cnt = counts + k * ntok;
      std::fill_n(out, out_size, 0.0f);
      std::fill_n(cnt, ntok, 0);
      for (int64_t t = 0; t < ntok; ++t) {
        std::vector<int32_t>& active = piece.active[t];
        std::vector<float>& coef = piece.coef[t];
        std::vector<const uint8_t*>& rows = piece.rows[t];
        active.clear();
        coef.clear();
        rows.clear();
        for (int64_t c = lo; c < hi; ++c) {
          const float a = s.acts[c * ntok + t];
          const bool on = oracle ? ActiveByMagnitude(a, p.threshold)
                                 : SelectedByScore(score_rows[t0 + t][cands[c]], p.threshold);
          if (!on) continue;
          ++cnt[t];
          if (a == 0.0f) continue;  // selected, but its row would add exact zeros: not read
          active.push_back(cands[c]);
          coef.push_back(a);
          rows.push_back(s.lease.bundle[c]);
        }
        if (round_coefs) qsparse::RoundCoefsPer32(active, coef);
        AccumulateDown(l, rows, coef, out + t * dim);
      }
    });
    if (failed.load()) break;
    // y = (piece 0 + piece 1) + ..., in piece order: deterministic
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
