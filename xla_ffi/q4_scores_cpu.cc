// CPU FFI handler for the q4 predictor's estimates (cpu_backend/q4_estimate.h):
//   x f32 [..., D]; q u8 [F, G, P * 32]; dm f16 [F, G, 4 * P]; b_up f32 [F] or zero-size;
//   attributes activation and output ("magnitude": |a_i|, the predictor's scores; "signed": a_i,
//   the coefficients of the sparse FFN's "activations" criterion); result scores f32 [..., F]. G = 2 (gated) or 1, P = ceil(D / 64).
// Weights may carry extra leading size-1 dims (vmap's expand_dims).
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/q4_estimate.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "q4_scores";

ffi::Error Q4ScoresCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer dm,
                           ffi::AnyBuffer b_up, ffi::Result<ffi::AnyBuffer> scores,
                           std::string_view activation, std::string_view output) {
  Q4EstimateArgs args;
  if (ffi::Error e = ParseActivation(kOp, activation, args.activation); e.failure()) return e;
  if (output != "magnitude" && output != "signed") {
    return InvalidArg(kOp, "output", "one of magnitude, signed", output);
  }
  args.signed_output = output == "signed";
  const auto x_dims = x.dimensions();
  if (x.element_type() != ffi::DataType::F32 || x_dims.size() == 0) {
    return InvalidArg(kOp, "x", "float32 [..., D]",
                      std::string(DtypeName(x.element_type())) + " " + ShapeString(x_dims));
  }
  const int64_t dim = x_dims.back();
  const int64_t pairs = Q4Pairs(dim);
  const auto q_dims = q.dimensions();
  if (q.element_type() != ffi::DataType::U8 || q_dims.size() < 3 || !LeadingOnes(q_dims, 3) ||
      (q_dims[q_dims.size() - 2] != 1 && q_dims[q_dims.size() - 2] != 2) ||
      q_dims.back() != pairs * kQ4PairBytes) {
    return InvalidArg(kOp, "q", "uint8 [F, G in {1, 2}, " + std::to_string(pairs * kQ4PairBytes) +
                                    "] for D = " + std::to_string(dim),
                      std::string(DtypeName(q.element_type())) + " " + ShapeString(q_dims));
  }
  const int64_t f = q_dims[q_dims.size() - 3];
  const int64_t g = q_dims[q_dims.size() - 2];
  const auto dm_dims = dm.dimensions();
  if (dm.element_type() != ffi::DataType::F16 || dm_dims.size() < 3 || !LeadingOnes(dm_dims, 3) ||
      dm_dims[dm_dims.size() - 3] != f || dm_dims[dm_dims.size() - 2] != g ||
      dm_dims.back() != 4 * pairs) {
    return InvalidArg(kOp, "dm", "float16 [" + std::to_string(f) + ", " + std::to_string(g) +
                                     ", " + std::to_string(4 * pairs) + "]",
                      std::string(DtypeName(dm.element_type())) + " " + ShapeString(dm_dims));
  }
  if (b_up.element_count() != 0) {
    const auto b_dims = b_up.dimensions();
    if (b_up.element_type() != ffi::DataType::F32 || b_dims.back() != f ||
        !LeadingOnes(b_dims, 1)) {
      return InvalidArg(kOp, "b_up", "float32 [" + std::to_string(f) + "] or absent",
                        std::string(DtypeName(b_up.element_type())) + " " + ShapeString(b_dims));
    }
    args.b_up = static_cast<const float*>(b_up.untyped_data());
  }
  const int64_t rows = dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / dim;
  if (scores->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(scores->element_count()) != rows * f) {
    return InvalidArg(kOp, "scores (result)", "float32 [..., " + std::to_string(f) + "]",
                      ShapeString(scores->dimensions()));
  }
  if (rows == 0 || f == 0) return ffi::Error::Success();
  args.q = static_cast<const uint8_t*>(q.untyped_data());
  args.dm = static_cast<const F16*>(dm.untyped_data());
  args.num_neurons = f;
  args.dim = dim;
  args.gated = g == 2;
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, static_cast<const float*>(x.untyped_data()), rows, dim);
    Q4Scores(args, rt.x_rows, static_cast<float*>(scores->untyped_data()), rt.q8_rows, rt.pool);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("q4_scores: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQ4ScoresCpu, pij::Q4ScoresCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()  // dm
                                  .Arg<xla::ffi::AnyBuffer>()  // b_up
                                  .Ret<xla::ffi::AnyBuffer>()  // scores
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("output"));
