// CPU FFI handlers of the q4 predictor (cpu_backend/q4_estimate.h) and the q4 FFN
// (cpu_backend/q4_ffn.h). Shared operands: x f32 [..., D]; q u8 [F, G, P * 32]; dm f16
// [F, G, 4 * P]; b_up f32 [F] or zero-size; G = 2 (gated) or 1, P = ceil(D / 64).
//   pij_q4_scores: attributes activation and output ("magnitude": |a_i|, the predictor's scores;
//     "signed": a_i); result scores f32 [..., F].
//   pij_q4_sparse_ffn: also down_t [F, D] and b_down; see Q4SparseFfnCpuImpl.
// Weights may carry extra leading size-1 dims (vmap's expand_dims).
#include <algorithm>
#include <cmath>
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/q4_estimate.h"
#include "cpu_backend/q4_ffn.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "q4_scores";

// x, q, dm, b_up -> args (q, dm, b_up, F, D, gated) and the number of token rows. XLA checks
// the dtypes (typed operands); the shapes are checked here.
ffi::Error DecodeQ4(std::string_view op, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F16> dm, ffi::Buffer<ffi::F32> b_up, Q4EstimateArgs& args,
                    int64_t& rows) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0) return InvalidArg(op, "x", "float32 [..., D]", "float32 []");
  const int64_t dim = x_dims.back();
  const int64_t pairs = Q4Pairs(dim);
  const auto q_dims = q.dimensions();
  if (q_dims.size() < 3 || !LeadingOnes(q_dims, 3) ||
      (q_dims[q_dims.size() - 2] != 1 && q_dims[q_dims.size() - 2] != 2) ||
      q_dims.back() != pairs * kQ4PairBytes) {
    return InvalidArg(op, "q", "uint8 [F, G in {1, 2}, " + std::to_string(pairs * kQ4PairBytes) +
                                   "] for D = " + std::to_string(dim),
                      "uint8 " + ShapeString(q_dims));
  }
  const int64_t f = q_dims[q_dims.size() - 3];
  const int64_t g = q_dims[q_dims.size() - 2];
  const auto dm_dims = dm.dimensions();
  if (dm_dims.size() < 3 || !LeadingOnes(dm_dims, 3) ||
      dm_dims[dm_dims.size() - 3] != f || dm_dims[dm_dims.size() - 2] != g ||
      dm_dims.back() != 4 * pairs) {
    return InvalidArg(op, "dm", "float16 [" + std::to_string(f) + ", " + std::to_string(g) +
                                    ", " + std::to_string(4 * pairs) + "]",
                      "float16 " + ShapeString(dm_dims));
  }
  if (ffi::Error e = DecodeOptionalF32(op, "b_up", b_up, f, args.b_up); e.failure()) return e;
  rows = dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / dim;
  args.q = q.typed_data();
  args.dm = static_cast<const F16*>(dm.untyped_data());
  args.num_neurons = f;
  args.dim = dim;
  args.gated = g == 2;
  return ffi::Error::Success();
}

ffi::Error Q4ScoresCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                           ffi::Buffer<ffi::F16> dm, ffi::Buffer<ffi::F32> b_up,
                           ffi::ResultBuffer<ffi::F32> scores,
                           std::string_view activation, std::string_view output) {
  Q4EstimateArgs args;
  if (ffi::Error e = ParseActivation(kOp, activation, args.activation); e.failure()) return e;
  if (output != "magnitude" && output != "signed") {
    return InvalidArg(kOp, "output", "one of magnitude, signed", output);
  }
  args.signed_output = output == "signed";
  int64_t rows = 0;
  if (ffi::Error e = DecodeQ4(kOp, x, q, dm, b_up, args, rows); e.failure()) return e;
  const int64_t f = args.num_neurons;
  if (static_cast<int64_t>(scores->element_count()) != rows * f) {
    return InvalidArg(kOp, "scores (result)", "float32 [..., " + std::to_string(f) + "]",
                      ShapeString(scores->dimensions()));
  }
  if (rows == 0 || f == 0) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, x.typed_data(), rows, args.dim);
    Q4Scores(args, rt.x_rows, scores->typed_data(), rt.q8_rows, rt.pool);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("q4_scores: ") + e.what());
  }
}

