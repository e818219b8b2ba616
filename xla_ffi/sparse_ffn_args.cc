#include "xla_ffi/sparse_ffn_args.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "sparse_ffn";

using Dims = ffi::Span<const int64_t>;

Dims Leading(Dims dims, size_t drop) {
  return Dims(dims.begin(), dims.size() >= drop ? dims.size() - drop : 0);
}

std::string FDRule(int64_t f, int64_t d) {
  return "shape [..1, F, D] = [" + std::to_string(f) + ", " + std::to_string(d) +
         "] (leading dims 1)";
}

// Checks one weight matrix against the dtype and [F, D] established by w_up.
ffi::Error CheckWeight(std::string_view name, ffi::AnyBuffer w, ffi::DataType type, int64_t f,
                       int64_t d) {
  if (w.element_type() != type) {
    return InvalidArg(kOp, std::string(name) + " dtype",
                      "the same dtype as w_up (" + std::string(DtypeName(type)) + ")",
                      DtypeName(w.element_type()));
  }
  const Dims dims = w.dimensions();
  if (dims.size() < 2 || dims[dims.size() - 2] != f || dims.back() != d || !LeadingOnes(dims, 2)) {
    return InvalidArg(kOp, std::string(name) + " shape", FDRule(f, d), ShapeString(dims));
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DecodeSparseFfn(ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                           ffi::AnyBuffer w_down_t, ffi::AnyBuffer b_up, ffi::AnyBuffer b_down,
                           ffi::AnyBuffer scores, ffi::AnyBuffer y, ffi::AnyBuffer n_active,
                           float threshold, std::string_view activation,
                           std::string_view criterion, SparseFfnCall& call,
                           std::vector<int64_t>& x_src, std::vector<int64_t>& score_src) {
  // Attributes.
  SparseFfnParams& p = call.params;
  if (ffi::Error err = ParseActivation(kOp, activation, p.activation); err.failure()) {
    return err;
  }
  if (ffi::Error err = ParseSelection(kOp, criterion, threshold, true, p.criterion);
      err.failure()) {
    return err;
  }
  p.threshold = threshold;

  // x and y define rows and D.
  if (x.element_type() != ffi::DataType::F32) {
    return InvalidArg(kOp, "x dtype", "float32", DtypeName(x.element_type()));
  }
  const Dims x_dims = x.dimensions();
  const Dims y_dims = y.dimensions();
  if (x_dims.size() < 2) {
    return InvalidArg(kOp, "x shape", "rank >= 2 ([..., T, D])", ShapeString(x_dims));
  }
  const int64_t d = x_dims.back();
  const Dims up_dims = w_up.dimensions();
  if (up_dims.size() < 2 || up_dims.back() != d) {
    return InvalidArg(kOp, "w_up shape", "[..1, F, D] with D = " + std::to_string(d) + " (x's last dim)",
                      ShapeString(up_dims));
  }
  if (y.element_type() != ffi::DataType::F32 || y_dims.size() < 2 || y_dims.back() != d) {
    return InvalidArg(kOp, "y (result)", "float32 [..., T, D] with D = " + std::to_string(d),
                      std::string(DtypeName(y.element_type())) + " " + ShapeString(y_dims));
  }
  const Dims row_dims = Leading(y_dims, 1);
  if (!BroadcastRows(Leading(x_dims, 1), row_dims, x_src)) {
    return InvalidArg(kOp, "x shape",
                      "leading dims broadcastable to the result's " + ShapeString(row_dims),
                      ShapeString(x_dims));
  }
  call.rows = static_cast<int64_t>(x_src.size());
  const Dims n_dims = n_active.dimensions();
  if (n_active.element_type() != ffi::DataType::S32 || n_dims.size() != row_dims.size() ||
      !std::equal(n_dims.begin(), n_dims.end(), row_dims.begin())) {
    return InvalidArg(kOp, "n_active (result)", "int32 " + ShapeString(row_dims),
                      std::string(DtypeName(n_active.element_type())) + " " +
                          ShapeString(n_dims));
  }

  // Weights: w_up fixes the dtype and F.
  const ffi::DataType wt = w_up.element_type();
  if (!IsWeightType(wt)) {
    return InvalidArg(kOp, "w_up dtype", "float32, bfloat16 or float16", DtypeName(wt));
  }
  const int64_t f = up_dims[up_dims.size() - 2];
  if (ffi::Error e = CheckWeight("w_up", w_up, wt, f, d); e.failure()) return e;
  if (ffi::Error e = CheckWeight("w_down_t", w_down_t, wt, f, d); e.failure()) return e;
  call.gate = nullptr;
  if (w_gate.element_count() != 0) {
    if (ffi::Error e = CheckWeight("w_gate", w_gate, wt, f, d); e.failure()) return e;
    call.gate = w_gate.untyped_data();
  }
  if (f > INT32_MAX) {
    return InvalidArg(kOp, "F (neurons)", "< 2^31", std::to_string(f));
  }
  if (ffi::Error e = DecodeOptionalF32(kOp, "b_up", b_up, f, call.b_up); e.failure()) return e;
  if (ffi::Error e = DecodeOptionalF32(kOp, "b_down", b_down, d, call.b_down); e.failure()) {
    return e;
  }

  // Scores.
  call.scores = nullptr;
  score_src.clear();
  if (p.criterion != Criterion::kOracle) {
    const Dims s_dims = scores.dimensions();
    if (scores.element_type() != ffi::DataType::F32) {
      return InvalidArg(kOp, "scores dtype", "float32", DtypeName(scores.element_type()));
    }
    if (s_dims.size() < 2 || s_dims.back() != f ||
        !BroadcastRows(Leading(s_dims, 1), row_dims, score_src)) {
      return InvalidArg(kOp, "scores shape",
                        "[..., T, F] with F = " + std::to_string(f) +
                            " and leading dims broadcastable to " + ShapeString(row_dims),
                        ShapeString(s_dims));
    }
    call.scores = static_cast<const float*>(scores.untyped_data());
  }

  call.weight_type = wt;
  call.up = w_up.untyped_data();
  call.down_t = w_down_t.untyped_data();
  call.x = static_cast<const float*>(x.untyped_data());
  call.y = static_cast<float*>(y.untyped_data());
  call.n_active = static_cast<int32_t*>(n_active.untyped_data());
  call.num_neurons = f;
  call.dim = d;
  return ffi::Error::Success();
}

}  // namespace pij
