#include "cpu_backend/bundle_reader.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

namespace pij {

BundleReader::BundleReader(const std::string& path, int threads, bool direct, std::string* error)
    : path_(path) {
  if (direct) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    direct_ = fd_ >= 0;
  }
  if (fd_ < 0 && (!direct || errno == EINVAL)) {  // EINVAL: the filesystem has no O_DIRECT
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd_ < 0) {
    *error = path + ": " + std::strerror(errno);
    return;
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    *error = path + ": " + std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    return;
  }
  file_size_ = st.st_size;
  for (int t = 0; t < threads; ++t) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "pij-reader");
      Loop();
    });
  }
}

BundleReader::~BundleReader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
  // jobs never started: their waiters must not wait forever
  for (std::deque<ReadJob>* q : {&demand_, &prefetch_}) {
    for (ReadJob& job : *q) {
      for (std::atomic<uint32_t>* f : job.done) {
        f->store(kSlotFailed, std::memory_order_release);
        f->notify_all();
      }
    }
  }
  if (fd_ >= 0) ::close(fd_);
}

void BundleReader::Submit(std::vector<ReadJob>& jobs, bool prefetch) {
  if (jobs.empty()) return;
  const size_t n = jobs.size();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::deque<ReadJob>& q = prefetch ? prefetch_ : demand_;
    for (ReadJob& job : jobs) q.push_back(std::move(job));
  }
  jobs.clear();
  // One reader per job: waking every reader for each call's few jobs (two calls per layer)
  // cost a context switch per idle reader on a 2-core machine (perf: the scheduler's and
  // futex's kernel time of a 7B decode at 32 readers).
  if (n >= threads_.size()) {
    wake_.notify_all();
  } else {
    for (size_t k = 0; k < n; ++k) wake_.notify_one();
  }
}

void BundleReader::Loop() {
  for (;;) {
    ReadJob job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || !demand_.empty() || !prefetch_.empty(); });
      if (stop_) return;
      std::deque<ReadJob>& q = demand_.empty() ? prefetch_ : demand_;
      job = std::move(q.front());
      q.pop_front();
    }
    Run(job);
  }
}

void BundleReader::Run(ReadJob& job) {
  const auto t0 = std::chrono::steady_clock::now();
  int64_t offset = job.offset, bytes = 0, syscalls = 0;
  size_t first = 0;
  int err = 0;
  // preadv may stop short (a signal, a large request): go on from where it stopped
  while (first < job.iov.size()) {
    const int n = static_cast<int>(std::min<size_t>(job.iov.size() - first, IOV_MAX));
    const ssize_t got = ::preadv(fd_, job.iov.data() + first, n, offset);
    ++syscalls;
    if (got < 0) {
      if (errno == EINTR) continue;
      err = errno;
      break;
    }
    if (got == 0) {  // past the end: the file is shorter than the layout says
      err = EIO;
      break;
    }
    offset += got;
    bytes += got;
    size_t left = static_cast<size_t>(got);
    while (first < job.iov.size() && left >= job.iov[first].iov_len) {
      left -= job.iov[first].iov_len;
      ++first;
    }
    if (left > 0) {  // partway into a buffer: the rest of it next (still aligned: O_DIRECT
                     // returns whole blocks)
      job.iov[first].iov_base = static_cast<uint8_t*>(job.iov[first].iov_base) + left;
      job.iov[first].iov_len -= left;
    }
  }
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.jobs;
    stats_.bytes += bytes;
    stats_.syscalls += syscalls;
    stats_.busy_ns += ns;
    if (err != 0) {
      ++stats_.failures;
      if (error_.empty()) {
        error_ = path_ + ": read at byte " + std::to_string(offset) + " failed: " +
                 std::strerror(err);
      }
    }
  }
  const uint32_t state = err == 0 ? kSlotReady : kSlotFailed;
  for (std::atomic<uint32_t>* f : job.done) {
    f->store(state, std::memory_order_release);
    f->notify_all();
  }
}

ReaderStats BundleReader::Stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

std::string BundleReader::LastError() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace pij