constexpr std::string_view kFfnOp = "q4_sparse_ffn";

// The q4 FFN (cpu_backend/q4_ffn.h): x, q, dm, b_up as q4_scores; down_t [F, D] (f32/bf16/f16),
// b_down f32 [D] or zero-size; attributes activation, threshold; results y f32 [..., D] and
// n_active s32 [...].
ffi::Error Q4SparseFfnCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                              ffi::Buffer<ffi::F16> dm, ffi::Buffer<ffi::F32> b_up,
                              ffi::AnyBuffer down_t, ffi::Buffer<ffi::F32> b_down,
                              ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::S32> n_active,
                              std::string_view activation, float threshold) {
  Q4EstimateArgs args;
  if (ffi::Error e = ParseActivation(kFfnOp, activation, args.activation); e.failure()) return e;
  if (!std::isfinite(threshold) || threshold < 0.0f) {
    return InvalidArg(kFfnOp, "threshold", "a finite number >= 0", std::to_string(threshold));
  }
  int64_t rows = 0;
  if (ffi::Error e = DecodeQ4(kFfnOp, x, q, dm, b_up, args, rows); e.failure()) return e;
  const int64_t f = args.num_neurons;
  const int64_t d = args.dim;
  const auto w_dims = down_t.dimensions();
  const ffi::DataType wt = down_t.element_type();
  if (!IsWeightType(wt) || w_dims.size() < 2 || !LeadingOnes(w_dims, 2) ||
      w_dims[w_dims.size() - 2] != f || w_dims.back() != d) {
    return InvalidArg(kFfnOp, "down_t", "float32/bfloat16/float16 [" + std::to_string(f) + ", " +
                                            std::to_string(d) + "] (F from q, D from x)",
                      std::string(DtypeName(wt)) + " " + ShapeString(w_dims));
  }
  const float* bd = nullptr;
  if (ffi::Error e = DecodeOptionalF32(kFfnOp, "b_down", b_down, d, bd); e.failure()) return e;
  if (static_cast<int64_t>(y->element_count()) != rows * d ||
      static_cast<int64_t>(n_active->element_count()) != rows) {
    return InvalidArg(kFfnOp, "results", "float32 [..., " + std::to_string(d) + "] and int32 [...]",
                      ShapeString(y->dimensions()) + ", " + ShapeString(n_active->dimensions()));
  }
  if (rows == 0) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, x.typed_data(), rows, d);
    float* yp = y->typed_data();
    int32_t* np = n_active->typed_data();
    if (f == 0) {  // no neurons: y = b_down
      for (int64_t j = 0; j < rows * d; ++j) yp[j] = bd != nullptr ? bd[j % d] : 0.0f;
      std::fill_n(np, rows, 0);
      return ffi::Error::Success();
    }
    const void* w = down_t.untyped_data();
    switch (wt) {
      case ffi::DataType::F32:
        Q4SparseFfn(args, static_cast<const float*>(w), bd, threshold, rt.x_rows, yp, np,
                    rt.q4_ffn, rt.pool);
        break;
      case ffi::DataType::BF16:
        Q4SparseFfn(args, static_cast<const Bf16*>(w), bd, threshold, rt.x_rows, yp, np,
                    rt.q4_ffn, rt.pool);
        break;
      default:
        Q4SparseFfn(args, static_cast<const F16*>(w), bd, threshold, rt.x_rows, yp, np,
                    rt.q4_ffn, rt.pool);
        break;
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("q4_sparse_ffn: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQ4ScoresCpu, pij::Q4ScoresCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // dm
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // b_up
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scores
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("output"));
PIJ_CPU_TARGET("pij_q4_scores", PijQ4ScoresCpu);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQ4SparseFfnCpu, pij::Q4SparseFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F16>>()  // dm
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // b_up
                                  .Arg<xla::ffi::AnyBuffer>()  // down_t: f32, bf16 or f16
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // b_down
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // n_active
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("threshold"));
PIJ_CPU_TARGET("pij_q4_sparse_ffn", PijQ4SparseFfnCpu);
