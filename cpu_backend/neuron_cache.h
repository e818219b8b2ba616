// The dynamic part of a neuron store's memory: which neurons occupy its slots, and which one to
// evict when a missing neuron needs a slot. Bookkeeping only (no memory, no I/O, no threads): the
// store (neuron_store.h) owns the slots' bytes and calls this under its mutex.
//
// Keys are (layer * F + neuron). Policies (victim = the smallest key tuple among the slots the
// caller lets go):
//   kLru        (last use)                        least recently used
//   kLfu        (uses since it entered, last use)  least frequently used in the cache, ties LRU
//   kFrequency  (prior frequency, last use)        least frequent by the profile, ties LRU: the
//               static part's order carried on into the dynamic part (PowerInfer-2's neuron
//               cache keeps the profile's hot neurons; this is that with recency for ties)
//   kScore      (router score, last use)          least router probability mass, decayed: an
//               MoE expert store's policy (expert_store.h). Every call credits each key of its
//               layer with the router's probability p of it, whether routed or not: score =
//               log sum_i p_i exp(t_i / tau) (t_i the call's time in tokens), which only grows,
//               and compared at one time it orders keys as the decayed sums sum_i p_i
//               exp(-(t - t_i) / tau) do. Kept per key, not per slot: an expert read again
//               keeps what it had.
// Ties after those: the smaller key. A total order: the same sequence of calls gives the same
// slots and victims.
//
// A lazy binary min-heap: each occupied slot has at most one entry, holding its rank as it was
// when pushed. A slot's rank only grows (last use, uses; the prior is fixed), so an entry's rank
// is at most its slot's: when the top entry's rank is its slot's current one, that slot is the
// minimum. A hit (Touch), a Pin and an Unpin of a slot with an entry are O(1): a decode token
// hits a few thousand cached neurons and misses a few hundred, and keeping every hit's heap
// position exact (a sift per hit, pins taken out of the heap) measured as a tenth of the 7B's
// decode CPU time under a budget near the file. Stale entries are re-pushed and pinned slots set
// aside (re-pushed at their last Unpin) only when they reach the top while a victim is sought.
// Slots the caller keeps (a prefetch's reads in flight) are parked the same way, until Unpark
// finds them let go: re-pushing them at once made every insert of a prefetch call pop its
// earlier ones again (they rank lowest: rarely used neurons), quadratic in the call's reads (half
// the decode CPU time at a 60% budget on the 7B, perf).
#ifndef PIJ_CPU_BACKEND_NEURON_CACHE_H_
#define PIJ_CPU_BACKEND_NEURON_CACHE_H_

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace pij {

enum class CachePolicy : int32_t { kLru = 0, kLfu = 1, kFrequency = 2, kScore = 3 };

class NeuronCache {
 public:
  // num_keys: L * F (or L * E); prior: [num_keys] (kFrequency; may be empty for the others).
  NeuronCache(int64_t num_keys, int64_t num_slots, CachePolicy policy, std::span<const float> prior);
  NeuronCache(const NeuronCache&) = delete;
  NeuronCache& operator=(const NeuronCache&) = delete;

  int64_t NumSlots() const { return static_cast<int64_t>(key_of_.size()); }
  // The slot holding `key`, or -1.
  int32_t Find(int64_t key) const { return slot_of_[key]; }
  int64_t KeyOf(int32_t slot) const { return key_of_[slot]; }
  // A hit on `slot` at time `tick` (ticks never decrease).
  void Touch(int32_t slot, uint64_t tick) {
    last_use_[slot] = tick;
    ++uses_[slot];
  }
  // A slot for `key` (not cached): a free one, else the policy's victim among the unpinned
  // slots for which keep(slot) is false (the victim's key is forgotten and returned in
  // *evicted, else -1). The new slot is pinned once when `pin`. Returns -1 when every occupied
  // slot is pinned or kept.
  template <typename Keep>
  int32_t Insert(int64_t key, uint64_t tick, bool pin, const Keep& keep, int64_t* evicted);
  // kScore: adds exp(log_mass) to `key`'s score (in the log domain; the module comment).
  void Credit(int64_t key, float log_mass) {
    float& s = score_[key];
    const float hi = s > log_mass ? s : log_mass, lo = s > log_mass ? log_mass : s;
    s = lo == -kInf ? hi : hi + std::log1p(std::exp(lo - hi));
  }
  // Pins count: a pinned slot is never a victim.
  void Pin(int32_t slot) { ++pins_[slot]; }
  void Unpin(int32_t slot) {
    if (--pins_[slot] == 0 && in_heap_[slot] == kOut && key_of_[slot] >= 0) Push(slot);
  }
  bool Pinned(int32_t slot) const { return pins_[slot] > 0; }
  // Back into the heap: every parked slot that keep(slot) lets go of now (pinned ones at their
  // last Unpin). Insert calls it when it finds no victim; callers whose kept slots have been let
  // go since (reads ended) call it first.
  template <typename Keep>
  void Unpark(const Keep& keep);

 private:
  struct Entry {  // a slot's rank when pushed; the heap orders by (primary, tick, key)
    float primary;
    int32_t slot;
    uint64_t tick;
    int64_t key;
  };
  Entry Current(int32_t slot) const;
  static bool Less(const Entry& a, const Entry& b) {
    if (a.primary != b.primary) return a.primary < b.primary;
    if (a.tick != b.tick) return a.tick < b.tick;
    return a.key < b.key;
  }
  void Push(int32_t slot);
  Entry PopTop();
  // The unpinned slot of least rank for which keep() is false, out of the heap; -1 if none.
  template <typename Keep>
  int32_t PopVictim(const Keep& keep);

  static constexpr float kInf = std::numeric_limits<float>::infinity();
  CachePolicy policy_;
  std::vector<float> prior_;
  std::vector<float> score_;      // [num_keys] kScore's, else empty
  std::vector<int32_t> slot_of_;  // [num_keys]
  std::vector<int64_t> key_of_;   // [slots], -1: free
  std::vector<uint64_t> last_use_, uses_;
  std::vector<int32_t> pins_;
  enum : uint8_t { kOut = 0, kIn = 1, kParked = 2 };
  std::vector<uint8_t> in_heap_;  // [slots]: kIn (has an entry), kParked (in parked_), kOut
  std::vector<Entry> heap_;
  std::vector<int32_t> free_;     // free slots, taken from the back
  std::vector<int32_t> parked_;   // kept slots, out of the heap
};

template <typename Keep>
void NeuronCache::Unpark(const Keep& keep) {
  size_t kept = 0;
  for (const int32_t s : parked_) {
    if (in_heap_[s] != kParked) continue;  // (cannot happen: only Unpark takes slots out)
    if (keep(s)) {
      parked_[kept++] = s;
    } else if (pins_[s] > 0) {
      in_heap_[s] = kOut;  // its last Unpin pushes it
    } else {
      Push(s);
    }
  }
  parked_.resize(kept);
}

template <typename Keep>
int32_t NeuronCache::PopVictim(const Keep& keep) {
  for (int pass = 0; pass < 2; ++pass) {
    while (!heap_.empty()) {
      const Entry top = PopTop();
      const int32_t s = top.slot;
      in_heap_[s] = kOut;
      const Entry now = Current(s);
      if (now.primary != top.primary || now.tick != top.tick) {
        Push(s);  // stale: its slot's rank grew since; back in at its rank now
        continue;
      }
      if (pins_[s] > 0) continue;  // in use: out until its last Unpin pushes it again
      if (keep(s)) {  // out until Unpark finds it let go
        in_heap_[s] = kParked;
        parked_.push_back(s);
        continue;
      }
      return s;
    }
    Unpark(keep);  // slots let go since they were parked
  }
  return -1;
}

template <typename Keep>
int32_t NeuronCache::Insert(int64_t key, uint64_t tick, bool pin, const Keep& keep,
                            int64_t* evicted) {
  *evicted = -1;
  int32_t slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    slot = PopVictim(keep);
    if (slot < 0) return -1;
    *evicted = key_of_[slot];
    slot_of_[key_of_[slot]] = -1;
  }
  key_of_[slot] = key;
  slot_of_[key] = slot;
  last_use_[slot] = tick;
  uses_[slot] = 1;
  if (pin) {
    Pin(slot);  // pushed at its last Unpin
  } else {
    Push(slot);
  }
  return slot;
}

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_NEURON_CACHE_H_
