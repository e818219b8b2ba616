// CPU FFI handlers for the quantized linear ops (cpu_backend/qlinear.h) and the embedding lookup
// on a quantized table (qembedding, below): x f32 [..., D]; blocks
// uint8 [O, row_bytes] (a GGUF tensor's raw rows, extra leading size-1 dims allowed for vmap);
// bias f32 [O] or zero-size (absent); attribute qtype (GGML type id with its arrangement:
// the file's rows, interleaved by 16 or columns, quant_formats.h Arrangement); y f32 [..., O].
// qlinear_many: x, then n blocks, then n biases; attribute qtypes (int32 [n]); n results, as one
// pool job.
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_backend/qcolumns.h"
#include "cpu_backend/qlinear.h"
#include "cpu_backend/quant_interleaved.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/quant_args.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "qlinear";

// Operands of a fixed dtype are typed (XLA checks it); shapes are checked here.
ffi::Error CheckX(ffi::Buffer<ffi::F32> x, int64_t& dim, int64_t& rows) {
  const auto dims = x.dimensions();
  if (dims.size() == 0) return InvalidArg(kOp, "x", "float32 [..., D]", "float32 []");
  dim = dims.back();
  rows = dim == 0 ? 0 : static_cast<int64_t>(x.element_count()) / dim;
  return ffi::Error::Success();
}

// One product: blocks, bias and y checked against D and the x rows; `which` names it in errors.
ffi::Error CheckProduct(const std::string& which, int64_t dim, int64_t rows,
                        ffi::Buffer<ffi::U8> blocks, int32_t qtype_id, ffi::Buffer<ffi::F32> bias,
                        ffi::Buffer<ffi::F32> y, QLinearOut& out) {
  int64_t out_dim = -1;
  KernelType kt;
  if (ffi::Error e = DecodeKernelType(kOp, which + "blocks", qtype_id,
                                      {Arrangement::kRows, Arrangement::kInterleaved,
                                       Arrangement::kColumns}, kt);
      e.failure()) {
    return e;
  }
  out.interleaved = kt.arrangement == Arrangement::kInterleaved;
  out.columns = kt.arrangement == Arrangement::kColumns;
  if (out.columns) {
    if (ffi::Error e = DecodeColumnsWeight(kOp, which + "blocks", blocks, kt.format, dim,
                                           out_dim, out.qtype);
        e.failure()) {
      return e;
    }
  } else if (ffi::Error e = DecodeQWeight(kOp, which + "blocks", blocks, kt.format, dim, out_dim,
                                          out.qtype);
             e.failure()) {
    return e;
  }
  if (out.interleaved && !qkern::CanInterleave(out.qtype, out_dim)) {
    return InvalidArg(kOp, which + "blocks (rows interleaved by 16)",
                      "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K with a multiple of 16 rows",
                      std::string(GetQTypeInfo(out.qtype).name) + " with " +
                          std::to_string(out_dim) + " rows");
  }
  if (ffi::Error e = DecodeOptionalF32(kOp, which + "bias", bias, out_dim, out.bias); e.failure()) {
    return e;
  }
  if (static_cast<int64_t>(y.element_count()) != rows * out_dim) {
    return InvalidArg(kOp, which + "y (result)", "float32 [..., " + std::to_string(out_dim) + "]",
                      ShapeString(y.dimensions()));
  }
  out.w = blocks.typed_data();
  out.out_dim = out_dim;
  out.y = y.typed_data();
  return ffi::Error::Success();
}

ffi::Error Run(ffi::Buffer<ffi::F32> x, int64_t dim, int64_t rows,
               const std::vector<QLinearOut>& outs) {
  if (rows == 0 || outs.empty()) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, x.typed_data(), rows, dim);
    QLinearMany(outs, dim, rt.x_rows, rt.qlinear, rt.pool);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("qlinear: ") + e.what());
  }
}

