// Small helpers for FFI adapters: readable shapes and dtypes in error messages, and the
// row-broadcast rule used by vmap(expand_dims).
#ifndef PIJ_XLA_FFI_FFI_UTIL_H_
#define PIJ_XLA_FFI_FFI_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/sparse_ffn.h"
#include "xla/ffi/api/ffi.h"

namespace pij {

namespace ffi = xla::ffi;

std::string ShapeString(ffi::Span<const int64_t> dims);
std::string_view DtypeName(ffi::DataType dtype);

// "<op>: <what>: expected <rule>, got <got>" -- the project's error format.
ffi::Error InvalidArg(std::string_view op, std::string_view what, std::string_view rule,
                      std::string_view got);

// The "activation" attribute ("silu" | "relu" | "gelu" | "drelu") into `out`, or an InvalidArg error.
ffi::Error ParseActivation(std::string_view op, std::string_view name, Activation& out);

// The sparse calls' selection attributes: "criterion" ("scores" | "oracle", and "activations"
// where `with_activations`) into `criterion`, and a finite `threshold` >= 0 (negative ones are
// rejected for every criterion, as SparsityConfig does: for "oracle" |a| > negative would mark
// everything active; predictor logits can be shifted instead), or an InvalidArg error.
ffi::Error ParseSelection(std::string_view op, std::string_view name, float threshold,
                          bool with_activations, Criterion& criterion);

// The "gate_floor" attribute (FATReLU's gate threshold, pij_math.h FloorGate): finite, >= 0, and
// > 0 only for a gated relu/drelu FFN; or an InvalidArg error.
ffi::Error CheckGateFloor(std::string_view op, float gate_floor, Activation activation, bool gated);

// True if dims[0 .. dims.size() - keep) are all 1 (extra leading dims added by vmap).
bool LeadingOnes(ffi::Span<const int64_t> dims, size_t keep);

// An optional float32 vector operand (a bias, norm weights, rotary frequencies): [n], with any
// leading size-1 dims (vmap's expand_dims), or zero-size when absent (then out = nullptr). Every
// adapter decodes its optional vectors here, so all accept the same shapes and report
// "<op>: <what>: expected float32 [n] or absent (zero-size), got <dtype> <shape>".
ffi::Error DecodeOptionalF32(std::string_view op, std::string_view what, ffi::AnyBuffer b,
                             int64_t n, const float*& out);
// The same for an operand XLA already typed as float32.
ffi::Error DecodeOptionalF32(std::string_view op, std::string_view what,
                             ffi::Buffer<ffi::F32> b, int64_t n, const float*& out);

// The weight dtypes the CPU kernels read: float32, bfloat16, float16.
bool IsWeightType(ffi::DataType t);

// For every row of an output whose leading (row) dims are out_dims, the index of the input row
// it reads when the input's row dims in_dims broadcast against out_dims (right-aligned; each dim
// equal or 1). Returns false if they do not broadcast.
bool BroadcastRows(ffi::Span<const int64_t> in_dims, ffi::Span<const int64_t> out_dims,
                   std::vector<int64_t>& src);

}  // namespace pij

#endif  // PIJ_XLA_FFI_FFI_UTIL_H_
