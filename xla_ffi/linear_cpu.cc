// CPU FFI handler for the dense linear op: x f32 [..., D], w [O, D] (f32/bf16/f16, extra leading
// size-1 dims allowed for vmap), bias f32 [O] or zero-size (absent); y f32 [..., O].
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/linear.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "linear";

ffi::Error LinearCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                         ffi::Result<ffi::AnyBuffer> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x.element_type() != ffi::DataType::F32) {
    return InvalidArg(kOp, "x dtype", "float32", DtypeName(x.element_type()));
  }
  if (x_dims.size() == 0) return InvalidArg(kOp, "x shape", "rank >= 1 ([..., D])", "[]");
  const int64_t dim = x_dims.back();
  if (w_dims.size() < 2 || !LeadingOnes(w_dims, 2) || w_dims.back() != dim) {
    return InvalidArg(kOp, "w shape", "[O, " + std::to_string(dim) + "] (x's last dim)",
                      ShapeString(w_dims));
  }
  const ffi::DataType w_type = w.element_type();
  if (w_type != ffi::DataType::F32 && w_type != ffi::DataType::BF16 &&
      w_type != ffi::DataType::F16) {
    return InvalidArg(kOp, "w dtype", "float32, bfloat16 or float16", DtypeName(w_type));
  }
  const int64_t out_dim = w_dims[w_dims.size() - 2];
  const float* b = nullptr;
  if (bias.element_count() != 0) {
    const auto b_dims = bias.dimensions();
    if (bias.element_type() != ffi::DataType::F32 || b_dims.back() != out_dim ||
        !LeadingOnes(b_dims, 1)) {
      return InvalidArg(kOp, "bias", "float32 [" + std::to_string(out_dim) + "] or absent",
                        std::string(DtypeName(bias.element_type())) + " " + ShapeString(b_dims));
    }
    b = static_cast<const float*>(bias.untyped_data());
  }
  const int64_t rows = dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / dim;
  if (y->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(y->element_count()) != rows * out_dim) {
    return InvalidArg(kOp, "y (result)", "float32 [..., " + std::to_string(out_dim) + "]",
                      ShapeString(y->dimensions()));
  }
  if (rows == 0 || out_dim == 0) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, static_cast<const float*>(x.untyped_data()), rows, dim);
    float* y_data = static_cast<float*>(y->untyped_data());
    const void* w_data = w.untyped_data();
    switch (w_type) {  // the one dtype dispatch
      case ffi::DataType::F32:
        Linear(static_cast<const float*>(w_data), b, out_dim, dim, rt.x_rows, y_data, rt.pool);
        break;
      case ffi::DataType::BF16:
        Linear(static_cast<const Bf16*>(w_data), b, out_dim, dim, rt.x_rows, y_data, rt.pool);
        break;
      default:
        Linear(static_cast<const F16*>(w_data), b, out_dim, dim, rt.x_rows, y_data, rt.pool);
        break;
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // e.g. bad_alloc growing the row table: report, never abort
    return ffi::Error::Internal(std::string("linear: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijLinearCpu, pij::LinearCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w
                                  .Arg<xla::ffi::AnyBuffer>()  // bias
                                  .Ret<xla::ffi::AnyBuffer>());  // y
