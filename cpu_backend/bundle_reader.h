// Reads of a neuron bundle file (neuron_store.h) on a pool of reader threads: each job is one
// preadv of a contiguous byte range into a list of destination buffers, and marks a list of
// flags ready (or failed) when it ends. With O_DIRECT (the default) the reads bypass the page
// cache: under a memory limit, page-cache pages are what gets reclaimed and read again, the
// failure mode of a model mapped with mmap. Offsets, lengths and buffers must then be multiples
// of kDirectAlign. No liburing on the machines this was built for, so no io_uring: reader threads
// blocked in preadv cost no CPU, and a disk needs many reads in flight (a virtio disk measured
// here: ~7k reads/s of 7 KiB at one in flight, ~50k at 32-64).
// Demand jobs run before prefetch jobs. Knows nothing of XLA, Python or what the bytes mean.
#ifndef PIJ_CPU_BACKEND_BUNDLE_READER_H_
#define PIJ_CPU_BACKEND_BUNDLE_READER_H_

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pij {

constexpr int64_t kDirectAlign = 512;  // the disk's logical block: O_DIRECT's unit

// A flag's states: a job stores kReady or kFailed and wakes its waiters (std::atomic::wait).
enum : uint32_t { kSlotEmpty = 0, kSlotLoading = 1, kSlotReady = 2, kSlotFailed = 3 };

struct ReadJob {
  int64_t offset = 0;
  std::vector<iovec> iov;                    // destinations, in file order
  std::vector<std::atomic<uint32_t>*> done;  // set to kSlotReady / kSlotFailed at the end
};

struct ReaderStats {
  int64_t jobs = 0, bytes = 0, syscalls = 0, failures = 0;
  int64_t busy_ns = 0;  // summed over readers: time inside preadv
};

class BundleReader {
 public:
  // Opens `path` read-only (O_DIRECT when `direct`; a filesystem that refuses it, e.g. tmpfs,
  // falls back to buffered reads: `direct()` says which). On failure *error is set and
  // `ok()` is false.
  BundleReader(const std::string& path, int threads, bool direct, std::string* error);
  ~BundleReader();
  BundleReader(const BundleReader&) = delete;
  BundleReader& operator=(const BundleReader&) = delete;

  bool ok() const { return fd_ >= 0; }
  bool direct() const { return direct_; }
  int64_t FileSize() const { return file_size_; }
  // Queues the jobs (demand: ahead of every prefetch job). Their flags must be kSlotLoading.
  void Submit(std::vector<ReadJob>& jobs, bool prefetch);
  ReaderStats Stats() const;
  // The first read error since the reader opened ("" if none): the file, offset and errno text.
  std::string LastError() const;

 private:
  void Loop();
  void Run(ReadJob& job);

  int fd_ = -1;
  bool direct_ = false;
  int64_t file_size_ = 0;
  std::string path_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<ReadJob> demand_, prefetch_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
  ReaderStats stats_;  // under mutex_
  std::string error_;  // under mutex_
};

// A store's read figures since `base` (the reader's at the store's last ResetStats), its
// callers' wait and the read mode, into its stats (NeuronStoreStats, ExpertStoreStats: the
// fields they share).
template <class StoreStats>
void AddReadStats(const BundleReader& reader, const ReaderStats& base, int64_t wait_ns,
                  StoreStats& out) {
  const ReaderStats r = reader.Stats();
  out.read_jobs = r.jobs - base.jobs;
  out.read_syscalls = r.syscalls - base.syscalls;
  out.bytes_read = r.bytes - base.bytes;
  out.read_failures = r.failures - base.failures;
  out.read_busy_ns = r.busy_ns - base.busy_ns;
  out.wait_ns = wait_ns;
  out.direct = reader.direct();
}

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_BUNDLE_READER_H_
