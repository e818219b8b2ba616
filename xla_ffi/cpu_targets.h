// The table of CPU FFI targets that bindings.cc's registrations() hands to Python: each adapter
// file adds its handlers itself, one line under each XLA_FFI_DEFINE_HANDLER_SYMBOL:
//
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(PijScaleRowsCpu, pij::ScaleRowsImpl, ...);
//   PIJ_CPU_TARGET("pij_scale_rows", PijScaleRowsCpu);
//
// so a new kernel's adapter touches no shared list (CMake's glob of xla_ffi/*_cpu.cc picks up
// its file; BUILD.md, "Adding a CPU kernel"). Entries are added while the module loads (static
// initialization), before Python can call registrations().
#ifndef PIJ_XLA_FFI_CPU_TARGETS_H_
#define PIJ_XLA_FFI_CPU_TARGETS_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace pij {

struct CpuTarget {
  const char* name;          // the target name Python calls ("pij_<op>")
  XLA_FFI_Handler* handler;  // the symbol XLA_FFI_DEFINE_HANDLER_SYMBOL defined
};

// Adds a target to the table; returns true (it initializes a static in PIJ_CPU_TARGET).
// A name added twice is kept twice: registrations() refuses the table, naming it.
bool AddCpuTarget(const char* name, XLA_FFI_Handler* handler);

// Every target added, in the order the linker ran the files' initializers.
const std::vector<CpuTarget>& CpuTargets();

}  // namespace pij

#define PIJ_CPU_TARGET_CONCAT_(a, b) a##b
#define PIJ_CPU_TARGET_CONCAT(a, b) PIJ_CPU_TARGET_CONCAT_(a, b)
#define PIJ_CPU_TARGET(name, handler)                                                   \
  [[maybe_unused]] static const bool PIJ_CPU_TARGET_CONCAT(pij_cpu_target_, __LINE__) = \
      ::pij::AddCpuTarget(name, handler)

#endif  // PIJ_XLA_FFI_CPU_TARGETS_H_
