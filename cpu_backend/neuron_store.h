// A neuron store: one model's FFN neurons for models larger than memory, as PowerInfer-2 keeps
// them. Each neuron's gate, up and down rows are one contiguous *bundle* in a file (written once
// by powerinfer_jax/checkpoint/bundles.py, which also checks its header); in memory live
//   * the static part: the neurons the profile says fire most, loaded when the store opens and
//     never evicted (anonymous memory, not the file's page cache);
//   * the dynamic part: `cache_slots` slots for other neurons, filled from the file on demand
//     and evicted by a policy (neuron_cache.h).
// A call on a layer (`Acquire`) hands out every requested neuron's bundle: static or cached at
// once, the others read from the file now (coalesced into as few preadv calls as adjacent file
// positions allow, on the reader pool, bundle_reader.h) into slots it evicts. The caller computes
// the resident neurons while those reads are in flight and waits per neuron (`Wait`).
// Knows nothing of XLA or Python; the kernel over a store's layer is disk_ffn.h.
#ifndef PIJ_CPU_BACKEND_NEURON_STORE_H_
#define PIJ_CPU_BACKEND_NEURON_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cpu_backend/bundle_reader.h"
#include "cpu_backend/neuron_cache.h"
#include "cpu_backend/quant_formats.h"

namespace pij {

// Where a neuron's rows are in the file: bundle (layer l, file position p) starts at
// data_offset + (l * num_neurons + p) * slot_bytes, and holds its gate row (gated FFNs), its up
// row and its down row, each in its block format, then zero padding up to slot_bytes (a
// multiple of kDirectAlign, so that every bundle is one O_DIRECT read). The down row is either
//   * a neuron row along D (a PowerInfer GGUF's ffn_down_t row, or a re-blocked one), or
//   * with down_groups: its code row (quant_kernels.h: the quant bytes of its blocks in the
//     file's ffn_down without their scales), the scales being the down groups' scale planes,
//     [F / 32, scale bytes * D] per layer, at planes_offset + l * planes_stride in the file and
//     in memory while the store is open: the file's own blocks, summed with the in-memory
//     kernel's down-group arithmetic (the same bits, nothing re-quantized).
struct BundleLayout {
  int64_t num_layers = 0, num_neurons = 0, dim = 0;
  bool gated = true;
  QType gate_type = QType::kQ4_0, up_type = QType::kQ4_0, down_type = QType::kQ4_0;
  int64_t slot_bytes = 0;
  int64_t data_offset = 0;
  bool down_groups = false;
  int64_t planes_offset = 0, planes_stride = 0;

  int64_t GateBytes() const { return gated ? QRowBytes(gate_type, dim) : 0; }
  int64_t UpBytes() const { return QRowBytes(up_type, dim); }
  int64_t DownBytes() const {
    return down_groups ? dim / 32 * (GetQTypeInfo(down_type).bytes - DownGroupScaleBytes(down_type))
                       : QRowBytes(down_type, dim);
  }
  // One layer's scale planes (down_groups).
  int64_t PlaneBytes() const { return num_neurons / 32 * DownGroupScaleBytes(down_type) * dim; }
  int64_t BundleBytes() const { return GateBytes() + UpBytes() + DownBytes(); }
  int64_t FileBytes() const { return data_offset + num_layers * num_neurons * slot_bytes; }
  const uint8_t* Gate(const uint8_t* bundle) const { return bundle; }
  const uint8_t* Up(const uint8_t* bundle) const { return bundle + GateBytes(); }
  const uint8_t* Down(const uint8_t* bundle) const { return bundle + GateBytes() + UpBytes(); }
};

// "" if the layout is usable, else what is wrong ("<field>: expected <rule>, got <value>").
std::string CheckLayout(const BundleLayout& layout);

struct NeuronStoreOptions {
  std::string path;
  BundleLayout layout;
  std::vector<int32_t> position;  // [L * F]: file position of neuron (l, i) within layer l
  std::vector<uint8_t> hot;       // [L * F]: 1 = in the static part
  std::vector<float> prior;       // [L * F] activation frequencies (kFrequency), or empty
  std::vector<float> b_up;        // [L * F] up biases, or empty
  int64_t cache_slots = 0;        // the dynamic part; at least one layer's non-static neurons
  CachePolicy policy = CachePolicy::kLru;
  int readers = 16;               // reader threads (reads in flight)
  int64_t max_gap = 0;            // unrequested bundles one read may span between two requested
  int64_t max_read_bytes = 1 << 20;
  bool direct = true;             // O_DIRECT
};

struct NeuronStoreStats {
  int64_t calls = 0;          // Acquire calls (one per layer and FFN call)
  int64_t requested = 0;      // neurons asked for
  int64_t static_hits = 0, cache_hits = 0, misses = 0;
  int64_t prefetch_hits = 0;  // cache hits on neurons a prefetch read (counted in cache_hits)
  int64_t prefetched = 0;     // neurons read by Prefetch
  int64_t evictions = 0;
  int64_t read_jobs = 0, read_syscalls = 0, bytes_read = 0, gap_bytes = 0, read_failures = 0;
  int64_t read_busy_ns = 0;   // summed over reader threads
  int64_t wait_ns = 0;        // compute threads waiting for reads (disk_ffn.cc reports it)
  int64_t static_neurons = 0, cache_slots = 0, resident_bytes = 0;
  bool direct = false;
  // The same for calls on one token (decode at batch 1): per-token figures without prefill's.
  // demand_bytes: bytes its reads were asked for (gaps included), as the call issues them;
  // prefetch_bytes: the reads ahead it started for the next layer; prefetch_hits: its cache hits
  // on neurons a prefetch read (a hit that cost a read, ahead of time).
  struct Calls {
    int64_t calls = 0, requested = 0, static_hits = 0, cache_hits = 0, misses = 0;
    int64_t demand_bytes = 0, prefetch_bytes = 0, prefetch_hits = 0;
  } one_token;
};

// The bundles one call uses: a pointer per requested neuron (in the order asked), and the flag to
// wait on where its read may still be running (nullptr: in memory). Slots stay pinned (never
// evicted) until Release.
struct NeuronLease {
  std::vector<const uint8_t*> bundle;
  std::vector<const std::atomic<uint32_t>*> pending;
  std::vector<int32_t> pinned;
};

class NeuronStore {
 public:
  // Opens the file, checks the options against the layout and the file's size, allocates the
  // static and dynamic parts and reads the static neurons. nullptr with *error set on failure.
  static std::unique_ptr<NeuronStore> Open(NeuronStoreOptions options, std::string* error);
  ~NeuronStore();
  NeuronStore(const NeuronStore&) = delete;
  NeuronStore& operator=(const NeuronStore&) = delete;

