// Hybrid sparse FFN on a GPU: hot rows on the device, cold rows on the host thread pool.
//
// Operands: the hot part exactly as the CUDA sparse FFN (sparse_ffn_args.h: x, hot gate/up/down_t
// [F_hot, D], hot b_up, b_down, hot scores [T, F_hot]) plus scores_cold [T, F_cold] (criterion
// "scores"; empty for "oracle"). Attribute cold_handle: the layer's cold rows in the host
// ColdStore (cpu_backend/cold_store.h), registered once at load. x and the scores must not
// broadcast (dense [T, ...] on the device).
//
// Stream order (no Python, no GIL, no host blocking in the handler):
//   XLA stream:  record x_ready -> hot kernels (y, n_active) -> wait cold_done -> y += y_cold
//   side stream: wait x_ready -> x, scores_cold to pinned host -> cudaLaunchHostFunc(cold rows on
//                the pool) -> partial y_cold, counts to the device -> record cold_done
// so the hot kernels and the host's cold rows run at the same time. The host function never calls
// CUDA; an error inside it (e.g. out of memory) is reported by the next call on the same layer.
// Not command-buffer compatible (host functions and a second stream).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cpu_backend/cold_store.h"
#include "cpu_backend/pij_math.h"
#include "cpu_backend/sparse_ffn.h"
#include "cpu_backend/thread_pool.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/sparse_ffn_args.h"
#include "xla_ffi/sparse_ffn_cuda_launch.h"
#include "xla_ffi/sparse_ffn_hybrid_cuda.h"

namespace pij {
namespace {

// ---------------------------------------------------------------------------------------------
// Host side: the store, the pool, pinned staging per layer
// ---------------------------------------------------------------------------------------------

struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using Pinned = std::unique_ptr<void, PinnedFree>;

Pinned AllocPinned(size_t bytes) {
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) return Pinned();
  return Pinned(p);
}


// Per cold handle (one per layer): pinned buffers sized for the largest call seen, and the two
// events that order the side stream against XLA's. Everything on the side stream is in order, so
// consecutive calls reuse the buffers safely.
struct Staging {
  Pinned x, scores, y, counts;
  size_t x_bytes = 0, scores_bytes = 0, y_bytes = 0, counts_bytes = 0;
  cudaEvent_t x_ready = nullptr, cold_done = nullptr;
  std::atomic<bool> host_failed{false};
  ~Staging() {
    if (x_ready) cudaEventDestroy(x_ready);
    if (cold_done) cudaEventDestroy(cold_done);
  }
};

struct HybridRuntime {
  ColdStore store;
  // The host pool for cold rows: the CPU module's (UseHostPool, called when Python registers the
  // targets), so a process runs one pool on its cores. Until then a caller-only fallback.
  ThreadPool fallback_pool{1};
  ThreadPool* pool = &fallback_pool;
  std::mutex pool_mutex;  // the host function's scratch is shared by all layers
  SparseFfnScratch scratch;
  std::mutex mutex;  // guards staging and side
  std::map<int64_t, std::unique_ptr<Staging>> staging;
  cudaStream_t side = nullptr;
};

// Work of one call on the host, owned by the host function (deleted when it finishes).
struct ColdTask {
  const ColdRows* rows;
  Staging* staging;
  SparseFfnParams params;
  int64_t num_tokens;
};

template <typename W>
void RunCold(const ColdTask& t, HybridRuntime& rt) {
  const ColdRows& r = *t.rows;
  FfnWeights<W> w;
  w.gate = static_cast<const W*>(r.gate_ptr());
  w.up = static_cast<const W*>(r.up.data());
  w.down_t = static_cast<const W*>(r.down_t.data());
  w.b_up = r.b_up_ptr();
  w.num_neurons = r.num_neurons;
  w.dim = r.dim;
  std::vector<const float*> x_rows(t.num_tokens), score_rows;
  const float* x = static_cast<const float*>(t.staging->x.get());
  for (int64_t i = 0; i < t.num_tokens; ++i) x_rows[i] = x + i * r.dim;
  if (t.params.criterion == Criterion::kScores) {
    const float* s = static_cast<const float*>(t.staging->scores.get());
    score_rows.resize(t.num_tokens);
    for (int64_t i = 0; i < t.num_tokens; ++i) score_rows[i] = s + i * r.num_neurons;
  }
  std::lock_guard<std::mutex> lock(rt.pool_mutex);
  SparseFfn<W>(w, FfnTokens{x_rows, score_rows}, t.params, *rt.pool, rt.scratch,
               static_cast<float*>(t.staging->y.get()),
               static_cast<int32_t*>(t.staging->counts.get()));
}

HybridRuntime& GetHybridRuntime() {
  static HybridRuntime* rt = new HybridRuntime();  // leaked: see xla_ffi/cpu_runtime.cc
  return *rt;
}

void CUDART_CB ColdHostFn(void* arg) {
  std::unique_ptr<ColdTask> task(static_cast<ColdTask*>(arg));
  try {
    HybridRuntime& rt = GetHybridRuntime();
    switch (task->rows->type) {
      case RowType::kF32: RunCold<float>(*task, rt); break;
      case RowType::kBf16: RunCold<Bf16>(*task, rt); break;
      case RowType::kF16: RunCold<F16>(*task, rt); break;
    }
  } catch (...) {  // never let an exception cross the CUDA runtime's thread
    task->staging->host_failed.store(true);
  }
}

bool Grow(Pinned& buf, size_t& have, size_t need) {
  if (need <= have) return true;
  buf = AllocPinned(need);
  have = buf ? need : 0;
  return static_cast<bool>(buf);
}

// ---------------------------------------------------------------------------------------------
// Device side
// ---------------------------------------------------------------------------------------------

__global__ void AddPartialKernel(float* __restrict__ y, const float* __restrict__ y_cold,
                                 int32_t* __restrict__ n_active, const int32_t* __restrict__ counts,
                                 int64_t rows, int64_t d) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < rows * d) y[j] += y_cold[j];
  if (j < rows) n_active[j] += counts[j];
}

