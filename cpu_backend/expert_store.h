// An expert store: one mixture-of-experts model's routed experts for models larger than memory.
// Each expert's three matrices (gate, up, down, in the in-memory kernel's layouts) are one
// contiguous extent of an expert file (written once by powerinfer_jax/checkpoint/
// expert_file.py, which also checks its header); in memory live
//   * the pinned experts: the ones the profile says are routed most, over all layers at once,
//     read when the store opens and never evicted (anonymous memory, not the page cache);
//   * the cache: `cache_slots` slots for other experts, filled from the file on demand and
//     evicted by a policy (neuron_cache.h: LRU, LFU, the profile's frequency, or the router's
//     decayed scores).
// A call on a layer (`Acquire`) hands out every requested expert: pinned or cached at once, the
// others read from the file now (O_DIRECT, each expert in reads of at most `read_bytes`, many in
// flight, on the reader pool: bundle_reader.h) into slots it evicts. The caller computes the
// resident experts while those reads run and waits per expert (moe_ffn.h's sources).
// `Prefetch` reads ahead (the next layer's likely experts) behind every demand read.
// Knows nothing of XLA or Python; the kernel over a store's layer is xla_ffi/expert_ffn_cpu.cc.
#ifndef PIJ_CPU_BACKEND_EXPERT_STORE_H_
#define PIJ_CPU_BACKEND_EXPERT_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cpu_backend/arena.h"
#include "cpu_backend/bundle_reader.h"
#include "cpu_backend/neuron_cache.h"

namespace pij {

// Expert (l, e) is at data_offset + (l * num_experts + e) * slot_bytes in the file: its gate
// matrix at + gate_offset, up at + up_offset, down at + down_offset (the matrices' formats are
// the kernel's business: the store moves bytes), zero padded to slot_bytes (a multiple of
// kDirectAlign: one O_DIRECT extent).
struct ExpertLayout {
  int64_t num_layers = 0, num_experts = 0;
  int64_t slot_bytes = 0, data_offset = 0;
  int64_t gate_offset = 0, up_offset = 0, down_offset = 0;
  int64_t FileBytes() const { return data_offset + num_layers * num_experts * slot_bytes; }
};

// "" if usable, else "<field>: expected <rule>, got <value>".
std::string CheckExpertLayout(const ExpertLayout& layout);

struct ExpertStoreOptions {
  std::string path;
  ExpertLayout layout;
  std::vector<uint8_t> pinned;  // [L * E]: 1 = read at open, never evicted
  std::vector<float> prior;     // [L * E] routing frequencies (kFrequency), or empty
  int64_t cache_slots = 0;      // at least one layer's unpinned experts (a call may need them all)
  CachePolicy policy = CachePolicy::kLru;
  float score_tau = 16.0f;      // kScore's decay, in tokens
  int readers = 16;
  int64_t read_bytes = 1 << 20;  // an expert is read in pieces of at most this (many in flight)
  bool direct = true;            // O_DIRECT
};

struct ExpertStoreStats {
  int64_t calls = 0, requested = 0;  // Acquire calls; experts asked for
  int64_t pinned_hits = 0, cache_hits = 0, misses = 0;
  int64_t prefetch_hits = 0;  // cache hits on an expert a prefetch read (in cache_hits)
  int64_t prefetched = 0;     // experts read by Prefetch
  int64_t evictions = 0;
  int64_t read_jobs = 0, read_syscalls = 0, bytes_read = 0, read_failures = 0;
  int64_t read_busy_ns = 0, wait_ns = 0;
  int64_t pinned_experts = 0, cache_slots = 0, resident_bytes = 0;
  bool direct = false;
  // Calls on one token (decode at batch 1), apart from prefill's: demand_bytes / prefetch_bytes
  // the bytes their reads asked for; predicted / predicted_hits: the read-ahead's guesses for
  // the next layer, and the next layer's routed experts that were among them (recall =
  // predicted_hits / routed of the calls that had a guess: `guessed_routed`).
  struct Calls {
    int64_t calls = 0, requested = 0, pinned_hits = 0, cache_hits = 0, misses = 0;
    int64_t demand_bytes = 0, prefetch_bytes = 0, prefetch_hits = 0;
    int64_t predicted = 0, predicted_hits = 0, guessed_routed = 0;
  } one_token;
};

// The experts one call uses: per requested expert (in the order asked) its bytes and the read
// flags to wait on (flag_begin[i]..flag_begin[i + 1] into flags; none: in memory). Cache slots
// stay pinned (never evicted) until Release.
struct ExpertLease {
  std::vector<const uint8_t*> base;
  std::vector<const std::atomic<uint32_t>*> flags;
  std::vector<int32_t> flag_begin;
  std::vector<int32_t> pinned;
};

class ExpertStore {
 public:
  // Opens the file, checks the options against the layout and the file's size, allocates the
  // pinned experts and the cache and reads the pinned experts. nullptr with *error on failure.
  static std::unique_ptr<ExpertStore> Open(ExpertStoreOptions options, std::string* error);
  ~ExpertStore();
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  const ExpertLayout& layout() const { return o_.layout; }
  CachePolicy policy() const { return o_.policy; }
  // kScore: credits each of `layer`'s experts with the router's probabilities, probs[t][e] for
  // each of the call's token rows (at the store's time, a token per num_layers calls).
  void Credit(int64_t layer, std::span<const float* const> probs);
  // experts: distinct expert ids of `layer`. tokens: the call's token rows (one-token calls'
  // statistics are kept apart). Returns false (and *error) when no slot can take a missing
  // expert (cannot happen with the cache_slots Open enforces).
  bool Acquire(int64_t layer, std::span<const int32_t> experts, int64_t tokens,
               ExpertLease& lease, std::string* error);
  void Release(ExpertLease& lease);
  // Starts reading the experts not in memory (behind every demand read) into slots nobody
  // holds. tokens == 1: its bytes count as a decode token's, and the set is the guess the next
  // Acquire of `layer` is scored against (recall).
  void Prefetch(int64_t layer, std::span<const int32_t> experts, int64_t tokens);
  // Waits for every flag; false if a read failed (ReadError says why).
  static bool WaitAll(std::span<const std::atomic<uint32_t>* const> flags);
  void AddWaitNs(int64_t ns) { wait_ns_.fetch_add(ns, std::memory_order_relaxed); }
  std::string ReadError() const { return reader_->LastError(); }
  ExpertStoreStats Stats() const;
  void ResetStats();

