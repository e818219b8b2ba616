#include "cpu_backend/neuron_cache.h"

#include <utility>

namespace pij {

NeuronCache::NeuronCache(int64_t num_keys, int64_t num_slots, CachePolicy policy,
                         std::span<const float> prior)
    : policy_(policy),
      prior_(prior.begin(), prior.end()),
      slot_of_(num_keys, -1),
      key_of_(num_slots, -1),
      last_use_(num_slots, 0),
      uses_(num_slots, 0),
      pins_(num_slots, 0),
      heap_pos_(num_slots, -1) {
  heap_.reserve(num_slots);
  free_.reserve(num_slots);
  // taken from the back: slot 0 first, so a fresh cache fills its arena in order
  for (int64_t s = num_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

NeuronCache::Rank NeuronCache::RankOf(int32_t slot) const {
  switch (policy_) {
    case CachePolicy::kLfu: return {static_cast<float>(uses_[slot]), last_use_[slot]};
    case CachePolicy::kFrequency:
      return {prior_.empty() ? 0.0f : prior_[key_of_[slot]], last_use_[slot]};
    case CachePolicy::kLru:
    default: return {0.0f, last_use_[slot]};
  }
}

bool NeuronCache::Less(int32_t a, int32_t b) const {
  const Rank ra = RankOf(a), rb = RankOf(b);
  if (ra.primary != rb.primary) return ra.primary < rb.primary;
  if (ra.tick != rb.tick) return ra.tick < rb.tick;
  return key_of_[a] < key_of_[b];  // a total order: victims never depend on heap history
}

void NeuronCache::SiftUp(int64_t i) {
  while (i > 0) {
    const int64_t parent = (i - 1) / 2;
    if (!Less(heap_[i], heap_[parent])) break;
    std::swap(heap_[i], heap_[parent]);
    heap_pos_[heap_[i]] = static_cast<int32_t>(i);
    heap_pos_[heap_[parent]] = static_cast<int32_t>(parent);
    i = parent;
  }
}

void NeuronCache::SiftDown(int64_t i) {
  const int64_t n = static_cast<int64_t>(heap_.size());
  for (;;) {
    int64_t smallest = i;
    for (const int64_t c : {2 * i + 1, 2 * i + 2}) {
      if (c < n && Less(heap_[c], heap_[smallest])) smallest = c;
    }
    if (smallest == i) return;
    std::swap(heap_[i], heap_[smallest]);
    heap_pos_[heap_[i]] = static_cast<int32_t>(i);
    heap_pos_[heap_[smallest]] = static_cast<int32_t>(smallest);
    i = smallest;
  }
}

void NeuronCache::Push(int32_t slot) {
  heap_.push_back(slot);
  heap_pos_[slot] = static_cast<int32_t>(heap_.size() - 1);
  SiftUp(static_cast<int64_t>(heap_.size()) - 1);
}

int32_t NeuronCache::PopTop() {
  const int32_t top = heap_.front();
  RemoveAt(0);
  return top;
}

void NeuronCache::RemoveAt(int64_t i) {
  const int32_t gone = heap_[i];
  heap_pos_[gone] = -1;
  const int32_t last = heap_.back();
  heap_.pop_back();
  if (i == static_cast<int64_t>(heap_.size())) return;  // it was the last entry
  heap_[i] = last;
  heap_pos_[last] = static_cast<int32_t>(i);
  SiftUp(i);
  SiftDown(heap_pos_[last]);
}

void NeuronCache::Pin(int32_t slot) {
  if (pins_[slot]++ == 0 && heap_pos_[slot] >= 0) RemoveAt(heap_pos_[slot]);
}

void NeuronCache::Unpin(int32_t slot) {
  if (--pins_[slot] == 0 && key_of_[slot] >= 0) Push(slot);
}

void NeuronCache::Place(int32_t slot, int64_t key, uint64_t tick) {
  key_of_[slot] = key;
  slot_of_[key] = slot;
  last_use_[slot] = tick;
  uses_[slot] = 1;
  if (pins_[slot] == 0) Push(slot);
}

void NeuronCache::Touch(int32_t slot, uint64_t tick) {
  last_use_[slot] = tick;
  ++uses_[slot];
  // every key only grows (last use, uses; the prior is fixed): the slot moves down
  if (heap_pos_[slot] >= 0) SiftDown(heap_pos_[slot]);
}

}  // namespace pij