ffi::Error CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("sparse_ffn_hybrid (CUDA): ") + what + ": " +
                              cudaGetErrorString(err));
}

#define PIJ_RETURN_IF_CUDA(expr, what)                              \
  if (ffi::Error e = CudaCheck((expr), (what)); e.failure()) return e

ffi::Error HybridImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                      ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down_t,
                      ffi::AnyBuffer b_up, ffi::AnyBuffer b_down, ffi::AnyBuffer scores,
                      ffi::AnyBuffer scores_cold, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> n_active, float threshold,
                      std::string_view activation, std::string_view criterion,
                      int64_t cold_handle) {
  constexpr std::string_view kOp = "sparse_ffn_hybrid (CUDA)";
  SparseFfnCall call;
  std::vector<int64_t> x_src, score_src;
  if (ffi::Error e = DecodeSparseFfn(x, w_gate, w_up, w_down_t, b_up, b_down, scores, *y,
                                     *n_active, threshold, activation, criterion, call, x_src,
                                     score_src);
      e.failure()) {
    return e;
  }
  if (call.params.criterion == Criterion::kActivations) {  // CPU backend only, for now
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": criterion: expected scores or oracle on CUDA, got "
                                       "activations (the q4 gate/up mode runs on the CPU backend)");
  }
  if (static_cast<int64_t>(x.element_count()) != call.rows * call.dim) {
    return ffi::Error::InvalidArgument(std::string(kOp) +
                                       ": x: expected dense [rows, D] (no broadcasting)");
  }
  HybridRuntime& rt = GetHybridRuntime();
  const ColdRows* rows = rt.store.Get(cold_handle);
  if (rows == nullptr) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": cold_handle: expected a handle "
                                       "from register_cold_rows, got " +
                                       std::to_string(cold_handle));
  }
  const RowType want = call.weight_type == ffi::DataType::F32    ? RowType::kF32
                       : call.weight_type == ffi::DataType::BF16 ? RowType::kBf16
                                                                 : RowType::kF16;
  if (rows->dim != call.dim || rows->type != want) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": cold rows: expected D and dtype "
                                       "of the hot weights, got D=" + std::to_string(rows->dim));
  }
  const bool use_scores = call.params.criterion == Criterion::kScores;
  const int64_t t = call.rows;
  if (use_scores && static_cast<int64_t>(scores_cold.element_count()) != t * rows->num_neurons) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": scores_cold: expected [rows, "
                                       "F_cold] = " + std::to_string(t * rows->num_neurons) +
                                       " elements, got " +
                                       std::to_string(scores_cold.element_count()));
  }
  if (t == 0) return ffi::Error::Success();

  Staging* st;
  {
    std::lock_guard<std::mutex> lock(rt.mutex);
    if (rt.side == nullptr) {
      PIJ_RETURN_IF_CUDA(cudaStreamCreateWithFlags(&rt.side, cudaStreamNonBlocking), "side stream");
    }
    std::unique_ptr<Staging>& slot = rt.staging[cold_handle];
    if (!slot) {
      slot = std::make_unique<Staging>();
      PIJ_RETURN_IF_CUDA(cudaEventCreateWithFlags(&slot->x_ready, cudaEventDisableTiming), "event");
      PIJ_RETURN_IF_CUDA(cudaEventCreateWithFlags(&slot->cold_done, cudaEventDisableTiming),
                         "event");
    }
    st = slot.get();
    if (st->host_failed.exchange(false)) {
      return ffi::Error::Internal(std::string(kOp) + ": a previous call's host part failed");
    }
    const size_t x_bytes = t * call.dim * sizeof(float);
    const size_t s_bytes = use_scores ? t * rows->num_neurons * sizeof(float) : 0;
    if (x_bytes > st->x_bytes || s_bytes > st->scores_bytes || x_bytes > st->y_bytes ||
        t * sizeof(int32_t) > st->counts_bytes) {
      // Growing frees buffers an earlier call may still use: let the side stream drain first.
      PIJ_RETURN_IF_CUDA(cudaStreamSynchronize(rt.side), "side stream sync");
      if (!Grow(st->x, st->x_bytes, x_bytes) || !Grow(st->y, st->y_bytes, x_bytes) ||
          !Grow(st->counts, st->counts_bytes, t * sizeof(int32_t)) ||
          (s_bytes && !Grow(st->scores, st->scores_bytes, s_bytes))) {
        return ffi::Error::Internal(std::string(kOp) + ": cudaHostAlloc failed");
      }
    }
  }
  std::optional<void*> act = scratch.Allocate(SparseFfnCudaScratchFloats(call) * sizeof(float));
  std::optional<void*> y_cold = scratch.Allocate(t * call.dim * sizeof(float));
  std::optional<void*> counts = scratch.Allocate(t * sizeof(int32_t));
  if (!act || !y_cold || !counts) {
    return ffi::Error::Internal(std::string(kOp) + ": could not allocate device scratch");
  }

  // Side stream: x (and cold scores) down, cold rows on the host, the partial back up.
  cudaStream_t side = rt.side;
  PIJ_RETURN_IF_CUDA(cudaEventRecord(st->x_ready, stream), "record x_ready");
  PIJ_RETURN_IF_CUDA(cudaStreamWaitEvent(side, st->x_ready, 0), "wait x_ready");
  PIJ_RETURN_IF_CUDA(cudaMemcpyAsync(st->x.get(), call.x, t * call.dim * sizeof(float),
                                     cudaMemcpyDeviceToHost, side), "x to host");
  if (use_scores) {
    PIJ_RETURN_IF_CUDA(cudaMemcpyAsync(st->scores.get(), scores_cold.untyped_data(),
                                       t * rows->num_neurons * sizeof(float),
                                       cudaMemcpyDeviceToHost, side), "scores to host");
  }
  auto task = std::make_unique<ColdTask>(ColdTask{rows, st, call.params, t});
  PIJ_RETURN_IF_CUDA(cudaLaunchHostFunc(side, ColdHostFn, task.get()), "cudaLaunchHostFunc");
  task.release();  // owned by ColdHostFn from here on
  PIJ_RETURN_IF_CUDA(cudaMemcpyAsync(*y_cold, st->y.get(), t * call.dim * sizeof(float),
                                     cudaMemcpyHostToDevice, side), "partial to device");
  PIJ_RETURN_IF_CUDA(cudaMemcpyAsync(*counts, st->counts.get(), t * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, side), "counts to device");
  PIJ_RETURN_IF_CUDA(cudaEventRecord(st->cold_done, side), "record cold_done");

  // XLA stream: the hot rows meanwhile, then the merge.
  if (ffi::Error e = LaunchSparseFfnCuda(call, static_cast<float*>(*act), stream); e.failure()) {
    return e;
  }
  PIJ_RETURN_IF_CUDA(cudaStreamWaitEvent(stream, st->cold_done, 0), "wait cold_done");
  constexpr int kThreads = 256;
  const int64_t n = t * call.dim;
  AddPartialKernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      call.y, static_cast<const float*>(*y_cold), call.n_active,
      static_cast<const int32_t*>(*counts), t, call.dim);
  return CudaCheck(cudaGetLastError(), "add kernel");
}

}  // namespace

ColdStore& HybridColdStore() { return GetHybridRuntime().store; }

void UseHostPool(ThreadPool* pool) {
  HybridRuntime& rt = GetHybridRuntime();
  std::lock_guard<std::mutex> lock(rt.pool_mutex);
  rt.pool = pool != nullptr ? pool : &rt.fallback_pool;
}

}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijSparseFfnHybridCuda, pij::HybridImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate (hot)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up (hot)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down_t (hot)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_up (hot)
                                  .Arg<xla::ffi::AnyBuffer>()  // b_down
                                  .Arg<xla::ffi::AnyBuffer>()  // scores (hot)
                                  .Arg<xla::ffi::AnyBuffer>()  // scores_cold
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // n_active
                                  .Attr<float>("threshold")
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("criterion")
                                  .Attr<int64_t>("cold_handle"));
