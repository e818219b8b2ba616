// Hybrid (hot on the GPU, cold on the host pool) sparse FFN handler; see sparse_ffn_hybrid_cuda.cu.
#ifndef PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_
#define PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_

#include "cpu_backend/cold_store.h"
#include "cpu_backend/thread_pool.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(PijSparseFfnHybridCuda);

namespace pij {

// The store of cold rows the hybrid handler reads (one per process, in this module).
ColdStore& HybridColdStore();

// The host pool that runs the cold rows: the CPU module's pool (one pool per process; its size is
// set through the CPU module). nullptr: back to a caller-only pool.
void UseHostPool(ThreadPool* pool);

}  // namespace pij

#endif  // PIJ_XLA_FFI_SPARSE_FFN_HYBRID_CUDA_H_
