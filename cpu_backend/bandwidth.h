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

// What input sparsity's reads can reach: data is runs of `run` floats, one every `stride` floats
// (run <= stride; a columns matrix's channels: a run is one channel's codes of one block); the
// runs with keep[i] != 0 are summed, each whole before the next (the columns product's order),
// the runs split over the pool threads in contiguous ranges. Returns the sum; time it from the
// caller: the kept runs' bytes / seconds = the bandwidth that pattern gets. Preconditions
// (checked by the caller): keep.size() == data.size() / stride, run a multiple of 16.
float RunsSum(std::span<const float> data, int64_t run, int64_t stride,
              std::span<const uint8_t> keep, ThreadPool& pool);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_BANDWIDTH_H_
