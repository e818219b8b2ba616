// The hot-row sparse FFN launcher of sparse_ffn_cuda.cu, for other CUDA handlers (the hybrid one).
#ifndef PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_
#define PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/sparse_ffn_args.h"

namespace pij {

// Enqueues the two-kernel sparse FFN of a decoded call on `stream` (y and n_active overwritten).
// act: device scratch of rows * num_neurons floats. Dispatches on the weight dtype.
ffi::Error LaunchSparseFfnCuda(const SparseFfnCall& call, float* act, cudaStream_t stream);

}  // namespace pij

#endif  // PIJ_XLA_FFI_SPARSE_FFN_CUDA_LAUNCH_H_
