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
// A binary min-heap over the occupied slots nobody pins, keyed by the tuple: a hit, an insert,
// a pin or an unpin is O(log slots). A pinned slot (in use by a running call) is out of the heap,
// so victims are found at its top (with the frequency policy a call's own new, rarely used
// neurons would otherwise crowd the top and be popped and pushed back for every insert).
// Deterministic: the same sequence of calls gives the same slots and victims.
#ifndef PIJ_CPU_BACKEND_NEURON_CACHE_H_
#define PIJ_CPU_BACKEND_NEURON_CACHE_H_

#include <cstdint>
#include <span>
#include <vector>

namespace pij {

enum class CachePolicy : int32_t { kLru = 0, kLfu = 1, kFrequency = 2 };

class NeuronCache {
 public:
  // num_keys: L * F; prior: [num_keys] (kFrequency; may be empty for the others).
  NeuronCache(int64_t num_keys, int64_t num_slots, CachePolicy policy, std::span<const float> prior);
  NeuronCache(const NeuronCache&) = delete;
  NeuronCache& operator=(const NeuronCache&) = delete;

  int64_t NumSlots() const { return static_cast<int64_t>(key_of_.size()); }
  // The slot holding `key`, or -1.
  int32_t Find(int64_t key) const { return slot_of_[key]; }
  int64_t KeyOf(int32_t slot) const { return key_of_[slot]; }
  // A hit on `slot` at time `tick` (ticks never decrease).
  void Touch(int32_t slot, uint64_t tick);
  // A slot for `key` (not cached): a free one, else the policy's victim among the unpinned
  // slots for which keep(slot) is false (the victim's key is forgotten and returned in
  // *evicted, else -1). The new slot is pinned once when `pin`. Returns -1 when every occupied
  // slot is pinned or kept.
  template <typename Keep>
  int32_t Insert(int64_t key, uint64_t tick, bool pin, const Keep& keep, int64_t* evicted);
  // Pins count: a pinned slot is never a victim.
  void Pin(int32_t slot);
  void Unpin(int32_t slot);
  bool Pinned(int32_t slot) const { return pins_[slot] > 0; }

 private:
  struct Rank {
    float primary;
    uint64_t tick;
  };
  Rank RankOf(int32_t slot) const;
  bool Less(int32_t a, int32_t b) const;
  void Place(int32_t slot, int64_t key, uint64_t tick);
  void Push(int32_t slot);
  int32_t PopTop();
  void RemoveAt(int64_t i);
  void SiftUp(int64_t i);
  void SiftDown(int64_t i);

  CachePolicy policy_;
  std::vector<float> prior_;
  std::vector<int32_t> slot_of_;  // [num_keys]
  std::vector<int64_t> key_of_;   // [slots], -1: free
  std::vector<uint64_t> last_use_, uses_;
  std::vector<int32_t> pins_;
  std::vector<int32_t> heap_, heap_pos_;  // heap of occupied slots; heap_pos_[slot] (-1: not in)
  std::vector<int32_t> free_;             // free slots, taken from the back
  std::vector<int32_t> kept_;             // scratch of Insert
};

template <typename Keep>
int32_t NeuronCache::Insert(int64_t key, uint64_t tick, bool pin, const Keep& keep,
                            int64_t* evicted) {
  *evicted = -1;
  int32_t slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    kept_.clear();
    while (!heap_.empty()) {
      const int32_t top = PopTop();
      if (!keep(top)) {
        slot = top;
        break;
      }
      kept_.push_back(top);
    }
    for (const int32_t s : kept_) Push(s);
    if (slot < 0) return -1;
    *evicted = key_of_[slot];
    slot_of_[key_of_[slot]] = -1;
  }
  Place(slot, key, tick);
  if (pin) Pin(slot);
  return slot;
}

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_NEURON_CACHE_H_
