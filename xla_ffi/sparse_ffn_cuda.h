// CUDA FFI handler for the sparse FFN over rows resident on the GPU ("hot" rows). Same operands,
// attributes and validation as the CPU handler (sparse_ffn_args.h), except that x and scores must
// not broadcast (their leading dims must equal the result's).
#ifndef PIJ_XLA_FFI_SPARSE_FFN_CUDA_H_
#define PIJ_XLA_FFI_SPARSE_FFN_CUDA_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PijSparseFfnCuda);

#endif  // PIJ_XLA_FFI_SPARSE_FFN_CUDA_H_
