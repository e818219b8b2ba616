#include "cpu_backend/expert_store.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace pij {
namespace {

std::string Expected(const std::string& what, const std::string& rule, const std::string& got) {
  return what + ": expected " + rule + ", got " + got;
}

}  // namespace

std::string CheckExpertLayout(const ExpertLayout& l) {
  if (l.num_layers < 1 || l.num_experts < 1 || l.num_experts > (int64_t{1} << 20)) {
    return Expected("expert layout", "num_layers >= 1 and num_experts in [1, 2^20]",
                    std::to_string(l.num_layers) + ", " + std::to_string(l.num_experts));
  }
  if (l.slot_bytes < kDirectAlign || l.slot_bytes % kDirectAlign != 0) {
    return Expected("expert layout slot_bytes", "a positive multiple of " +
                                                    std::to_string(kDirectAlign),
                    std::to_string(l.slot_bytes));
  }
  if (l.data_offset < 0 || l.data_offset % kDirectAlign != 0) {
    return Expected("expert layout data_offset", "a multiple of " + std::to_string(kDirectAlign),
                    std::to_string(l.data_offset));
  }
  for (const int64_t at : {l.gate_offset, l.up_offset, l.down_offset}) {
    if (at < 0 || at >= l.slot_bytes) {
      return Expected("expert layout matrix offsets", "in [0, slot_bytes=" +
                                                          std::to_string(l.slot_bytes) + ")",
                      std::to_string(at));
    }
  }
  return "";
}

std::unique_ptr<ExpertStore> ExpertStore::Open(ExpertStoreOptions o, std::string* error) {
  const ExpertLayout& l = o.layout;
  if (std::string e = CheckExpertLayout(l); !e.empty()) {
    *error = e;
    return nullptr;
  }
  const int64_t keys = l.num_layers * l.num_experts;
  if (static_cast<int64_t>(o.pinned.size()) != keys ||
      !(o.prior.empty() || static_cast<int64_t>(o.prior.size()) == keys)) {
    *error = Expected("expert store tables (pinned; prior optional)",
                      std::to_string(keys) + " entries (layers x experts)",
                      std::to_string(o.pinned.size()) + ", " + std::to_string(o.prior.size()));
    return nullptr;
  }
  int64_t n_pinned = 0, most_unpinned = 0;
  for (int64_t layer = 0; layer < l.num_layers; ++layer) {
    int64_t unpinned = 0;
    for (int64_t e = 0; e < l.num_experts; ++e) {
      unpinned += o.pinned[layer * l.num_experts + e] == 0;
    }
    n_pinned += l.num_experts - unpinned;
    most_unpinned = std::max(most_unpinned, unpinned);
  }
  if (o.cache_slots < most_unpinned) {
    *error = Expected("expert store cache_slots",
                      "at least " + std::to_string(most_unpinned) +
                          " (a layer's unpinned experts: one call may route to them all)",
                      std::to_string(o.cache_slots));
    return nullptr;
  }
  if (o.readers < 1 || o.readers > 1024 || o.read_bytes < kDirectAlign ||
      o.read_bytes % kDirectAlign != 0 || !(o.score_tau > 0.0f) || !std::isfinite(o.score_tau)) {
    *error = Expected("expert store readers, read_bytes, score_tau",
                      "[1, 1024], a positive multiple of " + std::to_string(kDirectAlign) +
                          ", a finite number > 0",
                      std::to_string(o.readers) + ", " + std::to_string(o.read_bytes) + ", " +
                          std::to_string(o.score_tau));
    return nullptr;
  }
  if (o.policy == CachePolicy::kFrequency && o.prior.empty()) {
    *error = Expected("expert store prior", "routing frequencies for the frequency policy",
                      "none");
    return nullptr;
  }
  std::unique_ptr<ExpertStore> s(new ExpertStore());
  s->reader_ = std::make_unique<BundleReader>(o.path, o.readers, o.direct, error);
  if (!s->reader_->ok()) return nullptr;
  if (s->reader_->FileSize() < l.FileBytes()) {
    *error = Expected(o.path + ": size", "at least " + std::to_string(l.FileBytes()) +
                                             " bytes (the layout's)",
                      std::to_string(s->reader_->FileSize()) + " (truncated?)");
    return nullptr;
  }
  s->pieces_ = (l.slot_bytes + o.read_bytes - 1) / o.read_bytes;
  try {
    s->pinned_ = std::make_unique<Arena>(static_cast<size_t>(n_pinned * l.slot_bytes));
    s->dynamic_ = std::make_unique<Arena>(static_cast<size_t>(o.cache_slots * l.slot_bytes));
    s->cache_ = std::make_unique<NeuronCache>(keys, o.cache_slots, o.policy, o.prior);
    s->state_ = std::make_unique<std::atomic<uint32_t>[]>(o.cache_slots * s->pieces_);
  } catch (const std::bad_alloc&) {
    *error = "expert store: out of memory allocating " +
             std::to_string((n_pinned + o.cache_slots) * l.slot_bytes) + " bytes";
    return nullptr;
  }
  s->by_prefetch_.assign(o.cache_slots, 0);
  s->guess_.resize(l.num_layers);
  s->guessed_.assign(l.num_layers, 0);
  s->pinned_slot_.assign(keys, -1);
  s->o_ = std::move(o);
  // The pinned experts, each in pieces of at most read_bytes, one flag per piece.
  const int64_t pieces = s->pieces_;
  std::vector<std::atomic<uint32_t>> loaded(static_cast<size_t>(n_pinned * pieces));
  std::vector<ReadJob> jobs;
  int32_t next = 0;
  for (int64_t key = 0; key < keys; ++key) {
    if (!s->o_.pinned[key]) continue;
    s->pinned_slot_[key] = next;
    uint8_t* dst = s->pinned_->data + next * l.slot_bytes;
    const int64_t at = l.data_offset + key * l.slot_bytes;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t off = p * s->o_.read_bytes;
      std::atomic<uint32_t>* flag = &loaded[next * pieces + p];
      flag->store(kSlotLoading);
      ReadJob job;
      job.offset = at + off;
      job.iov.push_back({dst + off, static_cast<size_t>(
                                        std::min(s->o_.read_bytes, l.slot_bytes - off))});
      job.done.push_back(flag);
      jobs.push_back(std::move(job));
    }
    ++next;
  }
  s->reader_->Submit(jobs, /*prefetch=*/false);
  std::vector<const std::atomic<uint32_t>*> flags;
  for (const std::atomic<uint32_t>& f : loaded) flags.push_back(&f);
  if (!WaitAll(flags)) {  // all of them: the flags are ours
    *error = "expert store: reading the pinned experts: " + s->reader_->LastError();
    return nullptr;
  }
  s->stats_.pinned_experts = n_pinned;
  s->stats_.cache_slots = s->o_.cache_slots;
  s->stats_.resident_bytes = static_cast<int64_t>(s->pinned_->bytes + s->dynamic_->bytes);
  s->reader_base_ = s->reader_->Stats();  // loading is not a call's reading
  return s;
}

