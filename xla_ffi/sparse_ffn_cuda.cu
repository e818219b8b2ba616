// Sparse FFN on the GPU, deterministic, in three kernels:
//   1. ActivationsKernel: one warp per neuron. For each token it decides activity (scores, or the
//      activation itself for "oracle"), computes a = act(gate.x) * (up.x + b_up) with a warp
//      reduction (16-byte loads per lane where rows allow), and writes a (0 when inactive) to a
//      [rows, F] scratch. Inactive rows (scores criterion) are never read.
//   2. DownPartialKernel: per (column tile, chunk of neurons, token) block, sums a[t, i] *
//      down_t[i, d] over the chunk in order, skipping zeros (the branch is uniform across the
//      block, so skipped neurons cost no memory traffic).
//   3. DownReduceKernel: sums the chunks' partials in order and adds b_down.
// No float atomics: the output is bitwise reproducible.
// The math (activations, bf16/f16 widening) comes from cpu_backend/pij_math.h, shared with the
// CPU kernel, which is this kernel's oracle.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/sparse_ffn_args.h"
#include "xla_ffi/sparse_ffn_cuda.h"
#include "xla_ffi/sparse_ffn_cuda_launch.h"

namespace pij {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;     // 256 threads: one neuron per warp
constexpr int kDownThreads = 256;     // output columns per block in the down kernels
constexpr int kDownChunk = 256;       // neurons per block in DownPartialKernel
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

__device__ inline float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// 16 bytes of weights: 8 bf16/f16 or 4 f32, loaded as one vector.
template <typename W>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(W);
  W v[kN];
};

// One warp per neuron. kVec: rows are read 16 bytes per lane (needs D * sizeof(W) % 16 == 0 and
// 16-byte aligned rows, checked by the launcher); else one element per lane.
template <typename W, bool kVec>
__global__ void ActivationsKernel(const float* __restrict__ x, const W* __restrict__ gate,
                                  const W* __restrict__ up, const float* __restrict__ b_up,
                                  const float* __restrict__ scores, int64_t rows, int64_t f,
                                  int64_t d, Activation activation, float gate_floor,
                                  bool oracle, float threshold, float* __restrict__ act,
                                  int32_t* __restrict__ n_active) {
  constexpr int kStep = kVec ? Vec16<W>::kN : 1;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (i >= f) return;  // whole warp leaves together
  const W* up_row = up + i * d;
  const W* gate_row = gate != nullptr ? gate + i * d : nullptr;
  const float bias = b_up != nullptr ? b_up[i] : 0.0f;
  for (int64_t t = 0; t < rows; ++t) {
    float a = 0.0f;
    bool active = oracle || SelectedByScore(scores[t * f + i], threshold);
    if (active) {
      const float* x_row = x + t * d;
      float g = 0.0f;
      float u = 0.0f;
      for (int64_t e = lane * kStep; e < d; e += kWarpSize * kStep) {
        if constexpr (kVec) {
          const Vec16<W> uv = *reinterpret_cast<const Vec16<W>*>(up_row + e);
#pragma unroll
          for (int j = 0; j < kStep; ++j) u += ToF32(uv.v[j]) * x_row[e + j];
          if (gate_row != nullptr) {
            const Vec16<W> gv = *reinterpret_cast<const Vec16<W>*>(gate_row + e);
#pragma unroll
            for (int j = 0; j < kStep; ++j) g += ToF32(gv.v[j]) * x_row[e + j];
          }
        } else {
          const float xv = x_row[e];
          u += ToF32(up_row[e]) * xv;
          if (gate_row != nullptr) g += ToF32(gate_row[e]) * xv;
        }
      }
      u = WarpSum(u) + bias;
      g = WarpSum(g);
      a = gate_row != nullptr ? GatedActivate(activation, FloorGate(g, gate_floor), u)
                              : Activate(activation, u);
      if (oracle) active = ActiveByMagnitude(a, threshold);
    }
    if (lane == 0) {
      act[t * f + i] = active ? a : 0.0f;
      if (active) atomicAdd(&n_active[t], 1);  // integer atomics: order-independent
    }
  }
}

// Down projection in two deterministic steps. DownPartialKernel: block (column tile, neuron chunk,
// token) sums its chunk's kDownChunk neurons for its columns, skipping inactive neurons (a == 0:
// the branch is uniform across the block, so their rows are never read), into
// partial[token, chunk, column]. DownReduceKernel: sums the chunks in order and adds b_down. The
// chunks spread one token's rows over ceil(F / kDownChunk) * ceil(D / kDownThreads) blocks, enough
// to fill the GPU at decode (one block per column tile would leave most SMs idle).
template <typename W>
__global__ void DownPartialKernel(const float* __restrict__ act, const W* __restrict__ down_t,
                                  int64_t f, int64_t d, int64_t chunks,
                                  float* __restrict__ partial) {
  __shared__ float a_chunk[kDownChunk];
  const int64_t t = blockIdx.z;
  const int64_t chunk = blockIdx.y;
  const int64_t i0 = chunk * kDownChunk;
  const int n = static_cast<int>(f - i0 < kDownChunk ? f - i0 : kDownChunk);
  for (int k = threadIdx.x; k < n; k += blockDim.x) a_chunk[k] = act[t * f + i0 + k];
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kDownThreads + threadIdx.x;
  if (col >= d) return;
  const W* rows = down_t + i0 * d + col;
  float sum = 0.0f;
  for (int k = 0; k < n; ++k) {
    const float a = a_chunk[k];
    if (a != 0.0f) sum += a * ToF32(rows[k * d]);
  }
  partial[(t * chunks + chunk) * d + col] = sum;
}

