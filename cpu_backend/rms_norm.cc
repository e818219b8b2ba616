#include "cpu_backend/rms_norm.h"

#include <cmath>

namespace pij {

void RmsNormRows(std::span<const float> x, std::span<const float> scale, float eps, int64_t dim,
                 int64_t row_begin, int64_t row_end, std::span<float> y) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::span<const float> in = x.subspan(r * dim, dim);
    const std::span<float> out = y.subspan(r * dim, dim);
    // Sum of squares in double: rows are short, and it keeps the result close to XLA's for
    // rows with a large dynamic range.
    double sum_sq = 0.0;
    for (const float v : in) sum_sq += static_cast<double>(v) * v;
    const float inv_rms =
        1.0f / std::sqrt(static_cast<float>(sum_sq / static_cast<double>(dim)) + eps);
    for (int64_t d = 0; d < dim; ++d) out[d] = in[d] * inv_rms * scale[d];
  }
}

}  // namespace pij
