#include "xla_ffi/ffi_util.h"

#include <cmath>

namespace pij {

std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::string_view DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::PRED: return "bool";
    default: return "another dtype";
  }
}

ffi::Error InvalidArg(std::string_view op, std::string_view what, std::string_view rule,
                      std::string_view got) {
  std::string msg;
  msg.append(op).append(": ").append(what).append(": expected ").append(rule);
  msg.append(", got ").append(got);
  return ffi::Error::InvalidArgument(std::move(msg));
}

bool LeadingOnes(ffi::Span<const int64_t> dims, size_t keep) {
  if (dims.size() < keep) return false;
  for (size_t i = 0; i + keep < dims.size(); ++i) {
    if (dims[i] != 1) return false;
  }
  return true;
}

namespace {

ffi::Error OptionalF32(std::string_view op, std::string_view what, ffi::DataType type,
                       ffi::Span<const int64_t> dims, size_t count, const void* data, int64_t n,
                       const float*& out) {
  out = nullptr;
  if (count == 0) return ffi::Error::Success();
  if (type != ffi::DataType::F32 || dims.size() == 0 || dims.back() != n ||
      !LeadingOnes(dims, 1)) {
    return InvalidArg(op, what, "float32 [" + std::to_string(n) + "] or absent (zero-size)",
                      std::string(DtypeName(type)) + " " + ShapeString(dims));
  }
  out = static_cast<const float*>(data);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error DecodeOptionalF32(std::string_view op, std::string_view what, ffi::AnyBuffer b,
                             int64_t n, const float*& out) {
  return OptionalF32(op, what, b.element_type(), b.dimensions(), b.element_count(),
                     b.untyped_data(), n, out);
}

ffi::Error DecodeOptionalF32(std::string_view op, std::string_view what,
                             ffi::Buffer<ffi::F32> b, int64_t n, const float*& out) {
  return OptionalF32(op, what, b.element_type(), b.dimensions(), b.element_count(),
                     b.untyped_data(), n, out);
}

bool BroadcastRows(ffi::Span<const int64_t> in_dims, ffi::Span<const int64_t> out_dims,
                   std::vector<int64_t>& src) {
  const size_t rank = out_dims.size();
  if (in_dims.size() > rank) {  // extra input dims must be size-1 padding
    for (size_t i = 0; i < in_dims.size() - rank; ++i) {
      if (in_dims[i] != 1) return false;
    }
  }
  // Input stride of each output dim; 0 where the input broadcasts (size 1 or missing).
  std::vector<int64_t> stride(rank, 0);
  int64_t s = 1;
  for (size_t k = 0; k < rank; ++k) {
    const size_t o = rank - 1 - k;
    const int64_t in = k < in_dims.size() ? in_dims[in_dims.size() - 1 - k] : 1;
    if (in != out_dims[o] && in != 1) return false;
    stride[o] = (in == out_dims[o] && in != 1) ? s : 0;
    s *= in;
  }
  int64_t rows = 1;
  for (const int64_t d : out_dims) rows *= d;
  src.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rest = r;
    int64_t idx = 0;
    for (size_t k = 0; k < rank; ++k) {
      const size_t o = rank - 1 - k;
      idx += (rest % out_dims[o]) * stride[o];
      rest /= out_dims[o];
    }
    src[r] = idx;
  }
  return true;
}

ffi::Error ParseActivation(std::string_view op, std::string_view name, Activation& out) {
  if (name == "silu") {
    out = Activation::kSilu;
  } else if (name == "relu") {
    out = Activation::kRelu;
  } else if (name == "gelu") {
    out = Activation::kGelu;
  } else if (name == "drelu") {
    out = Activation::kDrelu;
  } else {
    return InvalidArg(op, "activation", "one of silu, relu, gelu, drelu", name);
  }
  return ffi::Error::Success();
}

ffi::Error CheckGateFloor(std::string_view op, float gate_floor, Activation activation,
                          bool gated) {
  if (!std::isfinite(gate_floor) || gate_floor < 0.0f) {
    return InvalidArg(op, "gate_floor", "a finite number >= 0", std::to_string(gate_floor));
  }
  if (gate_floor > 0.0f &&
      !(gated && (activation == Activation::kRelu || activation == Activation::kDrelu))) {
    return InvalidArg(op, "gate_floor", "0 unless the FFN is gated with relu or drelu (FATReLU)",
                      std::to_string(gate_floor));
  }
  return ffi::Error::Success();
}

ffi::Error ParseSelection(std::string_view op, std::string_view name, float threshold,
                          bool with_activations, Criterion& criterion) {
  if (name == "scores") {
    criterion = Criterion::kScores;
  } else if (name == "oracle") {
    criterion = Criterion::kOracle;
  } else if (with_activations && name == "activations") {
    criterion = Criterion::kActivations;
  } else {
    return InvalidArg(op, "criterion",
                      with_activations ? "one of scores, oracle, activations"
                                       : "one of scores, oracle",
                      name);
  }
  if (!std::isfinite(threshold) || threshold < 0.0f) {
    return InvalidArg(op, "threshold", "a finite number >= 0", std::to_string(threshold));
  }
  return ffi::Error::Success();
}

bool IsWeightType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

}  // namespace pij
