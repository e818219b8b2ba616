// The process-wide CPU runtime behind the FFI handlers: one thread pool and the kernels' reusable
// scratch. One instance because the pool's threads are a machine resource (two pools would fight
// over the same cores); calls are serialized by `mutex` so scratch is never shared.
#ifndef PIJ_XLA_FFI_CPU_RUNTIME_H_
#define PIJ_XLA_FFI_CPU_RUNTIME_H_

#include <cstdint>
#include <mutex>
#include <vector>

#include "cpu_backend/q4_estimate.h"
#include "cpu_backend/q4_ffn.h"
#include "cpu_backend/moe_ffn.h"
#include "cpu_backend/qlinear.h"
#include "cpu_backend/qsparse_ffn.h"
#include "cpu_backend/sparse_ffn.h"
#include "cpu_backend/thread_pool.h"

namespace pij {

struct CpuRuntime {
  std::mutex mutex;  // held for a whole call: guards everything below except the pool itself
  ThreadPool pool;
  SparseFfnScratch ffn_scratch;
  std::vector<int64_t> x_src, score_src;
  std::vector<const float*> x_rows, score_rows;
  std::vector<Q8Row> q8_rows;  // q4_scores: the tokens quantized to int8
  Q4FfnScratch q4_ffn;         // q4_sparse_ffn
  QLinearScratch qlinear;      // qlinear, qlinear_many
  QSparseFfnScratch qsparse_ffn;
  MoeScratch moe;              // moe_ffn
};

CpuRuntime& GetCpuRuntime();

// rt.x_rows = the `rows` contiguous rows of `dim` floats at `data` (the kernels take row tables).
void SetContiguousRows(CpuRuntime& rt, const float* data, int64_t rows, int64_t dim);

}  // namespace pij

#endif  // PIJ_XLA_FFI_CPU_RUNTIME_H_
