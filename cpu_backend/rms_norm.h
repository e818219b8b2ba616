// RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * scale, float32 rows.
#ifndef PIJ_CPU_BACKEND_RMS_NORM_H_
#define PIJ_CPU_BACKEND_RMS_NORM_H_

#include <cstdint>
#include <span>

namespace pij {

// Normalizes rows [row_begin, row_end) of x [rows, dim] into y. scale has dim elements.
void RmsNormRows(std::span<const float> x, std::span<const float> scale, float eps, int64_t dim,
                 int64_t row_begin, int64_t row_end, std::span<float> y);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_RMS_NORM_H_