ExpertStore::~ExpertStore() {
  reader_.reset();  // joins the readers before the arenas they write into go
}

bool ExpertStore::WaitAll(std::span<const std::atomic<uint32_t>* const> flags) {
  bool ok = true;
  for (const std::atomic<uint32_t>* f : flags) {
    uint32_t v = f->load(std::memory_order_acquire);
    while (v == kSlotLoading) {
      f->wait(kSlotLoading, std::memory_order_acquire);
      v = f->load(std::memory_order_acquire);
    }
    ok &= v == kSlotReady;
  }
  return ok;
}

bool ExpertStore::Loading(int32_t slot) const {
  for (int64_t p = 0; p < pieces_; ++p) {
    if (state_[slot * pieces_ + p].load(std::memory_order_acquire) == kSlotLoading) return true;
  }
  return false;
}

bool ExpertStore::Failed(int32_t slot) const {
  for (int64_t p = 0; p < pieces_; ++p) {
    if (state_[slot * pieces_ + p].load(std::memory_order_acquire) == kSlotFailed) return true;
  }
  return false;
}

void ExpertStore::ReadInto(int64_t key, int32_t slot, std::vector<ReadJob>& jobs) {
  const ExpertLayout& l = o_.layout;
  uint8_t* dst = dynamic_->data + slot * l.slot_bytes;
  const int64_t at = l.data_offset + key * l.slot_bytes;
  for (int64_t p = 0; p < pieces_; ++p) {
    const int64_t off = p * o_.read_bytes;
    std::atomic<uint32_t>* flag = &state_[slot * pieces_ + p];
    flag->store(kSlotLoading, std::memory_order_release);
    ReadJob job;
    job.offset = at + off;
    job.iov.push_back(
        {dst + off, static_cast<size_t>(std::min(o_.read_bytes, l.slot_bytes - off))});
    job.done.push_back(flag);
    jobs.push_back(std::move(job));
  }
}