__global__ void DownReduceKernel(const float* __restrict__ partial,
                                 const float* __restrict__ b_down, int64_t chunks, int64_t d,
                                 float* __restrict__ y) {
  const int64_t t = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kDownThreads + threadIdx.x;
  if (col >= d) return;
  float sum = b_down != nullptr ? b_down[col] : 0.0f;
  for (int64_t c = 0; c < chunks; ++c) sum += partial[(t * chunks + c) * d + col];
  y[t * d + col] = sum;
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

int64_t DownChunks(const SparseFfnCall& c) {
  return std::max<int64_t>(1, (c.num_neurons + kDownChunk - 1) / kDownChunk);
}

bool Aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename W>
ffi::Error Launch(const SparseFfnCall& c, float* scratch, cudaStream_t stream) {
  float* act = scratch;
  float* partial = scratch + c.rows * c.num_neurons;
  if (cudaMemsetAsync(c.n_active, 0, c.rows * sizeof(int32_t), stream) != cudaSuccess) {
    return ffi::Error::Internal("sparse_ffn (CUDA): cudaMemsetAsync failed");
  }
  const bool oracle = c.params.criterion == Criterion::kOracle;
  const dim3 act_grid((c.num_neurons + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const bool vec = (c.dim * sizeof(W)) % 16 == 0 && Aligned16(c.up) && Aligned16(c.gate);
  // No neurons (a hybrid layer with every row cold): y = b_down, counts 0, no activations launch
  // (a zero-block grid is a launch error).
  if (c.num_neurons > 0) {
    auto kernel = vec ? ActivationsKernel<W, true> : ActivationsKernel<W, false>;
    kernel<<<act_grid, kWarpsPerBlock * kWarpSize, 0, stream>>>(
        c.x, static_cast<const W*>(c.gate), static_cast<const W*>(c.up), c.b_up, c.scores, c.rows,
        c.num_neurons, c.dim, c.params.activation, c.params.gate_floor, oracle,
        c.params.threshold, act, c.n_active);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return ffi::Error::Internal(std::string("sparse_ffn (CUDA): activations kernel: ") +
                                  cudaGetErrorString(err));
    }
  }
  const int64_t chunks = DownChunks(c);
  const unsigned col_tiles = static_cast<unsigned>((c.dim + kDownThreads - 1) / kDownThreads);
  if (c.num_neurons > 0) {
    DownPartialKernel<W><<<dim3(col_tiles, chunks, c.rows), kDownThreads, 0, stream>>>(
        act, static_cast<const W*>(c.down_t), c.num_neurons, c.dim, chunks, partial);
  } else if (cudaMemsetAsync(partial, 0, c.rows * c.dim * sizeof(float), stream) != cudaSuccess) {
    return ffi::Error::Internal("sparse_ffn (CUDA): cudaMemsetAsync failed");
  }
  DownReduceKernel<<<dim3(col_tiles, c.rows), kDownThreads, 0, stream>>>(partial, c.b_down, chunks,
                                                                         c.dim, c.y);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("sparse_ffn (CUDA): down kernels: ") +
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
                             std::string_view activation, std::string_view criterion,
                             float gate_floor) {
  SparseFfnCall call;
  std::vector<int64_t> x_src, score_src;
  if (ffi::Error e = DecodeSparseFfn(x, w_gate, w_up, w_down_t, b_up, b_down, scores, *y,
                                     *n_active, threshold, activation, criterion, call, x_src,
                                     score_src);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckGateFloor("sparse_ffn (CUDA)", gate_floor, call.params.activation,
                                    w_gate.element_count() > 0);
      e.failure()) {
    return e;
  }
  call.params.gate_floor = gate_floor;
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
  std::optional<void*> work = scratch.Allocate(SparseFfnCudaScratchFloats(call) * sizeof(float));
  if (!work.has_value()) {
    return ffi::Error::Internal("sparse_ffn (CUDA): could not allocate the kernels' scratch");
  }
  return LaunchSparseFfnCuda(call, static_cast<float*>(*work), stream);
}

}  // namespace

int64_t SparseFfnCudaScratchFloats(const SparseFfnCall& call) {
  return call.rows * call.num_neurons + call.rows * DownChunks(call) * call.dim;
}

ffi::Error LaunchSparseFfnCuda(const SparseFfnCall& call, float* scratch, cudaStream_t stream) {
  switch (call.weight_type) {  // the one dtype dispatch
    case ffi::DataType::F32: return Launch<float>(call, scratch, stream);
    case ffi::DataType::BF16: return Launch<Bf16>(call, scratch, stream);
    case ffi::DataType::F16: return Launch<F16>(call, scratch, stream);
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
                                  .Attr<std::string_view>("criterion")
                                  .Attr<float>("gate_floor"));
