// A persistent thread pool for short, frequent parallel loops (one sparse FFN call per layer per
// token: tens of microseconds each), after google/highway's ThreadPool:
//   pool.Run(begin, end, [&](int64_t task, int worker) { ... });
// - The calling thread participates as worker 0; workers 1..n-1 are persistent threads.
// - No std::function and no queue on the hot path: Run publishes a plain function pointer plus a
//   context pointer, workers claim task indices from one atomic counter.
// - Idle workers spin briefly (the next layer's call usually arrives within microseconds), then
//   block on a futex (std::atomic::wait) so an idle process burns no CPU.
// - `worker` is in [0, NumThreads()) and indexes per-worker scratch. Which worker runs which task
//   is NOT fixed; kernels that need determinism must key their partial results by task.
// Run is serialized by a mutex: concurrent callers (e.g. several XLA host devices) take turns.
#ifndef PIJ_CPU_BACKEND_THREAD_POOL_H_
#define PIJ_CPU_BACKEND_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace pij {

class ThreadPool {
 public:
  // num_threads counts the calling thread; 0 means std::thread::hardware_concurrency(); more
  // than MaxThreads() is capped there (callers validate user input first, see SetNumThreads).
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int NumThreads() const { return num_threads_; }

  // The most threads a pool may have: max(kMinMaxThreads, 4 x hardware threads). More workers
  // than hardware threads only oversubscribe the cores (each idle worker also spins ~50-100 us
  // after every call), 4x leaves room for oversubscription experiments, and a request like 5000
  // is a typo that would otherwise start 5000 threads.
  static constexpr int kMinMaxThreads = 256;
  static int MaxThreads();

  // Joins the workers and starts n - 1 new ones (n <= 0: hardware concurrency). Waits for any
  // Run in progress. Returns false, leaving the pool as it was, when n > MaxThreads().
  [[nodiscard]] bool SetNumThreads(int n);

  // Calls fn(task, worker) once for every task in [begin, end) and returns when all are done.
  // Runs inline on the caller when there is one task or one thread (no wake-up cost).
  template <typename Fn>
  void Run(int64_t begin, int64_t end, const Fn& fn) {
    if (end <= begin) return;
    std::lock_guard<std::mutex> lock(run_mutex_);
    if (end - begin == 1 || num_threads_ == 1) {
      for (int64_t task = begin; task < end; ++task) fn(task, 0);
      return;
    }
    using FnType = std::remove_reference_t<decltype(fn)>;
    RunErased(begin, end, &CallFn<FnType>, const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using TaskFn = void (*)(void* ctx, int64_t task, int worker);

  template <typename Fn>
  static void CallFn(void* ctx, int64_t task, int worker) {
    (*static_cast<const Fn*>(ctx))(task, worker);
  }

  void RunErased(int64_t begin, int64_t end, TaskFn fn, void* ctx);
  void WorkerLoop(int worker, uint32_t seen_epoch);
  void DrainTasks(int worker);
  void StartWorkers(int n);
  void StopWorkers();

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;

  // The current job, written by the caller before `epoch_` is bumped (release) and read by
  // workers after they observe the new epoch (acquire).
  TaskFn job_fn_ = nullptr;
  void* job_ctx_ = nullptr;
  int64_t job_end_ = 0;
  // Each on its own cache line: workers hammer next_task_ while the caller waits on inside_.
  alignas(64) std::atomic<int64_t> next_task_{0};
  alignas(64) std::atomic<uint32_t> epoch_{0};
  // Workers inside the current job (low bits) and kClosed once the caller has finished its share:
  // a worker that checks in after that leaves at once, so the caller waits only for workers that
  // actually started, never for one the OS has not scheduled.
  static constexpr uint32_t kClosed = 1u << 31;
  alignas(64) std::atomic<uint32_t> inside_{kClosed};
  std::atomic<bool> stop_{false};
};

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_THREAD_POOL_H_
