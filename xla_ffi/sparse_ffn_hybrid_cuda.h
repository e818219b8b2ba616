// Hybrid (hot on the GPU, cold on the host pool) sparse FFN handler; see sparse_ffn_hybrid_cuda.cu.
#ifndef PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_
#define PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_

#include "cpu_backend/cold_store.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PijSparseFfnHybridCuda);

namespace pij {

// The store of cold rows the hybrid handler reads (one per process, in this module).
ColdStore& HybridColdStore();

// Threads of the host pool that runs the cold rows (the calling thread counts as one). False,
// leaving the pool as it was, above ThreadPool::MaxThreads().
[[nodiscard]] bool SetHybridThreads(int n);

}  // namespace pij

#endif  // PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_
