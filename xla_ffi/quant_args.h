// Validation of quantized-weight operands, shared by the qlinear and qsparse_ffn handlers.
#ifndef PIJ_XLA_FFI_QUANT_ARGS_H_
#define PIJ_XLA_FFI_QUANT_ARGS_H_

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "cpu_backend/quant_formats.h"
#include "xla/ffi/api/ffi.h"

namespace pij {

namespace ffi = xla::ffi;

// A type id (a format and its arrangement, quant_formats.h SplitKernelType) split, its
// arrangement one of `allowed`; else an InvalidArg naming `what`, the arrangements it takes and
// the id. The format is checked by the Decode* below.
ffi::Error DecodeKernelType(std::string_view op, std::string_view what, int32_t id,
                            std::initializer_list<Arrangement> allowed, KernelType& out);

// The type ids of a gated FFN's experts (moe_ffn, expert_ffn), split: gate and up the file's
// rows or interleaved by 16 (or, where `columns`, in the columns layout), down also down groups.
ffi::Error DecodeExpertTypes(std::string_view op, int32_t gate_id, int32_t up_id,
                             int32_t down_id, KernelType& gate, KernelType& up, KernelType& down,
                             bool columns = false);

// `qtype_id` a block format of quant_formats.h, `dim` a multiple of its block, and `blocks` uint8
// (typed: XLA checks it) [1.., R, QRowBytes(qtype, dim)]. rows: R to require, or -1 to read it
// from blocks.
ffi::Error DecodeQWeight(std::string_view op, std::string_view what, ffi::Buffer<ffi::U8> blocks,
                         int32_t qtype_id, int64_t dim, int64_t& rows, QType& qtype);

// The same for a matrix in the columns layout (cpu_backend/qcolumns.h): uint8 [1.., R,
// ColumnsRowBytes(qtype, dim)], R a positive multiple of 64, qtype a format with that layout.
ffi::Error DecodeColumnsWeight(std::string_view op, std::string_view what,
                               ffi::Buffer<ffi::U8> blocks,
                               int32_t qtype_id, int64_t dim, int64_t& rows, QType& qtype);

}  // namespace pij

#endif  // PIJ_XLA_FFI_QUANT_ARGS_H_
