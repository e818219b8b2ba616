#include "cpu_backend/neuron_cache.h"

#include <algorithm>
#include <functional>

namespace pij {

NeuronCache::NeuronCache(int64_t num_keys, int64_t num_slots, CachePolicy policy,
                         std::span<const float> prior)
    : policy_(policy),
      prior_(prior.begin(), prior.end()),
      score_(policy == CachePolicy::kScore ? num_keys : 0, -kInf),
      slot_of_(num_keys, -1),
      key_of_(num_slots, -1),
      last_use_(num_slots, 0),
      uses_(num_slots, 0),
      pins_(num_slots, 0),
      in_heap_(num_slots, kOut) {
  heap_.reserve(num_slots);
  free_.reserve(num_slots);
  // taken from the back: slot 0 first, so a fresh cache fills its arena in order
  for (int64_t s = num_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

NeuronCache::Entry NeuronCache::Current(int32_t slot) const {
  float primary = 0.0f;
  switch (policy_) {
    case CachePolicy::kLfu: primary = static_cast<float>(uses_[slot]); break;
    case CachePolicy::kFrequency: primary = prior_.empty() ? 0.0f : prior_[key_of_[slot]]; break;
    case CachePolicy::kScore: primary = score_[key_of_[slot]]; break;
    case CachePolicy::kLru:
    default: break;
  }
  return {primary, slot, last_use_[slot], key_of_[slot]};
}

// std::push_heap / pop_heap build a max-heap under their comparator: "greater" keeps the least
// rank on top.
void NeuronCache::Push(int32_t slot) {
  heap_.push_back(Current(slot));
  std::push_heap(heap_.begin(), heap_.end(),
                 [](const Entry& a, const Entry& b) { return Less(b, a); });
  in_heap_[slot] = kIn;
}

NeuronCache::Entry NeuronCache::PopTop() {
  std::pop_heap(heap_.begin(), heap_.end(),
                [](const Entry& a, const Entry& b) { return Less(b, a); });
  const Entry top = heap_.back();
  heap_.pop_back();
  return top;
}

}  // namespace pij
