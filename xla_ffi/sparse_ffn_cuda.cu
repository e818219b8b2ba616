// Sparse FFN on the GPU, deterministic, in two kernels:
//   1. ActivationsKernel: one warp per neuron. For each token it decides activity (scores, or the
//      activation itself for "oracle"), computes a = act(gate.x) * (up.x + b_up) with a warp
//      reduction, and writes a (0 when inactive) to a [rows, F] scratch. Inactive rows (scores
//      criterion) are never read.
//   2. DownKernel: one thread per (token, output column) sums a[t, i] * down_t[i, d] over i in a
//      fixed order, skipping zeros (the branch is uniform across the block, so skipped neurons cost
//      no memory traffic), then adds b_down. No float atomics: output is bitwise reproducible.
// The math (activations, bf16/f16 widening) comes from cpu_backend/pij_math.h, shared with the
// CPU kernel, which is this kernel's oracle.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/sparse_ffn_args.h"
#include "xla_ffi/sparse_ffn_cuda.h"
#include "xla_ffi/sparse_ffn_cuda_launch.h"

namespace pij {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;     // 256 threads: one neuron per warp
constexpr int kDownThreads = 256;     // output columns per block in the down kernel
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

__device__ inline float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <typename W>
__global__ void ActivationsKernel(const float* __restrict__ x, const W* __restrict__ gate,
                                  const W* __restrict__ up, const float* __restrict__ b_up,
                                  const float* __restrict__ scores, int64_t rows, int64_t f,
                                  int64_t d, Activation activation, bool oracle, float threshold,
                                  float* __restrict__ act, int32_t* __restrict__ n_active) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (i >= f) return;  // whole warp leaves together
  const W* up_row = up + i * d;
  const W* gate_row = gate != nullptr ? gate + i * d : nullptr;
  const float bias = b_up != nullptr ? b_up[i] : 0.0f;
  for (int64_t t = 0; t < rows; ++t) {
    float a = 0.0f;
    bool active = oracle || scores[t * f + i] > threshold;
    if (active) {
      const float* x_row = x + t * d;
      float g = 0.0f;
      float u = 0.0f;
      for (int64_t e = lane; e < d; e += kWarpSize) {
        const float xv = x_row[e];
        u += ToF32(up_row[e]) * xv;
        if (gate_row != nullptr) g += ToF32(gate_row[e]) * xv;
      }
      u = WarpSum(u) + bias;
      g = WarpSum(g);
      a = gate_row != nullptr ? Activate(activation, g) * u : Activate(activation, u);
      if (oracle) active = fabsf(a) > threshold;
    }
    if (lane == 0) {
      act[t * f + i] = active ? a : 0.0f;
      if (active) atomicAdd(&n_active[t], 1);  // integer atomics: order-independent
    }
  }
}

