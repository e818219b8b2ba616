#include "cpu_backend/bandwidth.h"

#include <vector>

#include "cpu_backend/simd.h"

namespace pij {
namespace {

// acc[u] += the vectors of p[0, n) in blocks of four (four independent accumulators keep several
// loads in flight); returns how many values that covered (the caller sums the rest).
int64_t AddBlocks(const float* p, int64_t n, simd::Vec acc[4]) {
  int64_t i = 0;
  for (; i + 4 * simd::kLanes <= n; i += 4 * simd::kLanes) {
    for (int u = 0; u < 4; ++u) acc[u] = simd::Add(acc[u], simd::Load(p + i + u * simd::kLanes));
  }
  return i;
}

}  // namespace

float StreamSum(std::span<const float> data, ThreadPool& pool) {
  const int64_t n = static_cast<int64_t>(data.size());
  const int64_t chunks = pool.NumThreads();
  std::vector<float> partial(chunks, 0.0f);
  pool.Run(0, chunks, [&](int64_t c, int /*worker*/) {
    const int64_t lo = n * c / chunks;
    const int64_t hi = n * (c + 1) / chunks;
    simd::Vec acc[4] = {simd::Zero(), simd::Zero(), simd::Zero(), simd::Zero()};
    int64_t i = lo + AddBlocks(data.data() + lo, hi - lo, acc);
    float sum = simd::ReduceSum(simd::Add(simd::Add(acc[0], acc[1]), simd::Add(acc[2], acc[3])));
    for (; i < hi; ++i) sum += data[i];
    partial[c] = sum;
  });
  float total = 0.0f;
  for (const float p : partial) total += p;
  return total;
}

float RunsSum(std::span<const float> data, int64_t run, int64_t stride,
              std::span<const uint8_t> keep, ThreadPool& pool) {
  const int64_t runs = static_cast<int64_t>(keep.size());
  const int64_t chunks = pool.NumThreads();
  std::vector<float> partial(chunks, 0.0f);
  pool.Run(0, chunks, [&](int64_t c, int /*worker*/) {
    simd::Vec acc[4] = {simd::Zero(), simd::Zero(), simd::Zero(), simd::Zero()};
    for (int64_t r = runs * c / chunks; r < runs * (c + 1) / chunks; ++r) {
      if (keep[r] == 0) continue;
      const float* p = data.data() + r * stride;
      for (int64_t i = AddBlocks(p, run, acc); i < run; i += simd::kLanes) {
        acc[0] = simd::Add(acc[0], simd::Load(p + i));
      }
    }
    partial[c] = simd::ReduceSum(simd::Add(simd::Add(acc[0], acc[1]), simd::Add(acc[2], acc[3])));
  });
  float total = 0.0f;
  for (const float p : partial) total += p;
  return total;
}

}  // namespace pij
