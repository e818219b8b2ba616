// nanobind functions of powerinfer_jax._pij_ext for expert stores (cpu_backend/expert_store.h):
// open one over an expert file (powerinfer_jax/checkpoint/expert_file.py writes and checks the
// file; runtime/expert_offload.py decides what is resident), release it, read its statistics,
// and replay a routing trace through the cache alone (the eviction policies' experiment). Bad
// input raises ValueError (std::invalid_argument) naming the value and the rule.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_backend/expert_store.h"
#include "cpu_backend/neuron_cache.h"

namespace nb = nanobind;

namespace {

template <typename T>
using Vec1 = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

pij::CachePolicy ExpertPolicyNamed(const std::string& name) {
  if (name == "lru") return pij::CachePolicy::kLru;
  if (name == "lfu") return pij::CachePolicy::kLfu;
  if (name == "frequency") return pij::CachePolicy::kFrequency;
  if (name == "score") return pij::CachePolicy::kScore;
  throw std::invalid_argument("expert cache policy: expected one of lru, lfu, frequency, score, "
                              "got " + name);
}

template <typename T>
std::vector<T> CopyOf(const nb::object& o) {
  if (o.is_none()) return {};
  const auto a = nb::cast<Vec1<T>>(o);
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

std::shared_ptr<pij::ExpertStore> ExpertStoreOf(int64_t handle) {
  std::shared_ptr<pij::ExpertStore> s = pij::ExpertStores().Get(handle);
  if (s == nullptr) {
    throw std::invalid_argument("expert store handle: expected an open store, got " +
                                std::to_string(handle));
  }
  return s;
}

nb::dict ExpertStatsDict(const pij::ExpertStoreStats& s) {
  nb::dict d;
  d["calls"] = s.calls;
  d["requested"] = s.requested;
  d["pinned_hits"] = s.pinned_hits;
  d["cache_hits"] = s.cache_hits;
  d["misses"] = s.misses;
  d["prefetch_hits"] = s.prefetch_hits;
  d["prefetched"] = s.prefetched;
  d["evictions"] = s.evictions;
  d["read_jobs"] = s.read_jobs;
  d["read_syscalls"] = s.read_syscalls;
  d["bytes_read"] = s.bytes_read;
  d["read_failures"] = s.read_failures;
  d["read_busy_ns"] = s.read_busy_ns;
  d["wait_ns"] = s.wait_ns;
  d["pinned_experts"] = s.pinned_experts;
  d["cache_slots"] = s.cache_slots;
  d["resident_bytes"] = s.resident_bytes;
  d["direct"] = s.direct;
  nb::dict one;
  const auto& o = s.one_token;
  one["calls"] = o.calls;
  one["requested"] = o.requested;
  one["pinned_hits"] = o.pinned_hits;
  one["cache_hits"] = o.cache_hits;
  one["misses"] = o.misses;
  one["demand_bytes"] = o.demand_bytes;
  one["prefetch_bytes"] = o.prefetch_bytes;
  one["prefetch_hits"] = o.prefetch_hits;
  one["predicted"] = o.predicted;
  one["predicted_hits"] = o.predicted_hits;
  one["guessed_routed"] = o.guessed_routed;
  d["one_token"] = one;
  return d;
}

}  // namespace

void RegisterExpertStore(nb::module_& m) {
  m.def(
      "expert_store_open",
      [](const std::string& path, int64_t num_layers, int64_t num_experts, int64_t slot_bytes,
         int64_t data_offset, int64_t gate_offset, int64_t up_offset, int64_t down_offset,
         Vec1<uint8_t> pinned, nb::object prior, int64_t cache_slots, const std::string& policy,
         float score_tau, int readers, int64_t read_bytes, bool direct) {
        pij::ExpertStoreOptions o;
        o.path = path;
        o.layout = {num_layers, num_experts, slot_bytes, data_offset, gate_offset, up_offset,
                    down_offset};
        o.pinned.assign(pinned.data(), pinned.data() + pinned.shape(0));
        o.prior = CopyOf<float>(prior);
        o.cache_slots = cache_slots;
        o.policy = ExpertPolicyNamed(policy);
        o.score_tau = score_tau;
        o.readers = readers;
        o.read_bytes = read_bytes;
        o.direct = direct;
        std::string error;
        std::unique_ptr<pij::ExpertStore> store;
        {
          nb::gil_scoped_release release;  // reads the pinned experts: seconds for a large model
          store = pij::ExpertStore::Open(std::move(o), &error);
        }
        if (store == nullptr) throw std::invalid_argument(error);
        return pij::ExpertStores().Add(std::shared_ptr<pij::ExpertStore>(std::move(store)));
      },
      nb::arg("path"), nb::arg("num_layers"), nb::arg("num_experts"), nb::arg("slot_bytes"),
      nb::arg("data_offset"), nb::arg("gate_offset"), nb::arg("up_offset"),
      nb::arg("down_offset"), nb::arg("pinned"), nb::arg("prior").none(),
      nb::arg("cache_slots"), nb::arg("policy"), nb::arg("score_tau"), nb::arg("readers"),
      nb::arg("read_bytes"), nb::arg("direct"),
      "Open an expert store over an expert file (cpu_backend/expert_store.h); reads its pinned "
      "experts; returns the handle expert_ffn's `store` attribute takes.");
  m.def("expert_store_release", [](int64_t handle) { return pij::ExpertStores().Remove(handle); },
        nb::arg("handle"),
        "Close a store (its memory goes once no running call holds it); False if unknown.");
  m.def("expert_store_stats",
        [](int64_t handle) { return ExpertStatsDict(ExpertStoreOf(handle)->Stats()); },
        nb::arg("handle"), "Counters since the store opened or the last reset.");
  m.def("expert_store_reset_stats", [](int64_t handle) { ExpertStoreOf(handle)->ResetStats(); },
        nb::arg("handle"));
  m.def(
      "expert_cache_simulate",
      [](int64_t num_layers, int64_t num_experts, int64_t slots, const std::string& policy,
         Vec1<uint8_t> pinned, nb::object prior, nb::object probs, float score_tau,
         Vec1<int64_t> keys, Vec1<int64_t> ends) {
        const int64_t num_keys = num_layers * num_experts;
        std::vector<float> p = CopyOf<float>(prior);
        std::vector<float> pr = CopyOf<float>(probs);
        const int64_t calls = static_cast<int64_t>(ends.shape(0));
        if (num_keys < 1 || slots < 0 || static_cast<int64_t>(pinned.shape(0)) != num_keys ||
            (!p.empty() && static_cast<int64_t>(p.size()) != num_keys) ||
            (!pr.empty() && static_cast<int64_t>(pr.size()) != calls * num_experts) ||
            !(score_tau > 0.0f)) {
          throw std::invalid_argument(
              "expert_cache_simulate: expected layers, experts >= 1, slots >= 0, pinned and a "
              "prior (or None) of layers x experts values, probs of calls x experts (or None), "
              "score_tau > 0");
        }
        const pij::CachePolicy pol = ExpertPolicyNamed(policy);
        if (pol == pij::CachePolicy::kFrequency && p.empty()) {
          throw std::invalid_argument("expert_cache_simulate: the frequency policy needs a prior");
        }
        int64_t hits = 0, pinned_hits = 0, misses = 0, evictions = 0, uncached = 0;
        {
          nb::gil_scoped_release release;
          pij::NeuronCache cache(num_keys, slots, pol, p);
          std::vector<int32_t> held;
          int64_t begin = 0;
          uint64_t tick = 0;
          for (int64_t c = 0; c < calls; ++c) {
            ++tick;
            const int64_t end = std::min<int64_t>(ends.data()[c], keys.shape(0));
            if (pol == pij::CachePolicy::kScore && !pr.empty() && begin < end) {
              // a call's keys are one layer's: credit that layer's experts
              const int64_t layer = keys.data()[begin] / num_experts;
              const float now = static_cast<float>(static_cast<double>(tick) / num_layers /
                                                   score_tau);
              for (int64_t e = 0; e < num_experts; ++e) {
                const float v = pr[c * num_experts + e];
                if (v > 0.0f) cache.Credit(layer * num_experts + e, std::log(v) + now);
              }
            }
            for (int64_t i = begin; i < end; ++i) {
              const int64_t key = keys.data()[i];
              if (key < 0 || key >= num_keys) continue;
              if (pinned.data()[key]) {
                ++pinned_hits;
                continue;
              }
              int32_t s = cache.Find(key);
              if (s >= 0) {
                ++hits;
                if (cache.Pinned(s)) continue;
                cache.Touch(s, tick);
                cache.Pin(s);
              } else {
                int64_t evicted;
                s = cache.Insert(key, tick, /*pin=*/true, [](int32_t) { return false; },
                                 &evicted);
                ++misses;
                evictions += evicted >= 0;
                uncached += s < 0;
                if (s < 0) continue;
              }
              held.push_back(s);
            }
            for (const int32_t s : held) cache.Unpin(s);
            held.clear();
            begin = std::max(begin, end);
          }
        }
        nb::dict d;
        d["hits"] = hits;
        d["pinned_hits"] = pinned_hits;
        d["misses"] = misses;
        d["evictions"] = evictions;
        d["uncached"] = uncached;
        return d;
      },
      nb::arg("num_layers"), nb::arg("num_experts"), nb::arg("slots"), nb::arg("policy"),
      nb::arg("pinned"), nb::arg("prior").none(), nb::arg("probs").none(), nb::arg("score_tau"),
      nb::arg("keys"), nb::arg("ends"),
      "Replay calls (keys layer * E + e, keys[ends[c-1]:ends[c]] per call, one layer each; "
      "probs [calls, E]: each call's router probabilities) through a cache of `slots` beside "
      "the pinned keys; {hits, pinned_hits, misses, evictions, uncached}.");
}