  const BundleLayout& layout() const { return o_.layout; }
  const float* BUp(int64_t layer) const {
    return o_.b_up.empty() ? nullptr : o_.b_up.data() + layer * o_.layout.num_neurons;
  }
  // The layer's down groups' scale planes, group g at + g * scale bytes * D (down_groups).
  const uint8_t* Planes(int64_t layer) const;
  // ids: distinct neuron ids of `layer`, ascending. Returns false (and *error) when no slot
  // can take a missing neuron (cannot happen with the minimum cache_slots Open enforces).
  // tokens: the call's token rows (statistics of one-token calls are kept apart).
  bool Acquire(int64_t layer, std::span<const int32_t> ids, int64_t tokens, NeuronLease& lease,
               std::string* error);
  void Release(NeuronLease& lease);
  // Starts reading the ids' bundles not yet in memory (behind every demand read), into slots
  // nobody holds; the next Acquire of them waits for the reads if they are still running.
  // tokens: the rows of the call it reads ahead for (1: its bytes count as a decode token's).
  void Prefetch(int64_t layer, std::span<const int32_t> ids, int64_t tokens = 0);
  // Waits until a pending bundle is in memory; false if its read failed (ReadError says why).
  static bool Wait(const std::atomic<uint32_t>* pending);
  void AddWaitNs(int64_t ns) { wait_ns_.fetch_add(ns, std::memory_order_relaxed); }
  std::string ReadError() const { return reader_->LastError(); }
  NeuronStoreStats Stats() const;
  void ResetStats();
  // Record every Acquire's keys (layer * F + id) from now on (the eviction policies'
  // experiment replays them through NeuronCache); Take hands them out (and keeps recording).
  void Trace(bool on);
  void TakeTrace(std::vector<int64_t>& keys, std::vector<int64_t>& ends);

 private:
  struct Arena;
  NeuronStore() = default;
  // Read jobs for (position, destination, flag) triples sorted by position; gaps of up to
  // max_gap bundles go to a scratch buffer.
  void MakeJobs(int64_t layer, std::vector<std::tuple<int32_t, uint8_t*, std::atomic<uint32_t>*>>& want,
                int64_t max_gap, std::vector<ReadJob>& jobs);
  // A dynamic slot for `key` (evicting); a demand call waits for prefetch reads if it must.
  int32_t SlotFor(int64_t key, bool demand);
  bool Loading(int32_t slot) const;  // a read into the slot is running

  NeuronStoreOptions o_;
  std::unique_ptr<BundleReader> reader_;
  std::unique_ptr<NeuronCache> cache_;
  std::unique_ptr<Arena> static_, dynamic_, gap_, planes_;
  std::vector<int32_t> static_slot_;                   // [L * F]: -1 or a static slot
  std::unique_ptr<std::atomic<uint32_t>[]> state_;     // [cache_slots]
  std::vector<uint8_t> by_prefetch_;                   // [cache_slots]: read by Prefetch, unused
  uint64_t tick_ = 0;
  mutable std::mutex mutex_;
  NeuronStoreStats stats_;  // under mutex_ (reader and wait figures added in Stats())
  std::atomic<int64_t> wait_ns_{0};
  std::vector<std::tuple<int32_t, uint8_t*, std::atomic<uint32_t>*>> want_;  // Acquire scratch
  std::vector<ReadJob> jobs_;
  ReaderStats reader_base_;  // the reader's figures at the last ResetStats
  bool tracing_ = false;     // under mutex_, as the trace
  std::vector<int64_t> trace_keys_, trace_ends_;
};

// Handle -> store, as cold_store.h keeps cold rows: handles are never reused within a process.
class NeuronStoreRegistry {
 public:
  int64_t Add(std::shared_ptr<NeuronStore> store);
  std::shared_ptr<NeuronStore> Get(int64_t handle) const;  // nullptr if unknown
  bool Remove(int64_t handle);

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<NeuronStore>> stores_;
  int64_t next_ = 1;
};

NeuronStoreRegistry& NeuronStores();  // the process's registry

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_NEURON_STORE_H_
