#include "cpu_backend/thread_pool.h"

#include <pthread.h>

#include <immintrin.h>

#include <algorithm>

namespace pij {
namespace {

// Spin iterations before blocking. A decode step issues one call per layer a few microseconds
// apart; ~20k pause instructions (~50-100 us) covers that gap without burning a core when idle.
constexpr int kSpinIterations = 20000;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

int HardwareThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(std::min<unsigned>(hw, 1u << 20));
}

int ResolveThreadCount(int n) { return n > 0 ? n : HardwareThreads(); }

}  // namespace

int ThreadPool::MaxThreads() { return std::max(kMinMaxThreads, 4 * HardwareThreads()); }

ThreadPool::ThreadPool(int num_threads) {
  StartWorkers(std::min(ResolveThreadCount(num_threads), MaxThreads()));
}

ThreadPool::~ThreadPool() { StopWorkers(); }

bool ThreadPool::SetNumThreads(int n) {
  if (n > MaxThreads()) return false;
  std::lock_guard<std::mutex> lock(run_mutex_);
  StopWorkers();
  StartWorkers(ResolveThreadCount(n));
  return true;
}

void ThreadPool::StartWorkers(int n) {
  num_threads_ = n;
  stop_.store(false, std::memory_order_relaxed);
  workers_.reserve(n - 1);
  // The epoch is read here, not in the new thread: a thread that starts late must still see the
  // first Run's bump as new work.
  const uint32_t start_epoch = epoch_.load(std::memory_order_acquire);
  for (int worker = 1; worker < n; ++worker) {
    workers_.emplace_back([this, worker, start_epoch] {
      pthread_setname_np(pthread_self(), "pij-pool");  // visible in top -H and /proc: tests count them
      WorkerLoop(worker, start_epoch);
    });
  }
}

void ThreadPool::StopWorkers() {
  stop_.store(true, std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
  num_threads_ = 1;
}

void ThreadPool::DrainTasks(int worker) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= job_end_) return;
    job_fn_(job_ctx_, task, worker);
  }
}

void ThreadPool::RunErased(int64_t begin, int64_t end, TaskFn fn, void* ctx) {
  job_fn_ = fn;
  job_ctx_ = ctx;
  job_end_ = end;
  next_task_.store(begin, std::memory_order_relaxed);
  // Open the job: clear kClosed but keep the count. A straggler of the previous job (it saw
  // that job's epoch, was descheduled, and checked in after it closed) may still be counted; it
  // leaves without touching anything, and must not be forgotten: overwriting the count with 0 let
  // its check-out underflow it, and the next caller waited forever (a hang seen under load).
  // The release half publishes the job fields above to check-ins.
  inside_.fetch_and(~kClosed, std::memory_order_acq_rel);
  epoch_.fetch_add(1, std::memory_order_release);
  epoch_.notify_all();

  DrainTasks(0);

  // Close the job, then wait only for the workers that checked in before it closed: fn and ctx
  // live on the caller's stack and must outlive every use, but a worker that was not scheduled
  // in time (a busy machine) never touches the job, so the caller need not wait for it.
  const uint32_t left = inside_.fetch_or(kClosed, std::memory_order_acq_rel) & ~kClosed;
  if (left == 0) return;
  for (int spin = 0;; ++spin) {
    const uint32_t now = inside_.load(std::memory_order_acquire);
    if ((now & ~kClosed) == 0) return;
    if (spin < kSpinIterations) {
      CpuRelax();
    } else {
      inside_.wait(now, std::memory_order_acquire);
    }
  }
}

void ThreadPool::WorkerLoop(int worker, uint32_t seen) {
  for (;;) {
    uint32_t now = epoch_.load(std::memory_order_acquire);
    for (int spin = 0; now == seen; ++spin) {
      if (spin < kSpinIterations) {
        CpuRelax();
      } else {
        epoch_.wait(seen, std::memory_order_acquire);
      }
      now = epoch_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load(std::memory_order_relaxed)) return;
    // Check in; a job already closed (the caller finished without us) is left untouched.
    if ((inside_.fetch_add(1, std::memory_order_acq_rel) & kClosed) == 0) DrainTasks(worker);
    if (inside_.fetch_sub(1, std::memory_order_acq_rel) == (kClosed | 1u)) inside_.notify_one();
  }
}

}  // namespace pij
