// The hot-row sparse FFN launcher of sparse_ffn_cuda.cu, for other CUDA handlers (the hybrid one).
#ifndef PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_
#define PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/sparse_ffn_args.h"

namespace pij {

// Floats of device scratch LaunchSparseFfnCuda needs for `call` (activations and the down
// projection's per-chunk partials).
int64_t SparseFfnCudaScratchFloats(const SparseFfnCall& call);

// Enqueues the sparse FFN kernels of a decoded call on `stream` (y and n_active overwritten).
// scratch: device memory of SparseFfnCudaScratchFloats(call) floats. Dispatches on the weight
// dtype.
ffi::Error LaunchSparseFfnCuda(const SparseFfnCall& call, float* scratch, cudaStream_t stream);

}  // namespace pij

#endif  // PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_
