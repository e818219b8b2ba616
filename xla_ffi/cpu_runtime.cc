#include "xla_ffi/cpu_runtime.h"

namespace pij {

CpuRuntime& GetCpuRuntime() {
  // Leaked on purpose: joining pool threads from a static destructor at interpreter exit can
  // deadlock; the OS reclaims the threads.
  static CpuRuntime* runtime = new CpuRuntime();
  return *runtime;
}

}  // namespace pij
