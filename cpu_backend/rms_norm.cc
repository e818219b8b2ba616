#include "cpu_backend/rms_norm.h"

#include <cmath>

namespace pij {

void RmsNormRows(std::span<const float> x, std::span<const float> scale, float eps, int64_t dim,
                 int64_t row_begin, int64_t row_end, std::span<float> y) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::span<const float> in = x.subspan(r * dim, dim);
    const std::span<float> out = y.subspan(r * dim, dim);
    // Sum of squares in double: rows are short, and it keeps the result close to XLA's for
    // rows with a large dynamic range. kLanes independent partial sums (lane k takes elements
    // k, k + kLanes, ...), added pairwise at the end: a fixed order the compiler turns into
    // vector code (one running sum is a serial chain it must not reorder).
    constexpr int kLanes = 8;
    double part[kLanes] = {};
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) {
      for (int k = 0; k < kLanes; ++k) part[k] += static_cast<double>(in[d + k]) * in[d + k];
    }
    for (int k = 0; d < dim; ++d, ++k) part[k] += static_cast<double>(in[d]) * in[d];
    for (int w = kLanes / 2; w > 0; w /= 2) {
      for (int k = 0; k < w; ++k) part[k] += part[k + w];
    }
    const double sum_sq = part[0];
    const float inv_rms =
        1.0f / std::sqrt(static_cast<float>(sum_sq / static_cast<double>(dim)) + eps);
    for (int64_t d = 0; d < dim; ++d) out[d] = in[d] * inv_rms * scale[d];
  }
}

}  // namespace pij
