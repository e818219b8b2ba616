// CPU FFI handler for RMSNorm: x f32 [..., D], scale f32 [..1, D], attribute eps > 0.
#include <cmath>
#include <mutex>
#include <span>
#include <string>

#include "cpu_backend/rms_norm.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "rms_norm";
// Rows of this many elements or more are split over the pool; smaller calls run inline.
constexpr int64_t kParallelMinElements = 1 << 16;

ffi::Error RmsNormCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                          float eps) {
  const auto x_dims = x.dimensions();
  if (x.element_type() != ffi::DataType::F32) {
    return InvalidArg(kOp, "x dtype", "float32", DtypeName(x.element_type()));
  }
  if (x_dims.size() == 0) return InvalidArg(kOp, "x shape", "rank >= 1 ([..., D])", "[]");
  const int64_t dim = x_dims.back();
  const auto s_dims = scale.dimensions();
  if (scale.element_type() != ffi::DataType::F32 || s_dims.size() == 0 || s_dims.back() != dim ||
      !LeadingOnes(s_dims, 1)) {
    return InvalidArg(kOp, "scale", "float32 [..1, " + std::to_string(dim) + "]",
                      std::string(DtypeName(scale.element_type())) + " " + ShapeString(s_dims));
  }
  if (!(std::isfinite(eps) && eps > 0.0f)) {
    return InvalidArg(kOp, "eps", "a finite positive number", std::to_string(eps));
  }
  if (y->element_type() != ffi::DataType::F32 || y->element_count() != x.element_count()) {
    return InvalidArg(kOp, "y (result)", "float32 with x's shape " + ShapeString(x_dims),
                      ShapeString(y->dimensions()));
  }
  const int64_t total = static_cast<int64_t>(x.element_count());
  if (total == 0) return ffi::Error::Success();
  const int64_t rows = total / dim;
  std::span<const float> x_span(static_cast<const float*>(x.untyped_data()), total);
  std::span<const float> s_span(static_cast<const float*>(scale.untyped_data()), dim);
  std::span<float> y_span(static_cast<float*>(y->untyped_data()), total);
  if (total < kParallelMinElements) {
    RmsNormRows(x_span, s_span, eps, dim, 0, rows, y_span);
    return ffi::Error::Success();
  }
  CpuRuntime& rt = GetCpuRuntime();
  std::lock_guard<std::mutex> lock(rt.mutex);  // one pool job at a time, as every handler
  const int64_t chunks = rt.pool.NumThreads();
  rt.pool.Run(0, chunks, [&](int64_t c, int /*worker*/) {
    RmsNormRows(x_span, s_span, eps, dim, rows * c / chunks, rows * (c + 1) / chunks, y_span);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijRmsNormCpu, pij::RmsNormCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // scale
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Attr<float>("eps"));
