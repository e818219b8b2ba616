// Decoding and validation of the sparse FFN custom call's operands, shared by the CPU and CUDA
// handlers so both platforms accept exactly the same calls and report the same errors.
//
// Operands (all required; an "absent" optional is passed as a zero-size array):
//   x        f32 [..., T, D]          every leading dim is a row dim ("rows" = their product)
//   w_gate   W   [1.., F, D] or empty (non-gated FFN)
//   w_up     W   [1.., F, D]          W in {f32, bf16, f16}, the same for all three weights
//   w_down_t W   [1.., F, D]
//   b_up     f32 [1.., F] or empty
//   b_down   f32 [1.., D] or empty
//   scores   f32 [..., T, F]          criteria "scores" and "activations" (ignored for "oracle")
// Results: y f32 [..., T, D], n_active s32 [..., T].
// Attributes: threshold (f32, finite, >= 0), activation ("silu" | "relu" | "gelu" | "drelu"),
// criterion ("scores" | "oracle" | "activations", see cpu_backend/sparse_ffn.h).
//
// vmap: jax.ffi.ffi_call(vmap_method="expand_dims") gives unbatched operands a leading size-1 dim.
// Weights and biases therefore accept any number of leading size-1 dims (no copy per batch
// element), and x / scores may broadcast their leading dims against y's (size 1 or equal).
#ifndef PIJ_XLA_FFI_SPARSE_FFN_ARGS_H_
#define PIJ_XLA_FFI_SPARSE_FFN_ARGS_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "cpu_backend/sparse_ffn.h"
#include "xla/ffi/api/ffi.h"

namespace pij {

namespace ffi = xla::ffi;

struct SparseFfnCall {
  ffi::DataType weight_type = ffi::DataType::INVALID;
  const void* gate = nullptr;  // nullptr: non-gated
  const void* up = nullptr;
  const void* down_t = nullptr;
  const float* b_up = nullptr;
  const float* b_down = nullptr;
  const float* x = nullptr;
  const float* scores = nullptr;  // nullptr for the oracle criterion
  float* y = nullptr;
  int32_t* n_active = nullptr;
  int64_t num_neurons = 0;  // F
  int64_t dim = 0;          // D
  int64_t rows = 0;         // product of y's leading dims
  SparseFfnParams params;
};

// Validates everything and fills `call`; x_src / score_src receive, for every output row, the
// row of x / scores it reads (they differ from the identity only under broadcasting). Never
// aborts: every violated rule comes back as an InvalidArgument error naming the operand.
ffi::Error DecodeSparseFfn(ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                           ffi::AnyBuffer w_down_t, ffi::AnyBuffer b_up, ffi::AnyBuffer b_down,
                           ffi::AnyBuffer scores, ffi::AnyBuffer y, ffi::AnyBuffer n_active,
                           float threshold, std::string_view activation,
                           std::string_view criterion, SparseFfnCall& call,
                           std::vector<int64_t>& x_src, std::vector<int64_t>& score_src);

}  // namespace pij

#endif  // PIJ_XLA_FFI_SPARSE_FFN_ARGS_H_
