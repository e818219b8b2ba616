// A memory read-bandwidth probe: the physical limit every memory-bound kernel here is compared
// against (napkin math: decode reads each active weight once per token). Knows nothing of XLA.
#ifndef PIJ_CPU_BACKEND_BANDWIDTH_H_
#define PIJ_CPU_BACKEND_BANDWIDTH_H_

#include <cstdint>
#include <span>

#include "cpu_backend/thread_pool.h"

namespace pij {

// Sums `data` with vector loads, split into one contiguous chunk per pool thread; returns the sum
// (so the reads cannot be optimized away). Time it from the caller: bytes / seconds = bandwidth.
float StreamSum(std::span<const float> data, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_BANDWIDTH_H_
