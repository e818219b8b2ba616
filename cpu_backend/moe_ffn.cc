#include "cpu_backend/moe_ffn.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>

#include "cpu_backend/bundle_reader.h"
#include "cpu_backend/pij_math.h"
#include "cpu_backend/qcolumns.h"
#include "cpu_backend/qlinear.h"

namespace pij {
namespace {

// Rows per task at least: smaller ranges cost more in wake-ups than they save (qlinear.cc's
// kParallelMinWeights is 32K weights: 16 rows of a 2048-wide expert).
constexpr int64_t kMinTaskRows = 16;
// Tasks per thread: several even out experts with unequal token counts.
constexpr int64_t kTasksPerThread = 4;

struct Task {
  int32_t expert, which;  // which: 0 gate, 1 up (first pass) or 0 down (second pass)
  int64_t lo, hi;
};

int64_t MinGroup(QType t) { return GetQTypeInfo(t).block == 256 ? 16 : 32; }

// Expert e's matrices: stacked, or where its source says.
const uint8_t* GateOf(const MoeExperts& w, int64_t e, int64_t bytes) {
  return w.sources != nullptr ? w.sources[e].gate : w.gate + e * bytes;
}
const uint8_t* UpOf(const MoeExperts& w, int64_t e, int64_t bytes) {
  return w.sources != nullptr ? w.sources[e].up : w.up + e * bytes;
}
const uint8_t* DownOf(const MoeExperts& w, int64_t e, int64_t bytes) {
  return w.sources != nullptr ? w.sources[e].down : w.down + e * bytes;
}

bool Pending(const MoeExperts& w, int64_t e) {
  if (w.sources == nullptr) return false;
  for (const std::atomic<uint32_t>* f : w.sources[e].pending) {
    if (f->load(std::memory_order_acquire) != kSlotReady) return true;
  }
  return false;
}

// Waits for expert e's reads (if any); false (and s.failed) when one failed.
bool Ready(const MoeExperts& w, int64_t e, MoeScratch& s) {
  if (w.sources == nullptr) return true;
  bool ok = true;
  const auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  for (const std::atomic<uint32_t>* f : w.sources[e].pending) {
    uint32_t v = f->load(std::memory_order_acquire);
    while (v == kSlotLoading) {
      waited = true;
      f->wait(kSlotLoading, std::memory_order_acquire);
      v = f->load(std::memory_order_acquire);
    }
    ok &= v == kSlotReady;
  }
  if (waited) {
    s.wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0).count(),
                        std::memory_order_relaxed);
  }
  if (!ok) s.failed.store(true, std::memory_order_relaxed);
  return ok;
}

// (expert, row range) tasks over s.experts (the experts that have tokens, in the order they
// are computed), `passes` matrices each of `rows` rows, about kTasksPerThread per thread.
// grain: the rows a task's range is a multiple of (16: interleaved groups; 64: columns tiles).
void MakeTasks(const MoeScratch& s, int64_t rows, int passes, int threads, int64_t grain,
               std::vector<Task>& tasks) {
  tasks.clear();
  const int64_t active = static_cast<int64_t>(s.experts.size());
  if (active == 0) return;
  const int64_t want = std::max<int64_t>(1, threads * kTasksPerThread);
  // a multiple of the grain: an interleaved (columns) matrix's tasks start and end on its
  // groups (tiles)
  const int64_t per =
      (std::max(kMinTaskRows, rows * active * passes / want) + grain - 1) / grain * grain;
  for (const int32_t e : s.experts) {
    for (int which = 0; which < passes; ++which) {
      for (int64_t lo = 0; lo < rows; lo += per) {
        tasks.push_back({static_cast<int32_t>(e), which, lo, std::min(rows, lo + per)});
      }
    }
  }
}

void Quantize(std::span<const float* const> rows, int64_t dim, QType t, QActs& acts,
              std::vector<QActView>& views, ThreadPool& pool) {
  QuantizeActs(rows, dim, GetQTypeInfo(t).block, acts, pool);
  views.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) views[i] = acts.View(i, MinGroup(t));
}

// Pairs (token, j) grouped by expert, in token order within a group (a counting sort), and
// each grouped pair's token row; pairs whose id is -1 (an expert of another shard) are left
// out (slot -1). Returns the number of grouped pairs.
int64_t GroupPairs(int64_t e_n, std::span<const float* const> x_rows, const int32_t* ids,
                   int64_t k, MoeScratch& s) {
  const int64_t pairs = static_cast<int64_t>(x_rows.size()) * k;
  s.start.assign(e_n + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (ids[p] >= 0) ++s.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < e_n; ++e) s.start[e + 1] += s.start[e];
  const int64_t grouped = s.start[e_n];
  s.fill.assign(s.start.begin(), s.start.end() - 1);
  s.order.resize(grouped);
  s.slot.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    if (ids[p] < 0) {
      s.slot[p] = -1;
      continue;
    }
    const int32_t i = s.fill[ids[p]]++;
    s.order[i] = static_cast<int32_t>(p);
    s.slot[p] = i;
  }
  s.rows.resize(grouped);
  for (int64_t i = 0; i < grouped; ++i) s.rows[i] = x_rows[s.order[i] / k];
  return grouped;
}