ffi::Error QLinearCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> blocks,
                          ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y,
                          int32_t qtype) {
  int64_t dim, rows;
  if (ffi::Error e = CheckX(x, dim, rows); e.failure()) return e;
  QLinearOut out;
  if (ffi::Error e = CheckProduct("", dim, rows, blocks, qtype, bias, *y, out); e.failure()) {
    return e;
  }
  if (out.out_dim == 0) return ffi::Error::Success();
  return Run(x, dim, rows, {out});
}

ffi::Error QLinearManyCpuImpl(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Span<const int32_t> qtypes) {
  int64_t dim, rows;
  if (ffi::Error e = CheckX(x, dim, rows); e.failure()) return e;
  const size_t n = rets.size();
  if (n == 0 || args.size() != 2 * n || qtypes.size() != n) {
    return InvalidArg(kOp, "operands", "x, n blocks, n biases and n qtypes for n results (n >= 1)",
                      std::to_string(args.size()) + " operands after x and " +
                          std::to_string(qtypes.size()) + " qtypes for " + std::to_string(n) +
                          " results");
  }
  std::vector<QLinearOut> outs;
  for (size_t i = 0; i < n; ++i) {
    const std::string which = "[" + std::to_string(i) + "] ";
    auto blocks = args.get<ffi::Buffer<ffi::U8>>(i);
    auto bias = args.get<ffi::Buffer<ffi::F32>>(n + i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (!blocks.has_value()) {
      return InvalidArg(kOp, which + "blocks", "uint8 [R, row bytes]", blocks.error().message());
    }
    if (!bias.has_value()) {
      return InvalidArg(kOp, which + "bias", "float32 [O] or absent (zero-size)",
                        bias.error().message());
    }
    if (!y.has_value()) {
      return InvalidArg(kOp, which + "y (result)", "float32", y.error().message());
    }
    QLinearOut out;
    if (ffi::Error e = CheckProduct(which, dim, rows, *blocks, qtypes[i], *bias, **y, out);
        e.failure()) {
      return e;
    }
    if (out.out_dim > 0) outs.push_back(out);
  }
  return Run(x, dim, rows, outs);
}

// qembedding: ids s32 [...], blocks u8 [V, row_bytes], attributes qtype and dim (D); y f32
// [..., D] = the rows ids of the table, dequantized. Ids outside [0, V) are an error.
ffi::Error QEmbeddingCpuImpl(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::U8> blocks,
                             ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int64_t dim) {
  constexpr std::string_view kEmbOp = "qembedding";
  int64_t vocab = -1;
  QType t;
  if (ffi::Error e = DecodeQWeight(kEmbOp, "blocks", blocks, qtype, dim, vocab, t); e.failure()) {
    return e;
  }
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (static_cast<int64_t>(y->element_count()) != n * dim) {
    return InvalidArg(kEmbOp, "y (result)", "float32 [..., " + std::to_string(dim) + "]",
                      ShapeString(y->dimensions()));
  }
  const std::span<const int32_t> id(ids.typed_data(), n);
  for (const int32_t i : id) {
    if (i < 0 || i >= vocab) {
      return InvalidArg(kEmbOp, "ids", "rows of the table, in [0, " + std::to_string(vocab) + ")",
                        std::to_string(i));
    }
  }
  DequantizeGather(blocks.typed_data(), t, dim, id, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQLinearCpu, pij::QLinearCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // blocks
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // bias
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Attr<int32_t>("qtype"));
PIJ_CPU_TARGET("pij_qlinear", PijQLinearCpu);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQEmbeddingCpu, pij::QEmbeddingCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // blocks
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Attr<int32_t>("qtype")
                                  .Attr<int64_t>("dim"));
PIJ_CPU_TARGET("pij_qembedding", PijQEmbeddingCpu);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQLinearManyCpu, pij::QLinearManyCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .RemainingArgs()  // uint8 blocks, then float32 biases
                                  .RemainingRets()             // one y per blocks
                                  .Attr<xla::ffi::Span<const int32_t>>("qtypes"));
PIJ_CPU_TARGET("pij_qlinear_many", PijQLinearManyCpu);
