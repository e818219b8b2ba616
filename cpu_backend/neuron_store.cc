#include "cpu_backend/neuron_store.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <tuple>
#include <utility>

#include "cpu_backend/arena.h"

namespace pij {

struct NeuronStore::Arena : pij::Arena {  // arena.h
  using pij::Arena::Arena;
};

namespace {

std::string Expected(const std::string& what, const std::string& rule, const std::string& got) {
  return what + ": expected " + rule + ", got " + got;
}

}  // namespace

std::string CheckLayout(const BundleLayout& l) {
  if (l.num_layers < 1 || l.num_neurons < 1 || l.dim < 1) {
    return Expected("layout", "num_layers, num_neurons and dim >= 1",
                    std::to_string(l.num_layers) + ", " + std::to_string(l.num_neurons) + ", " +
                        std::to_string(l.dim));
  }
  if (l.num_neurons > (int64_t{1} << 30)) {
    return Expected("layout num_neurons", "at most 2^30", std::to_string(l.num_neurons));
  }
  for (const QType t : {l.gate_type, l.up_type, l.down_type}) {
    if (!IsQType(static_cast<int32_t>(t))) {
      return Expected("layout types", "GGML block type ids", std::to_string(static_cast<int>(t)));
    }
    if (l.dim % GetQTypeInfo(t).block != 0) {
      return Expected("layout dim", std::string("a multiple of ") + GetQTypeInfo(t).name +
                                        "'s block", std::to_string(l.dim));
    }
  }
  if (l.slot_bytes < l.BundleBytes() || l.slot_bytes % kDirectAlign != 0) {
    return Expected("layout slot_bytes",
                    "a multiple of " + std::to_string(kDirectAlign) + " >= the bundle's " +
                        std::to_string(l.BundleBytes()) + " bytes",
                    std::to_string(l.slot_bytes));
  }
  if (l.data_offset < 0 || l.data_offset % kDirectAlign != 0) {
    return Expected("layout data_offset", "a multiple of " + std::to_string(kDirectAlign),
                    std::to_string(l.data_offset));
  }
  if (l.down_groups) {
    if (DownGroupScaleBytes(l.down_type) == 0 || l.num_neurons % 32 != 0) {
      return Expected("layout down groups", "a 32-weight legacy down type (Q4_0, Q4_1, Q5_0, "
                      "Q5_1, Q8_0) and num_neurons a multiple of 32",
                      std::string(GetQTypeInfo(l.down_type).name) + ", " +
                          std::to_string(l.num_neurons));
    }
    if (l.planes_offset < 0 || l.planes_offset % kDirectAlign != 0 ||
        l.planes_stride < l.PlaneBytes() || l.planes_stride % kDirectAlign != 0 ||
        l.planes_offset + l.num_layers * l.planes_stride > l.data_offset) {
      return Expected("layout planes_offset, planes_stride",
                      "multiples of " + std::to_string(kDirectAlign) + ", a stride >= " +
                          std::to_string(l.PlaneBytes()) + " bytes, the planes before the data",
                      std::to_string(l.planes_offset) + ", " + std::to_string(l.planes_stride));
    }
  }
  return "";
}

std::unique_ptr<NeuronStore> NeuronStore::Open(NeuronStoreOptions o, std::string* error) {
  const BundleLayout& l = o.layout;
  if (std::string e = CheckLayout(l); !e.empty()) {
    *error = e;
    return nullptr;
  }
  const int64_t keys = l.num_layers * l.num_neurons;
  auto sized = [&](size_t n, bool optional) { return n == static_cast<size_t>(keys) ||
                                                     (optional && n == 0); };
  if (!sized(o.position.size(), false) || !sized(o.hot.size(), false) ||
      !sized(o.prior.size(), true) || !sized(o.b_up.size(), true)) {
    *error = Expected("store tables (position, hot; prior, b_up optional)",
                      std::to_string(keys) + " entries (layers x neurons)",
                      std::to_string(o.position.size()) + ", " + std::to_string(o.hot.size()) +
                          ", " + std::to_string(o.prior.size()) + ", " +
                          std::to_string(o.b_up.size()));
    return nullptr;
  }
  // every layer's positions: a permutation of [0, F)
  std::vector<uint8_t> seen(l.num_neurons);
  int64_t most_cold = 0, n_static = 0;
  for (int64_t layer = 0; layer < l.num_layers; ++layer) {
    std::fill(seen.begin(), seen.end(), 0);
    int64_t cold = 0;
    for (int64_t i = 0; i < l.num_neurons; ++i) {
      const int32_t p = o.position[layer * l.num_neurons + i];
      if (p < 0 || p >= l.num_neurons || seen[p]) {
        *error = Expected("store position[" + std::to_string(layer) + "]",
                          "a permutation of [0, " + std::to_string(l.num_neurons) + ")",
                          "position " + std::to_string(p) + " at neuron " + std::to_string(i));
        return nullptr;
      }
      seen[p] = 1;
      cold += o.hot[layer * l.num_neurons + i] == 0;
    }
    n_static += l.num_neurons - cold;
    most_cold = std::max(most_cold, cold);
  }
  if (o.cache_slots < most_cold) {
    *error = Expected("store cache_slots", "at least " + std::to_string(most_cold) +
                                               " (a layer's neurons outside the static part: "
                                               "one call may need them all)",
                      std::to_string(o.cache_slots));
    return nullptr;
  }
  if (o.readers < 1 || o.readers > 1024 || o.max_gap < 0 || o.max_read_bytes < l.slot_bytes) {
    *error = Expected("store readers, max_gap, max_read_bytes",
                      "[1, 1024], >= 0, >= one slot (" + std::to_string(l.slot_bytes) + ")",
                      std::to_string(o.readers) + ", " + std::to_string(o.max_gap) + ", " +
                          std::to_string(o.max_read_bytes));
    return nullptr;
  }
  std::unique_ptr<NeuronStore> s(new NeuronStore());
  s->reader_ = std::make_unique<BundleReader>(o.path, o.readers, o.direct, error);
  if (!s->reader_->ok()) return nullptr;
  if (s->reader_->FileSize() < l.FileBytes()) {
    *error = Expected(o.path + ": size", "at least " + std::to_string(l.FileBytes()) +
                                             " bytes (the layout's)",
                      std::to_string(s->reader_->FileSize()) + " (truncated?)");
    return nullptr;
  }
  try {
    s->static_ = std::make_unique<Arena>(n_static * l.slot_bytes);
    s->dynamic_ = std::make_unique<Arena>(o.cache_slots * l.slot_bytes);
    s->gap_ = std::make_unique<Arena>(std::max<int64_t>(o.max_gap, 1) * l.slot_bytes);
    s->planes_ = std::make_unique<Arena>(l.down_groups ? l.num_layers * l.planes_stride : 0);
    s->cache_ = std::make_unique<NeuronCache>(keys, o.cache_slots, o.policy, o.prior);
    s->state_ = std::make_unique<std::atomic<uint32_t>[]>(o.cache_slots);
  } catch (const std::bad_alloc&) {
    *error = "neuron store: out of memory allocating " +
             std::to_string((n_static + o.cache_slots) * l.slot_bytes) + " bytes";
    return nullptr;
  }
  s->by_prefetch_.assign(o.cache_slots, 0);
  s->static_slot_.assign(keys, -1);
  // The static part: each layer's static neurons in file order, read now (coalesced, no gap
  // limit worth having: a layer's hot neurons come first in a file sorted by frequency).
  std::vector<std::atomic<uint32_t>> loaded(n_static);
  int32_t next = 0;
  std::vector<std::tuple<int32_t, uint8_t*, std::atomic<uint32_t>*>> want;
  std::vector<ReadJob> jobs;
  s->o_ = std::move(o);
  for (int64_t layer = 0; layer < l.num_layers; ++layer) {
    want.clear();
    for (int64_t i = 0; i < l.num_neurons; ++i) {
      const int64_t key = layer * l.num_neurons + i;
      if (!s->o_.hot[key]) continue;
      s->static_slot_[key] = next;
      loaded[next].store(kSlotLoading);
      want.emplace_back(s->o_.position[key], s->static_->data + next * l.slot_bytes, &loaded[next]);
      ++next;
    }
    std::sort(want.begin(), want.end(),
              [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
    s->MakeJobs(layer, want, /*max_gap=*/0, jobs);
    s->reader_->Submit(jobs, /*prefetch=*/false);
  }
  // the down groups' scale planes: one read per layer
  std::vector<std::atomic<uint32_t>> planes_loaded(l.down_groups ? l.num_layers : 0);
  for (size_t layer = 0; layer < planes_loaded.size(); ++layer) {
    planes_loaded[layer].store(kSlotLoading);
    ReadJob job;
    job.offset = l.planes_offset + static_cast<int64_t>(layer) * l.planes_stride;
    job.iov.push_back({s->planes_->data + layer * l.planes_stride,
                       static_cast<size_t>(l.planes_stride)});
    job.done.push_back(&planes_loaded[layer]);
    jobs.push_back(std::move(job));
  }
  s->reader_->Submit(jobs, /*prefetch=*/false);
  bool ok = true;
  for (int32_t k = 0; k < next; ++k) ok &= Wait(&loaded[k]);  // all of them: the flags are ours
  for (auto& flag : planes_loaded) ok &= Wait(&flag);
  if (!ok) {
    *error = "neuron store: loading the static neurons: " + s->reader_->LastError();
    return nullptr;
  }
  s->stats_.static_neurons = n_static;
  s->stats_.cache_slots = s->o_.cache_slots;
  s->stats_.resident_bytes =
      static_cast<int64_t>(s->static_->bytes + s->dynamic_->bytes + s->planes_->bytes);
  s->reader_base_ = s->reader_->Stats();  // loading is not a call's reading
  return s;
}

const uint8_t* NeuronStore::Planes(int64_t layer) const {
  return planes_->data + layer * o_.layout.planes_stride;
}

NeuronStore::~NeuronStore() {
  reader_.reset();  // joins the readers before the arenas they write into go
}

void NeuronStore::MakeJobs(
    int64_t layer, std::vector<std::tuple<int32_t, uint8_t*, std::atomic<uint32_t>*>>& want,
    int64_t max_gap, std::vector<ReadJob>& jobs) {
  const BundleLayout& l = o_.layout;
  const int64_t slot = l.slot_bytes;
  for (size_t i = 0; i < want.size();) {
    ReadJob job;
    const int32_t first = std::get<0>(want[i]);
    job.offset = l.data_offset + (layer * l.num_neurons + first) * slot;
    int32_t last = first - 1;
    int64_t bytes = 0;
    while (i < want.size()) {
      const auto& [pos, dst, flag] = want[i];
      const int64_t gap = pos - last - 1;
      if (last >= first && (gap > max_gap || bytes + (gap + 1) * slot > o_.max_read_bytes)) break;
      if (last >= first && gap > 0) {
        job.iov.push_back({gap_->data, static_cast<size_t>(gap * slot)});
        stats_.gap_bytes += gap * slot;
        bytes += gap * slot;
      }
      job.iov.push_back({dst, static_cast<size_t>(slot)});
      job.done.push_back(flag);
      bytes += slot;
      last = pos;
      ++i;
    }
    jobs.push_back(std::move(job));
  }
}

bool NeuronStore::Wait(const std::atomic<uint32_t>* pending) {
  uint32_t v = pending->load(std::memory_order_acquire);
  while (v == kSlotLoading) {
    pending->wait(kSlotLoading, std::memory_order_acquire);
    v = pending->load(std::memory_order_acquire);
  }
  return v == kSlotReady;
}

bool NeuronStore::Loading(int32_t slot) const {
  return state_[slot].load(std::memory_order_acquire) == kSlotLoading;
}

int32_t NeuronStore::SlotFor(int64_t key, bool demand) {
  for (;;) {
    int64_t evicted;
    const int32_t slot = cache_->Insert(
        key, tick_, /*pin=*/demand, [&](int32_t s) { return Loading(s); }, &evicted);
    if (evicted >= 0) ++stats_.evictions;
    if (slot >= 0 || !demand) return slot;
    // Every unpinned slot is being read by a prefetch: wait for one (Open's minimum of
    // cache_slots leaves a demand call enough slots once those reads end).
    int32_t loading = -1;
    for (int32_t s = 0; s < static_cast<int32_t>(o_.cache_slots) && loading < 0; ++s) {
      if (!cache_->Pinned(s) && state_[s].load(std::memory_order_acquire) == kSlotLoading) {
        loading = s;
      }
    }
    if (loading < 0) return -1;
    Wait(&state_[loading]);
  }
}

bool NeuronStore::Acquire(int64_t layer, std::span<const int32_t> ids, int64_t tokens,
                          NeuronLease& lease, std::string* error) {
  const BundleLayout& l = o_.layout;
  const size_t n = ids.size();
  lease.bundle.assign(n, nullptr);
  lease.pending.assign(n, nullptr);
  lease.pinned.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  const NeuronStoreStats before = stats_;
  ++tick_;
  cache_->Unpark([&](int32_t s) { return Loading(s); });  // prefetched slots read since
  ++stats_.calls;
  if (tracing_) {
    for (const int32_t id : ids) trace_keys_.push_back(layer * l.num_neurons + id);
    trace_ends_.push_back(static_cast<int64_t>(trace_keys_.size()));
  }
  stats_.requested += static_cast<int64_t>(n);
  want_.clear();
  for (size_t k = 0; k < n; ++k) {
    const int64_t key = layer * l.num_neurons + ids[k];
    if (const int32_t hs = static_slot_[key]; hs >= 0) {
      lease.bundle[k] = static_->data + hs * l.slot_bytes;
      ++stats_.static_hits;
      continue;
    }
    int32_t s = cache_->Find(key);
    if (s >= 0 && state_[s].load(std::memory_order_acquire) != kSlotFailed) {
      cache_->Touch(s, tick_);
      cache_->Pin(s);
      ++stats_.cache_hits;
      if (by_prefetch_[s]) {
        ++stats_.prefetch_hits;
        by_prefetch_[s] = 0;
      }
    } else {
      if (s >= 0) {
        cache_->Pin(s);  // a failed read's slot: read again
      } else {
        s = SlotFor(key, /*demand=*/true);  // pinned
      }
      if (s < 0) {  // only with fewer slots than Open requires: undo and report
        for (const int32_t p : lease.pinned) cache_->Unpin(p);
        lease.pinned.clear();
        for (auto& [pos, dst, flag] : want_) flag->store(kSlotFailed, std::memory_order_release);
        *error = "neuron store: no slot free for a missing neuron (cache_slots " +
                 std::to_string(o_.cache_slots) + ")";
        return false;
      }
      ++stats_.misses;
      by_prefetch_[s] = 0;
      state_[s].store(kSlotLoading, std::memory_order_release);
      want_.emplace_back(o_.position[key], dynamic_->data + s * l.slot_bytes, &state_[s]);
    }
    lease.pinned.push_back(s);
    lease.bundle[k] = dynamic_->data + s * l.slot_bytes;
    if (state_[s].load(std::memory_order_acquire) != kSlotReady) lease.pending[k] = &state_[s];
  }
  std::sort(want_.begin(), want_.end(),
            [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  MakeJobs(layer, want_, o_.max_gap, jobs_);
  if (tokens == 1) {
    NeuronStoreStats::Calls& one = stats_.one_token;
    ++one.calls;
    one.requested += static_cast<int64_t>(n);
    one.static_hits += stats_.static_hits - before.static_hits;
    one.cache_hits += stats_.cache_hits - before.cache_hits;
    one.misses += stats_.misses - before.misses;
    one.prefetch_hits += stats_.prefetch_hits - before.prefetch_hits;
    for (const ReadJob& job : jobs_) {
      for (const iovec& v : job.iov) one.demand_bytes += static_cast<int64_t>(v.iov_len);
    }
  }
  reader_->Submit(jobs_, /*prefetch=*/false);
  return true;
}

void NeuronStore::Release(NeuronLease& lease) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const int32_t s : lease.pinned) cache_->Unpin(s);
  lease.pinned.clear();
}

void NeuronStore::Prefetch(int64_t layer, std::span<const int32_t> ids, int64_t tokens) {
  const BundleLayout& l = o_.layout;
  std::lock_guard<std::mutex> lock(mutex_);
  ++tick_;
  want_.clear();
  for (const int32_t id : ids) {
    const int64_t key = layer * l.num_neurons + id;
    if (static_slot_[key] >= 0 || cache_->Find(key) >= 0) continue;
    const int32_t s = SlotFor(key, /*demand=*/false);
    if (s < 0) break;  // every slot held or loading: prefetch no further
    ++stats_.prefetched;
    by_prefetch_[s] = 1;
    state_[s].store(kSlotLoading, std::memory_order_release);
    want_.emplace_back(o_.position[key], dynamic_->data + s * l.slot_bytes, &state_[s]);
  }
  std::sort(want_.begin(), want_.end(),
            [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  MakeJobs(layer, want_, o_.max_gap, jobs_);
  if (tokens == 1) {
    for (const ReadJob& job : jobs_) {
      for (const iovec& v : job.iov) stats_.one_token.prefetch_bytes += static_cast<int64_t>(v.iov_len);
    }
  }
  reader_->Submit(jobs_, /*prefetch=*/true);
}

NeuronStoreStats NeuronStore::Stats() const {
  NeuronStoreStats out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out = stats_;
  }
  AddReadStats(*reader_, reader_base_, wait_ns_.load(std::memory_order_relaxed), out);
  return out;
}

void NeuronStore::ResetStats() {
  std::lock_guard<std::mutex> lock(mutex_);
  const NeuronStoreStats keep = stats_;
  stats_ = NeuronStoreStats();
  stats_.static_neurons = keep.static_neurons;
  stats_.cache_slots = keep.cache_slots;
  stats_.resident_bytes = keep.resident_bytes;
  reader_base_ = reader_->Stats();
  wait_ns_.store(0, std::memory_order_relaxed);
}

void NeuronStore::Trace(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  tracing_ = on;
}

void NeuronStore::TakeTrace(std::vector<int64_t>& keys, std::vector<int64_t>& ends) {
  std::lock_guard<std::mutex> lock(mutex_);
  keys.swap(trace_keys_);
  ends.swap(trace_ends_);
  trace_keys_.clear();
  trace_ends_.clear();
}

int64_t NeuronStoreRegistry::Add(std::shared_ptr<NeuronStore> store) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t handle = next_++;
  stores_.emplace(handle, std::move(store));
  return handle;
}

std::shared_ptr<NeuronStore> NeuronStoreRegistry::Get(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = stores_.find(handle);
  return it == stores_.end() ? nullptr : it->second;
}

bool NeuronStoreRegistry::Remove(int64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  return stores_.erase(handle) > 0;
}

NeuronStoreRegistry& NeuronStores() {
  static NeuronStoreRegistry* registry = new NeuronStoreRegistry();  // leaked: outlives callers
  return *registry;
}

}  // namespace pij