 private:
  ExpertStore() = default;
  int64_t Pieces() const { return pieces_; }
  // Queues the reads of `slot` from expert `key` (its flags set to loading).
  void ReadInto(int64_t key, int32_t slot, std::vector<ReadJob>& jobs);
  int32_t SlotFor(int64_t key, bool demand);
  bool Loading(int32_t slot) const;
  bool Failed(int32_t slot) const;

  ExpertStoreOptions o_;
  int64_t pieces_ = 1;  // reads per expert
  std::unique_ptr<BundleReader> reader_;
  std::unique_ptr<NeuronCache> cache_;
  std::unique_ptr<Arena> pinned_, dynamic_;
  std::vector<int32_t> pinned_slot_;               // [L * E]: -1 or a pinned slot
  std::unique_ptr<std::atomic<uint32_t>[]> state_;  // [cache_slots * pieces]
  std::vector<uint8_t> by_prefetch_;               // [cache_slots]: read ahead, not yet used
  std::vector<std::vector<int32_t>> guess_;        // [L]: the last one-token prefetch's set
  std::vector<uint8_t> guessed_;                   // [L]: a guess is waiting for its call
  uint64_t tick_ = 0;
  mutable std::mutex mutex_;
  ExpertStoreStats stats_;  // under mutex_
  std::atomic<int64_t> wait_ns_{0};
  std::vector<ReadJob> jobs_;
  std::vector<int32_t> slot_scratch_;  // Acquire's: each requested expert's cache slot or -1
  ReaderStats reader_base_;
};

// Handle -> store (handles never reused within a process), as NeuronStores().
class ExpertStoreRegistry {
 public:
  int64_t Add(std::shared_ptr<ExpertStore> store);
  std::shared_ptr<ExpertStore> Get(int64_t handle) const;
  bool Remove(int64_t handle);

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<ExpertStore>> stores_;
  int64_t next_ = 1;
};

ExpertStoreRegistry& ExpertStores();

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_EXPERT_STORE_H_
