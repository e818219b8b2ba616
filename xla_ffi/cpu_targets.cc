#include "xla_ffi/cpu_targets.h"

namespace pij {
namespace {

// A function-local static: built on first use, so every file's initializer finds it ready
// whatever order the linker runs them in.
std::vector<CpuTarget>& Table() {
  static std::vector<CpuTarget> table;
  return table;
}

}  // namespace

bool AddCpuTarget(const char* name, XLA_FFI_Handler* handler) {
  Table().push_back({name, handler});
  return true;
}

const std::vector<CpuTarget>& CpuTargets() { return Table(); }

}  // namespace pij