int32_t ExpertStore::SlotFor(int64_t key, bool demand) {
  for (;;) {
    int64_t evicted;
    const int32_t slot = cache_->Insert(
        key, tick_, /*pin=*/demand, [&](int32_t s) { return Loading(s); }, &evicted);
    if (evicted >= 0) ++stats_.evictions;
    if (slot >= 0 || !demand) return slot;
    // every unpinned slot is being read ahead: wait for one (Open's minimum of cache_slots
    // leaves a demand call enough slots once those reads end)
    int32_t loading = -1;
    for (int32_t s = 0; s < static_cast<int32_t>(o_.cache_slots) && loading < 0; ++s) {
      if (!cache_->Pinned(s) && Loading(s)) loading = s;
    }
    if (loading < 0) return -1;
    std::vector<const std::atomic<uint32_t>*> flags;
    for (int64_t p = 0; p < pieces_; ++p) flags.push_back(&state_[loading * pieces_ + p]);
    WaitAll(flags);
  }
}

void ExpertStore::Credit(int64_t layer, std::span<const float* const> probs) {
  if (o_.policy != CachePolicy::kScore) return;
  const ExpertLayout& l = o_.layout;
  std::lock_guard<std::mutex> lock(mutex_);
  // time in tokens: a token is num_layers calls
  const float now = static_cast<float>(static_cast<double>(tick_) / l.num_layers / o_.score_tau);
  for (const float* row : probs) {
    for (int64_t e = 0; e < l.num_experts; ++e) {
      if (row[e] > 0.0f) cache_->Credit(layer * l.num_experts + e, std::log(row[e]) + now);
    }
  }
}

bool ExpertStore::Acquire(int64_t layer, std::span<const int32_t> experts, int64_t tokens,
                          ExpertLease& lease, std::string* error) {
  const ExpertLayout& l = o_.layout;
  const size_t n = experts.size();
  lease.base.assign(n, nullptr);
  lease.flags.clear();
  lease.flag_begin.assign(n + 1, 0);
  lease.pinned.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  const ExpertStoreStats before = stats_;
  ++tick_;
  cache_->Unpark([&](int32_t s) { return Loading(s); });  // slots read ahead since
  ++stats_.calls;
  stats_.requested += static_cast<int64_t>(n);
  if (tokens == 1 && guessed_[layer]) {  // the read-ahead's guess against this call's experts
    const std::vector<int32_t>& g = guess_[layer];
    for (const int32_t e : experts) {
      stats_.one_token.predicted_hits += std::binary_search(g.begin(), g.end(), e);
    }
    stats_.one_token.guessed_routed += static_cast<int64_t>(n);
    guessed_[layer] = 0;
  }
  // Two passes: every expert in memory (or being read ahead) is pinned before any miss takes a
  // slot, so a miss never evicts an expert this very call needs (under "frequency" a read-ahead
  // expert, rarely routed, is the first victim otherwise).
  std::vector<int32_t>& slot = slot_scratch_;
  slot.assign(n, -1);
  for (size_t k = 0; k < n; ++k) {
    const int64_t key = layer * l.num_experts + experts[k];
    if (const int32_t ps = pinned_slot_[key]; ps >= 0) {
      lease.base[k] = pinned_->data + ps * l.slot_bytes;
      ++stats_.pinned_hits;
      continue;
    }
    const int32_t s = cache_->Find(key);
    if (s >= 0 && !Failed(s)) {
      cache_->Touch(s, tick_);
      cache_->Pin(s);
      ++stats_.cache_hits;
      if (by_prefetch_[s]) {
        ++stats_.prefetch_hits;
        by_prefetch_[s] = 0;
      }
      slot[k] = s;
      lease.pinned.push_back(s);
    }
  }
  for (size_t k = 0; k < n; ++k) {
    const int64_t key = layer * l.num_experts + experts[k];
    if (lease.base[k] != nullptr || slot[k] >= 0) continue;
    int32_t s = cache_->Find(key);
    if (s >= 0) {
      cache_->Pin(s);  // a failed read's slot: read again
    } else {
      s = SlotFor(key, /*demand=*/true);  // pinned
    }
    if (s < 0) {  // only with fewer slots than Open requires: undo and report
      for (const int32_t p : lease.pinned) cache_->Unpin(p);
      lease.pinned.clear();
      *error = "expert store: no slot free for a missing expert (cache_slots " +
               std::to_string(o_.cache_slots) + ")";
      return false;
    }
    ++stats_.misses;
    by_prefetch_[s] = 0;
    ReadInto(key, s, jobs_);
    slot[k] = s;
    lease.pinned.push_back(s);
  }
  for (size_t k = 0; k < n; ++k) {
    lease.flag_begin[k] = static_cast<int32_t>(lease.flags.size());
    if (slot[k] < 0) continue;  // pinned: in memory
    const int32_t s = slot[k];
    lease.base[k] = dynamic_->data + s * l.slot_bytes;
    for (int64_t p = 0; p < pieces_; ++p) {
      const std::atomic<uint32_t>* f = &state_[s * pieces_ + p];
      if (f->load(std::memory_order_acquire) != kSlotReady) lease.flags.push_back(f);
    }
  }
  lease.flag_begin[n] = static_cast<int32_t>(lease.flags.size());
  if (tokens == 1) {
    ExpertStoreStats::Calls& one = stats_.one_token;
    ++one.calls;
    one.requested += static_cast<int64_t>(n);
    one.pinned_hits += stats_.pinned_hits - before.pinned_hits;
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

void ExpertStore::Release(ExpertLease& lease) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const int32_t s : lease.pinned) cache_->Unpin(s);
  lease.pinned.clear();
}