// Each token's experts' outputs (s.y, by grouped pair) summed in routing order, weighted.
void SumExperts(int64_t n, int64_t k, int64_t d, const float* weights, const MoeScratch& s,
                float* y) {
  for (int64_t t = 0; t < n; ++t) {
    float* out = y + t * d;
    std::fill(out, out + d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (s.slot[t * k + j] < 0) continue;  // an expert of another shard
      const float wt = weights[t * k + j];
      const float* part = s.y.data() + static_cast<int64_t>(s.slot[t * k + j]) * d;
      for (int64_t c = 0; c < d; ++c) out[c] += wt * part[c];
    }
  }
}

// Every routed expert's neurons: gate and up rows for its group, then down rows.
void DenseExperts(const MoeExperts& w, std::span<const float* const> x_rows, int64_t k,
                  int64_t pairs, MoeScratch& s, ThreadPool& pool) {
  const int64_t f = w.d_ff, d = w.dim;
  // Each token quantized once for all its pairs (decode: one row, not k copies of it), and
  // once for gate and up when their formats' blocks agree: the same rows give the same bits.
  const int64_t gate_block = GetQTypeInfo(w.gate_t).block;
  const bool up_shares = GetQTypeInfo(w.up_t).block == gate_block;
  QuantizeActs(x_rows, d, gate_block, s.x_gate, pool);
  if (!up_shares) QuantizeActs(x_rows, d, GetQTypeInfo(w.up_t).block, s.x_up, pool);
  const QActs& x_up = up_shares ? s.x_gate : s.x_up;
  // ids: a token's views name its values for this call, so the columns kernels derive what
  // they need from them once per thread, not once per routed expert and matrix
  static std::atomic<uint64_t> next_id{1};
  const int64_t n = static_cast<int64_t>(x_rows.size());
  const uint64_t id0 = next_id.fetch_add(2 * n, std::memory_order_relaxed);
  s.v_gate.resize(pairs);
  s.v_up.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t token = s.order[i] / k;
    s.v_gate[i] = s.x_gate.View(token, MinGroup(w.gate_t));
    s.v_gate[i].id = id0 + token;
    s.v_up[i] = x_up.View(token, MinGroup(w.up_t));
    s.v_up[i].id = up_shares ? id0 + token : id0 + n + token;
  }
  s.g.resize(pairs * f);
  s.u.resize(pairs * f);
  const int64_t rb_d_gate = w.gate_col ? ColumnsRowBytes(w.gate_t, f, d) : QRowBytes(w.gate_t, d);
  const int64_t rb_d_up = w.up_col ? ColumnsRowBytes(w.up_t, f, d) : QRowBytes(w.up_t, d);
  const int64_t rb_f = w.down_col ? ColumnsRowBytes(w.down_t, d, f) : QRowBytes(w.down_t, f);
  std::vector<Task> tasks;
  MakeTasks(s, f, 2, pool.NumThreads(), w.gate_col || w.up_col ? kColTile : 16, tasks);
  pool.Run(0, static_cast<int64_t>(tasks.size()), [&](int64_t ti, int /*worker*/) {
    const Task& t = tasks[ti];
    if (!Ready(w, t.expert, s)) return;
    const int64_t a = s.start[t.expert], count = s.start[t.expert + 1] - a;
    const bool gate = t.which == 0;
    QLinearOut out{gate ? GateOf(w, t.expert, f * rb_d_gate) : UpOf(w, t.expert, f * rb_d_up),
                   gate ? w.gate_t : w.up_t, nullptr, f, (gate ? s.g : s.u).data() + a * f,
                   gate ? w.gate_il : w.up_il, gate ? w.gate_col : w.up_col};
    const auto& views = gate ? s.v_gate : s.v_up;
    QLinearRows(out, d, std::span<const QActView>(views.data() + a, count), t.lo, t.hi);
  });
  if (s.failed.load(std::memory_order_relaxed)) return;
  // h = act(g) * u (zeroed below its expert's thresholds), quantized for down's blocks.
  for (int64_t i = 0; i < pairs * f; ++i) s.g[i] = GatedActivate(w.activation, s.g[i], s.u[i]);
  s.n_active.resize(pairs);
  for (const int32_t e : s.experts) {
    const float* thr = w.mid_thresholds != nullptr ? w.mid_thresholds + int64_t{e} * f : nullptr;
    for (int64_t i = s.start[e]; i < s.start[e + 1]; ++i) {
      float* h = s.g.data() + i * f;
      int32_t nonzero = 0;
      for (int64_t j = 0; j < f; ++j) {
        if (thr != nullptr && std::fabs(h[j]) < thr[j]) h[j] = 0.0f;  // NaN stays (as in JAX)
        nonzero += h[j] != 0.0f;
      }
      s.n_active[i] = nonzero;
    }
  }
  for (int64_t i = 0; i < pairs; ++i) s.rows[i] = s.g.data() + i * f;  // x is quantized
  Quantize(s.rows, f, w.down_t, s.h, s.v_h, pool);
  // Down rows of each routed expert for its group.
  MakeTasks(s, d, 1, pool.NumThreads(), w.down_col ? kColTile : 16, tasks);
  pool.Run(0, static_cast<int64_t>(tasks.size()), [&](int64_t ti, int /*worker*/) {
    const Task& t = tasks[ti];
    const int64_t a = s.start[t.expert], count = s.start[t.expert + 1] - a;
    QLinearOut out{DownOf(w, t.expert, d * rb_f), w.down_t, nullptr, d, s.y.data() + a * d,
                   w.down_il, w.down_col};
    QLinearRows(out, f, std::span<const QActView>(s.v_h.data() + a, count), t.lo, t.hi);
  });
}