template <typename W>
__global__ void DownKernel(const float* __restrict__ act, const W* __restrict__ down_t,
                           const float* __restrict__ b_down, int64_t f, int64_t d,
                           float* __restrict__ y) {
  const int64_t t = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kDownThreads + threadIdx.x;
  const float* a_row = act + t * f;
  float sum = 0.0f;
  for (int64_t i = 0; i < f; ++i) {
    const float a = a_row[i];  // same address for the whole block: a broadcast, uniform branch
    if (a != 0.0f && col < d) sum += a * ToF32(down_t[i * d + col]);
  }
  if (col < d) y[t * d + col] = sum + (b_down != nullptr ? b_down[col] : 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

template <typename W>
ffi::Error Launch(const SparseFfnCall& c, float* act, cudaStream_t stream) {
  if (cudaMemsetAsync(c.n_active, 0, c.rows * sizeof(int32_t), stream) != cudaSuccess) {
    return ffi::Error::Internal("sparse_ffn (CUDA): cudaMemsetAsync failed");
  }
  const bool oracle = c.params.criterion == Criterion::kOracle;
  const dim3 act_grid((c.num_neurons + kWarpsPerBlock - 1) / kWarpsPerBlock);
  // No neurons (a hybrid layer with every row cold): y = b_down, counts 0, no activations launch
  // (a zero-block grid is a launch error).
  if (c.num_neurons > 0) ActivationsKernel<W><<<act_grid, kWarpsPerBlock * kWarpSize, 0, stream>>>(
      c.x, static_cast<const W*>(c.gate), static_cast<const W*>(c.up), c.b_up, c.scores, c.rows,
      c.num_neurons, c.dim, c.params.activation, oracle, c.params.threshold, act, c.n_active);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_ffn (CUDA): activations kernel: ") +
                                cudaGetErrorString(err));
  }
  const dim3 down_grid((c.dim + kDownThreads - 1) / kDownThreads, c.rows);
  DownKernel<W><<<down_grid, kDownThreads, 0, stream>>>(
      act, static_cast<const W*>(c.down_t), c.b_down, c.num_neurons, c.dim, c.y);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_ffn (CUDA): down kernel: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

bool IsIdentity(const std::vector<int64_t>& src) {
  for (size_t r = 0; r < src.size(); ++r) {
    if (src[r] != static_cast<int64_t>(r)) return false;
  }
  return true;
}

ffi::Error SparseFfnCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                             ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                             ffi::AnyBuffer w_down_t, ffi::AnyBuffer b_up, ffi::AnyBuffer b_down,
                             ffi::AnyBuffer scores, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> n_active, float threshold,
                             std::string_view activation, std::string_view criterion) {
  SparseFfnCall call;
  std::vector<int64_t> x_src, score_src;
  if (ffi::Error e = DecodeSparseFfn(x, w_gate, w_up, w_down_t, b_up, b_down, scores, *y,
                                     *n_active, threshold, activation, criterion, call, x_src,
                                     score_src);
      e.failure()) {
    return e;
  }
  if (call.params.criterion == Criterion::kActivations) {  // CPU backend only, for now
    return ffi::Error::InvalidArgument(std::string("sparse_ffn (CUDA)") +
                                       ": criterion: expected scores or oracle on CUDA, got "
                                       "activations (the q4 gate/up mode runs on the CPU backend)");
  }
  // Row pointers would live in host memory; on the device x and scores must be dense instead.
  if (!IsIdentity(x_src) || (call.scores != nullptr && !IsIdentity(score_src))) {
    return ffi::Error::InvalidArgument(
        "sparse_ffn (CUDA): x/scores: expected leading dims equal to the result's (no "
        "broadcasting on the GPU), got broadcasting leading dims");
  }
  if (call.rows == 0) return ffi::Error::Success();
  if (call.rows > 65535) {
    return ffi::Error::InvalidArgument("sparse_ffn (CUDA): rows: expected <= 65535, got " +
                                       std::to_string(call.rows));
  }
  std::optional<void*> act =
      scratch.Allocate(std::max<int64_t>(1, call.rows * call.num_neurons) * sizeof(float));
  if (!act.has_value()) {
    return ffi::Error::Internal("sparse_ffn (CUDA): could not allocate [rows, F] scratch");
  }
  return LaunchSparseFfnCuda(call, static_cast<float*>(*act), stream);
}

}  // namespace

ffi::Error LaunchSparseFfnCuda(const SparseFfnCall& call, float* act, cudaStream_t stream) {
  switch (call.weight_type) {  // the one dtype dispatch
    case ffi::DataType::F32: return Launch<float>(call, act, stream);
    case ffi::DataType::BF16: return Launch<Bf16>(call, act, stream);
    case ffi::DataType::F16: return Launch<F16>(call, act, stream);
    default: return ffi::Error::Internal("sparse_ffn (CUDA): unreachable weight dtype");
  }
}

}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijSparseFfnCuda, pij::SparseFfnCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down_t
                                  .Arg<xla::ffi::AnyBuffer>()  // b_up
                                  .Arg<xla::ffi::AnyBuffer>()  // b_down
                                  .Arg<xla::ffi::AnyBuffer>()  // scores
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // n_active
                                  .Attr<float>("threshold")
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("criterion"));
