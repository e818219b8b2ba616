// CPU FFI handlers for the dense linear ops: x f32 [..., D], w [O, D] (f32/bf16/f16, extra leading
// size-1 dims allowed for vmap), bias f32 [O] or zero-size (absent); y f32 [..., O]. linear_many:
// several (w, bias) of one dtype against the same x, as one pool job.
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_backend/linear.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "linear";

// x is f32 [..., D] (XLA checks the dtype); sets dim and rows.
ffi::Error CheckX(ffi::Buffer<ffi::F32> x, int64_t& dim, int64_t& rows) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0) return InvalidArg(kOp, "x shape", "rank >= 1 ([..., D])", "[]");
  dim = x_dims.back();
  rows = dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / dim;
  return ffi::Error::Success();
}

// One product: w [O, D] (f32/bf16/f16, leading size-1 dims allowed), bias f32 [O] or empty, y
// f32 [..., O]. `which` names the operand in errors when there are several.
ffi::Error CheckProduct(const std::string& which, int64_t dim, int64_t rows, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> y, int64_t& out_dim,
                        const float*& b) {
  const auto w_dims = w.dimensions();
  if (w_dims.size() < 2 || !LeadingOnes(w_dims, 2) || w_dims.back() != dim) {
    return InvalidArg(kOp, which + "w shape", "[O, " + std::to_string(dim) + "] (x's last dim)",
                      ShapeString(w_dims));
  }
  const ffi::DataType w_type = w.element_type();
  if (!IsWeightType(w_type)) {
    return InvalidArg(kOp, which + "w dtype", "float32, bfloat16 or float16", DtypeName(w_type));
  }
  out_dim = w_dims[w_dims.size() - 2];
  if (ffi::Error e = DecodeOptionalF32(kOp, which + "bias", bias, out_dim, b); e.failure()) {
    return e;
  }
  if (static_cast<int64_t>(y.element_count()) != rows * out_dim) {
    return InvalidArg(kOp, which + "y (result)", "float32 [..., " + std::to_string(out_dim) + "]",
                      ShapeString(y.dimensions()));
  }
  return ffi::Error::Success();
}

// One validated product, its weight not yet typed.
struct Product {
  const void* w;
  const float* bias;
  int64_t out_dim;
  float* y;
};

template <typename W>
void RunTyped(CpuRuntime& rt, const std::vector<Product>& products, int64_t dim) {
  std::vector<LinearOut<W>> outs;
  outs.reserve(products.size());
  for (const Product& p : products) {
    outs.push_back({static_cast<const W*>(p.w), p.bias, p.out_dim, p.y});
  }
  LinearMany<W>(outs, dim, rt.x_rows, rt.pool);
}

// Products of one x with weights of one dtype, as one pool job.
ffi::Error RunProducts(ffi::Buffer<ffi::F32> x, int64_t dim, int64_t rows, ffi::DataType w_type,
                       const std::vector<Product>& products) {
  if (rows == 0 || products.empty()) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, x.typed_data(), rows, dim);
    switch (w_type) {  // the one dtype dispatch
      case ffi::DataType::F32: RunTyped<float>(rt, products, dim); break;
      case ffi::DataType::BF16: RunTyped<Bf16>(rt, products, dim); break;
      default: RunTyped<F16>(rt, products, dim); break;
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // e.g. bad_alloc growing the row table: report, never abort
    return ffi::Error::Internal(std::string("linear: ") + e.what());
  }
}

ffi::Error LinearCpuImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> bias,
                         ffi::ResultBuffer<ffi::F32> y) {
  int64_t dim, rows, out_dim;
  const float* b;
  if (ffi::Error e = CheckX(x, dim, rows); e.failure()) return e;
  if (ffi::Error e = CheckProduct("", dim, rows, w, bias, *y, out_dim, b); e.failure()) return e;
  if (out_dim == 0) return ffi::Error::Success();
  return RunProducts(x, dim, rows, w.element_type(),
                     {{w.untyped_data(), b, out_dim, y->typed_data()}});
}

// linear_many: x, then n weights, then n biases (f32 [O_i] or empty); n results y_i [..., O_i].
// Every weight has the same dtype.
ffi::Error LinearManyCpuImpl(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                             ffi::RemainingRets rets) {
  int64_t dim, rows;
  if (ffi::Error e = CheckX(x, dim, rows); e.failure()) return e;
  const size_t n = rets.size();
  if (n == 0 || args.size() != 2 * n) {
    return InvalidArg(kOp, "operands", "x, n weights, n biases for n results (n >= 1)",
                      std::to_string(args.size()) + " operands after x for " +
                          std::to_string(n) + " results");
  }
  std::vector<Product> outs;
  ffi::DataType w_type = ffi::DataType::INVALID;
  for (size_t i = 0; i < n; ++i) {
    const std::string which = "[" + std::to_string(i) + "] ";
    auto w = args.get<ffi::AnyBuffer>(i);
    auto bias = args.get<ffi::Buffer<ffi::F32>>(n + i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value()) return InvalidArg(kOp, which + "w", "an array", w.error().message());
    if (!bias.has_value()) {
      return InvalidArg(kOp, which + "bias", "float32 [O] or absent (zero-size)",
                        bias.error().message());
    }
    if (!y.has_value()) {
      return InvalidArg(kOp, which + "y (result)", "float32", y.error().message());
    }
    int64_t out_dim;
    const float* b;
    if (ffi::Error e = CheckProduct(which, dim, rows, *w, *bias, **y, out_dim, b); e.failure()) {
      return e;
    }
    if (i > 0 && w->element_type() != w_type) {
      return InvalidArg(kOp, which + "w dtype", std::string(DtypeName(w_type)) + " (w[0]'s)",
                        DtypeName(w->element_type()));
    }
    w_type = w->element_type();
    if (out_dim > 0) {
      outs.push_back({w->untyped_data(), b, out_dim, (*y)->typed_data()});
    }
  }
  return RunProducts(x, dim, rows, w_type, outs);
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijLinearManyCpu, pij::LinearManyCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .RemainingArgs()  // weights (f32/bf16/f16), then f32 biases
                                  .RemainingRets());           // one y per weight
PIJ_CPU_TARGET("pij_linear_many", PijLinearManyCpu);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijLinearCpu, pij::LinearCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w: f32, bf16 or f16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // bias
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y
PIJ_CPU_TARGET("pij_linear", PijLinearCpu);