// ReLU experts, sparse inside: each routed expert for its group through the dense FFN's exact
// oracle (its gate rows all read; up rows and down groups only of the neurons that fire).
void SparseExperts(const MoeExperts& w, int64_t pairs, MoeScratch& s, ThreadPool& pool) {
  const int64_t f = w.d_ff, d = w.dim;
  const int64_t rb_gate = QRowBytes(w.gate_t, d), rb_up = QRowBytes(w.up_t, d);
  const int64_t group_bytes = d * GetQTypeInfo(w.down_t).bytes;  // 32 neurons' down blocks
  s.n_active.resize(pairs);
  const QSparseFfnParams params{w.activation, Criterion::kOracle, 0.0f};
  for (const int32_t e : s.experts) {
    const int64_t a = s.start[e], count = s.start[e + 1] - a;
    if (!Ready(w, e, s)) return;
    QFfnWeights q;
    q.gate = GateOf(w, e, f * rb_gate);
    q.up = UpOf(w, e, f * rb_up);
    q.down = DownOf(w, e, (f / 32) * group_bytes);
    q.gate_type = w.gate_t;
    q.up_type = w.up_t;
    q.down_type = w.down_t;
    q.down_groups = true;
    q.gate_interleaved = w.gate_il;
    q.up_interleaved = w.up_il;
    q.num_neurons = f;
    q.dim = d;
    QSparseFfn(q, std::span<const float* const>(s.rows.data() + a, count), {}, params,
               s.y.data() + a * d, s.n_active.data() + a, s.sparse, pool);
  }
}

}  // namespace

bool MoeFfn(const MoeExperts& w, std::span<const float* const> x_rows, const int32_t* ids,
            const float* weights, int64_t k, float* y, MoeScratch& s, ThreadPool& pool,
            int32_t* kept) {
  const int64_t n = static_cast<int64_t>(x_rows.size());
  s.failed.store(false);
  s.wait_ns.store(0);
  if (n == 0) return true;
  const int64_t pairs = GroupPairs(w.n_experts, x_rows, ids, k, s);
  s.y.resize(pairs * w.dim);
  // the routed experts, those in memory first (their tasks are taken first: the others' reads
  // run meanwhile), each part in id order
  s.experts.clear();
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t e = 0; e < w.n_experts; ++e) {
      if (s.start[e + 1] > s.start[e] && Pending(w, e) == (pass == 1)) {
        s.experts.push_back(static_cast<int32_t>(e));
      }
    }
  }
  if (w.down_groups) {
    SparseExperts(w, pairs, s, pool);
  } else {
    DenseExperts(w, x_rows, k, pairs, s, pool);
  }
  if (s.failed.load()) return false;
  SumExperts(n, k, w.dim, weights, s, y);
  if (kept != nullptr) {  // each token's pairs' nonzero h channels (sparse: active neurons)
    for (int64_t t = 0; t < n; ++t) {
      int32_t sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t slot = s.slot[t * k + j];
        if (slot >= 0) sum += s.n_active[slot];
      }
      kept[t] = sum;
    }
  }
  return true;
}

}  // namespace pij