void ExpertStore::Prefetch(int64_t layer, std::span<const int32_t> experts, int64_t tokens) {
  const ExpertLayout& l = o_.layout;
  std::lock_guard<std::mutex> lock(mutex_);
  ++tick_;
  if (tokens == 1) {
    guess_[layer].assign(experts.begin(), experts.end());
    std::sort(guess_[layer].begin(), guess_[layer].end());
    guessed_[layer] = 1;
    stats_.one_token.predicted += static_cast<int64_t>(experts.size());
  }
  for (const int32_t e : experts) {
    const int64_t key = layer * l.num_experts + e;
    if (pinned_slot_[key] >= 0 || cache_->Find(key) >= 0) continue;
    const int32_t s = SlotFor(key, /*demand=*/false);
    if (s < 0) break;  // every slot held or loading: read no further ahead
    ++stats_.prefetched;
    by_prefetch_[s] = 1;
    ReadInto(key, s, jobs_);
  }
  if (tokens == 1) {
    for (const ReadJob& job : jobs_) {
      for (const iovec& v : job.iov) {
        stats_.one_token.prefetch_bytes += static_cast<int64_t>(v.iov_len);
      }
    }
  }
  reader_->Submit(jobs_, /*prefetch=*/true);
}

ExpertStoreStats ExpertStore::Stats() const {
  ExpertStoreStats out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out = stats_;
  }
  AddReadStats(*reader_, reader_base_, wait_ns_.load(std::memory_order_relaxed), out);
  return out;
}

void ExpertStore::ResetStats() {
  std::lock_guard<std::mutex> lock(mutex_);
  const ExpertStoreStats keep = stats_;
  stats_ = ExpertStoreStats();
  stats_.pinned_experts = keep.pinned_experts;
  stats_.cache_slots = keep.cache_slots;
  stats_.resident_bytes = keep.resident_bytes;
  reader_base_ = reader_->Stats();
  wait_ns_.store(0, std::memory_order_relaxed);
}

int64_t ExpertStoreRegistry::Add(std::shared_ptr<ExpertStore> store) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t handle = next_++;
  stores_.emplace(handle, std::move(store));
  return handle;
}

std::shared_ptr<ExpertStore> ExpertStoreRegistry::Get(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = stores_.find(handle);
  return it == stores_.end() ? nullptr : it->second;
}

bool ExpertStoreRegistry::Remove(int64_t handle) {
  std::lock_guard<std::mutex> lock(mutex_);
  return stores_.erase(handle) > 0;
}

ExpertStoreRegistry& ExpertStores() {
  static ExpertStoreRegistry* registry = new ExpertStoreRegistry();  // leaked: outlives callers
  return *registry;
}

}  // namespace pij
