#include "xla_ffi/cpu_runtime.h"

namespace pij {

CpuRuntime& GetCpuRuntime() {
  // Leaked on purpose: joining pool threads from a static destructor at interpreter exit can
  // deadlock; the OS reclaims the threads.
  static CpuRuntime* runtime = new CpuRuntime();
  return *runtime;
}

void SetContiguousRows(CpuRuntime& rt, const float* data, int64_t rows, int64_t dim) {
  rt.x_rows.resize(rows);
  for (int64_t r = 0; r < rows; ++r) rt.x_rows[r] = data + r * dim;
}

}  // namespace pij
