// nanobind functions of powerinfer_jax._pij_ext for neuron stores (cpu_backend/neuron_store.h):
// open one over a bundle file (powerinfer_jax/checkpoint/bundles.py writes and checks the file;
// runtime/offload.py decides what is resident), release it, read its statistics, and replay a
// trace of active sets through the cache alone (the eviction policies' experiment). Bad input
// raises ValueError (std::invalid_argument) naming the value and the rule; nothing aborts.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_backend/neuron_cache.h"
#include "cpu_backend/neuron_store.h"
#include "cpu_backend/quant_formats.h"

namespace nb = nanobind;

namespace {

template <typename T>
using Vec1 = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

pij::CachePolicy PolicyNamed(const std::string& name) {
  if (name == "lru") return pij::CachePolicy::kLru;
  if (name == "lfu") return pij::CachePolicy::kLfu;
  if (name == "frequency") return pij::CachePolicy::kFrequency;
  throw std::invalid_argument("neuron store policy: expected one of lru, lfu, frequency, got " +
                              name);
}

pij::QType TypeId(const char* what, int32_t id) {
  if (!pij::IsQType(id)) {
    throw std::invalid_argument(std::string("neuron store ") + what +
                                ": expected a GGML block type id (Q4_0=2, Q4_1=3, Q5_0=6, "
                                "Q5_1=7, Q8_0=8, Q2_K..Q6_K=10..14), got " + std::to_string(id));
  }
  return static_cast<pij::QType>(id);
}

template <typename T>
std::vector<T> Copy(const Vec1<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

template <typename T>
std::vector<T> CopyOptional(const nb::object& o) {
  if (o.is_none()) return {};
  return Copy(nb::cast<Vec1<T>>(o));
}

std::shared_ptr<pij::NeuronStore> StoreOf(int64_t handle) {
  std::shared_ptr<pij::NeuronStore> s = pij::NeuronStores().Get(handle);
  if (s == nullptr) {
    throw std::invalid_argument("neuron store handle: expected an open store, got " +
                                std::to_string(handle));
  }
  return s;
}

nb::dict StatsDict(const pij::NeuronStoreStats& s) {
  nb::dict d;
  d["calls"] = s.calls;
  d["requested"] = s.requested;
  d["static_hits"] = s.static_hits;
  d["cache_hits"] = s.cache_hits;
  d["misses"] = s.misses;
  d["prefetch_hits"] = s.prefetch_hits;
  d["prefetched"] = s.prefetched;
  d["evictions"] = s.evictions;
  d["read_jobs"] = s.read_jobs;
  d["read_syscalls"] = s.read_syscalls;
  d["bytes_read"] = s.bytes_read;
  d["gap_bytes"] = s.gap_bytes;
  d["read_failures"] = s.read_failures;
  d["read_busy_ns"] = s.read_busy_ns;
  d["wait_ns"] = s.wait_ns;
  d["static_neurons"] = s.static_neurons;
  d["cache_slots"] = s.cache_slots;
  d["resident_bytes"] = s.resident_bytes;
  d["direct"] = s.direct;
  nb::dict one;
  one["calls"] = s.one_token.calls;
  one["requested"] = s.one_token.requested;
  one["static_hits"] = s.one_token.static_hits;
  one["cache_hits"] = s.one_token.cache_hits;
  one["misses"] = s.one_token.misses;
  one["demand_bytes"] = s.one_token.demand_bytes;
  one["prefetch_bytes"] = s.one_token.prefetch_bytes;
  one["prefetch_hits"] = s.one_token.prefetch_hits;
  d["one_token"] = one;
  return d;
}

}  // namespace

void RegisterNeuronStore(nb::module_& m) {
  m.def(
      "neuron_store_open",
      [](const std::string& path, int64_t num_layers, int64_t num_neurons, int64_t dim, bool gated,
         int32_t gate_type, int32_t up_type, int32_t down_type, int64_t slot_bytes,
         int64_t data_offset, bool down_groups, int64_t planes_offset, int64_t planes_stride,
         Vec1<int32_t> position, Vec1<uint8_t> hot, nb::object prior,
         nb::object b_up, int64_t cache_slots, const std::string& policy, int readers,
         int64_t max_gap, int64_t max_read_bytes, bool direct) {
        pij::NeuronStoreOptions o;
        o.path = path;
        o.layout.num_layers = num_layers;
        o.layout.num_neurons = num_neurons;
        o.layout.dim = dim;
        o.layout.gated = gated;
        o.layout.gate_type = gated ? TypeId("gate_type", gate_type) : pij::QType::kQ8_0;
        o.layout.up_type = TypeId("up_type", up_type);
        o.layout.down_type = TypeId("down_type", down_type);
        o.layout.slot_bytes = slot_bytes;
        o.layout.data_offset = data_offset;
        o.layout.down_groups = down_groups;
        o.layout.planes_offset = planes_offset;
        o.layout.planes_stride = planes_stride;
        o.position = Copy(position);
        o.hot = Copy(hot);
        o.prior = CopyOptional<float>(prior);
        o.b_up = CopyOptional<float>(b_up);
        o.cache_slots = cache_slots;
        o.policy = PolicyNamed(policy);
        o.readers = readers;
        o.max_gap = max_gap;
        o.max_read_bytes = max_read_bytes;
        o.direct = direct;
        std::string error;
        std::unique_ptr<pij::NeuronStore> store;
        {
          nb::gil_scoped_release release;  // reads the static neurons: seconds for a 7B model
          store = pij::NeuronStore::Open(std::move(o), &error);
        }
        if (store == nullptr) throw std::invalid_argument(error);
        return pij::NeuronStores().Add(std::shared_ptr<pij::NeuronStore>(std::move(store)));
      },
      nb::arg("path"), nb::arg("num_layers"), nb::arg("num_neurons"), nb::arg("dim"),
      nb::arg("gated"), nb::arg("gate_type"), nb::arg("up_type"), nb::arg("down_type"),
      nb::arg("slot_bytes"), nb::arg("data_offset"), nb::arg("down_groups"),
      nb::arg("planes_offset"), nb::arg("planes_stride"), nb::arg("position"), nb::arg("hot"),
      nb::arg("prior").none(), nb::arg("b_up").none(), nb::arg("cache_slots"), nb::arg("policy"),
      nb::arg("readers"), nb::arg("max_gap"), nb::arg("max_read_bytes"), nb::arg("direct"),
      "Open a neuron store over a bundle file (cpu_backend/neuron_store.h); reads its static "
      "neurons; returns the handle disk_ffn's `store` attribute takes.");
  m.def("neuron_store_release", [](int64_t handle) { return pij::NeuronStores().Remove(handle); },
        nb::arg("handle"),
        "Close a store (its memory goes once no running call holds it); False if unknown.");
  m.def("neuron_store_stats", [](int64_t handle) { return StatsDict(StoreOf(handle)->Stats()); },
        nb::arg("handle"), "Counters since the store opened or the last reset.");
  m.def("neuron_store_reset_stats", [](int64_t handle) { StoreOf(handle)->ResetStats(); },
        nb::arg("handle"));
  m.def("neuron_store_trace", [](int64_t handle, bool on) { StoreOf(handle)->Trace(on); },
        nb::arg("handle"), nb::arg("on"),
        "Record (or stop recording) every call's keys (layer * F + id).");
  m.def(
      "neuron_store_take_trace",
      [](int64_t handle) {
        auto* keys = new std::vector<int64_t>();
        auto* ends = new std::vector<int64_t>();
        StoreOf(handle)->TakeTrace(*keys, *ends);
        nb::capsule own_keys(keys, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
        nb::capsule own_ends(ends, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
        using Out = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;
        return nb::make_tuple(Out(keys->data(), {keys->size()}, own_keys),
                              Out(ends->data(), {ends->size()}, own_ends));
      },
      nb::arg("handle"),
      "(keys, ends): the recorded calls, call c = keys[ends[c - 1]:ends[c]]; clears the record.");
  m.def(
      "neuron_store_prefetch",
      [](int64_t handle, int64_t layer, Vec1<int32_t> ids) {
        std::shared_ptr<pij::NeuronStore> s = StoreOf(handle);
        const pij::BundleLayout& l = s->layout();
        std::vector<int32_t> v = Copy(ids);
        for (const int32_t id : v) {
          if (layer < 0 || layer >= l.num_layers || id < 0 || id >= l.num_neurons) {
            throw std::invalid_argument("neuron_store_prefetch: expected a layer in [0, " +
                                        std::to_string(l.num_layers) + ") and ids in [0, " +
                                        std::to_string(l.num_neurons) + "), got layer " +
                                        std::to_string(layer) + ", id " + std::to_string(id));
          }
        }
        nb::gil_scoped_release release;
        s->Prefetch(layer, v);
      },
      nb::arg("handle"), nb::arg("layer"), nb::arg("ids"),
      "Start reading these neurons' bundles into the cache (behind demand reads).");
  m.def(
      "neuron_cache_simulate",
      [](int64_t num_keys, int64_t slots, const std::string& policy, nb::object prior,
         Vec1<int64_t> keys, Vec1<int64_t> ends) {
        std::vector<float> p = CopyOptional<float>(prior);
        if (slots < 0 || num_keys < 1 || (!p.empty() && static_cast<int64_t>(p.size()) != num_keys)) {
          throw std::invalid_argument("neuron_cache_simulate: expected num_keys >= 1, slots >= 0 "
                                      "and a prior of num_keys values or None");
        }
        const pij::CachePolicy pol = PolicyNamed(policy);
        int64_t hits = 0, misses = 0, evictions = 0, uncached = 0;
        {
          nb::gil_scoped_release release;
          pij::NeuronCache cache(num_keys, slots, pol, p);
          std::vector<int32_t> pinned;  // a call's slots, pinned until it ends (as the store's)
          int64_t begin = 0;
          uint64_t tick = 0;
          for (size_t c = 0; c < ends.shape(0); ++c) {
            ++tick;
            const int64_t end = std::min<int64_t>(ends.data()[c], keys.shape(0));
            for (int64_t k = begin; k < end; ++k) {
              const int64_t key = keys.data()[k];
              if (key < 0 || key >= num_keys) continue;
              int32_t s = cache.Find(key);
              if (s >= 0) {
                ++hits;
                if (cache.Pinned(s)) continue;  // the same key twice in one call
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
              pinned.push_back(s);
            }
            for (const int32_t s : pinned) cache.Unpin(s);
            pinned.clear();
            begin = std::max(begin, end);
          }
        }
        nb::dict d;
        d["hits"] = hits;
        d["misses"] = misses;
        d["evictions"] = evictions;
        d["uncached"] = uncached;
        return d;
      },
      nb::arg("num_keys"), nb::arg("slots"), nb::arg("policy"), nb::arg("prior").none(),
      nb::arg("keys"), nb::arg("ends"),
      "Replay calls (keys[ends[c-1]:ends[c]] per call) through a cache of `slots` with `policy`; "
      "{hits, misses, evictions, uncached}.");
}
