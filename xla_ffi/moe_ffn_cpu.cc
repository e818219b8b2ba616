// CPU FFI handler of the MoE FFN on quantized experts (cpu_backend/moe_ffn.h):
// x f32 [N, D]; ids s32 [N, k] (each token's experts, in [0, E)); weights f32 [N, k]; gate, up
// uint8 [E, F, row_bytes(D)]; down uint8 [E, D, row_bytes(F)] (a GGUF file's ffn_*_exps as
// stored; each expert's rows interleaved by 16, or in the columns layout: [E, rows,
// ColumnsRowBytes]) or, with down_qtype's arrangement down groups, each expert's down groups
// uint8 [E, F / 32, D * block bytes] (relu experts, sparse inside); mid_thresholds f32 [E, F]
// (down's input zeroed below them: input sparsity) or [0] (none); attributes gate_qtype,
// up_qtype, down_qtype (GGML type ids with their arrangement, quant_formats.h), activation
// ("silu" | "relu"); results y f32 [N, D] and kept s32 [N] (each token's nonzero channels of
// down's input, summed over its routed experts).
#include <algorithm>
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/moe_ffn.h"
#include "cpu_backend/qcolumns.h"
#include "cpu_backend/quant_interleaved.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/quant_args.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "moe_ffn";

// One stacked expert matrix: uint8 [E, rows, row bytes of `cols` weights in its qtype], each
// expert's rows as the file stores them, interleaved by 16 or in the columns layout (the type
// id's arrangement, quant_formats.h). `kt`: the id already split.
ffi::Error CheckStack(std::string_view what, ffi::Buffer<ffi::U8> b, KernelType kt, int64_t e,
                      int64_t rows, int64_t cols, QType& t, bool& interleaved, bool& columns) {
  const std::string w(what);
  interleaved = kt.arrangement == Arrangement::kInterleaved;
  columns = kt.arrangement == Arrangement::kColumns;
  const int32_t qtype_id = kt.format;
  if (!IsQType(qtype_id)) {
    return InvalidArg(kOp, w + " qtype", "a GGML block type id (Q4_0=2 ... Q6_K=14)",
                      std::to_string(qtype_id));
  }
  t = static_cast<QType>(qtype_id);
  const QTypeInfo info = GetQTypeInfo(t);
  if (interleaved && !qkern::CanInterleave(t, rows)) {
    return InvalidArg(kOp, w + " (each expert's rows interleaved by 16)",
                      "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K with a multiple of 16 rows",
                      std::string(info.name) + " with " + std::to_string(rows) + " rows");
  }
  if (cols % info.block != 0) {
    return InvalidArg(kOp, w + " row length", "a multiple of the " + std::string(info.name) +
                                                   " block (" + std::to_string(info.block) + ")",
                      std::to_string(cols));
  }
  if (columns && !CanArrangeColumns(t, rows, cols)) {  // cols is a multiple of the block here
    return InvalidArg(kOp, w + " (each expert in the columns layout)",
                      "Q4_0, Q4_1, Q8_0, Q4_K or Q6_K with a multiple of 64 rows",
                      std::string(info.name) + " with " + std::to_string(rows) + " rows");
  }
  const auto dims = b.dimensions();
  const int64_t rb = columns ? ColumnsRowBytes(t, rows, cols) : QRowBytes(t, cols);
  if (dims.size() != 3 || dims[0] != e || dims[1] != rows || dims[2] != rb) {
    return InvalidArg(kOp, w,
                      "uint8 [" + std::to_string(e) + ", " + std::to_string(rows) + ", " +
                          std::to_string(rb) + "] (" + info.name +
                          (columns ? " in columns, rows of " : " rows of ") +
                          std::to_string(cols) + ")",
                      "uint8 " + ShapeString(dims));
  }
  return ffi::Error::Success();
}

// Each expert's down groups: uint8 [E, F / 32, D * block bytes] of a 32-weight format.
// qtype_id: the format's id; id: the type id as given (for the message).
ffi::Error CheckGroups(ffi::Buffer<ffi::U8> b, int32_t qtype_id, int32_t id, int64_t e, int64_t f,
                       int64_t d, QType& t) {
  if (!IsQType(qtype_id) || DownGroupScaleBytes(static_cast<QType>(qtype_id)) == 0) {
    return InvalidArg(kOp, "down_qtype (down groups)",
                      "a 32-weight format id: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8 (+1024)",
                      std::to_string(id));
  }
  t = static_cast<QType>(qtype_id);
  if (f % 32 != 0 || d % 32 != 0) {
    return InvalidArg(kOp, "F and D (down groups)", "multiples of 32",
                      std::to_string(f) + " and " + std::to_string(d));
  }
  const auto dims = b.dimensions();
  const int64_t bytes = d * GetQTypeInfo(t).bytes;
  if (dims.size() != 3 || dims[0] != e || dims[1] != f / 32 || dims[2] != bytes) {
    return InvalidArg(kOp, "down (groups of 32 neurons)",
                      "uint8 [" + std::to_string(e) + ", " + std::to_string(f / 32) + ", " +
                          std::to_string(bytes) + "]",
                      "uint8 " + ShapeString(dims));
  }
  return ffi::Error::Success();
}

// Every operand has one dtype (typed: XLA checks it); shapes and type ids are checked here.
ffi::Error MoeFfnCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::U8> gate,
                         ffi::Buffer<ffi::U8> up, ffi::Buffer<ffi::U8> down,
                         ffi::Buffer<ffi::F32> mid_thresholds, ffi::ResultBuffer<ffi::F32> y,
                         ffi::ResultBuffer<ffi::S32> kept, int32_t gate_qtype, int32_t up_qtype,
                         int32_t down_qtype, std::string_view activation) {
  const auto xd = x.dimensions(), idd = ids.dimensions(), gd = gate.dimensions();
  if (xd.size() != 2) return InvalidArg(kOp, "x", "float32 [N, D]", "float32 " + ShapeString(xd));
  const int64_t n = xd[0], d = xd[1];
  if (idd.size() != 2 || idd[0] != n || idd[1] < 1) {
    return InvalidArg(kOp, "ids", "int32 [" + std::to_string(n) + ", k >= 1]",
                      "int32 " + ShapeString(idd));
  }
  const int64_t k = idd[1];
  if (ShapeString(weights.dimensions()) != ShapeString(idd)) {
    return InvalidArg(kOp, "weights", "float32 " + ShapeString(idd),
                      "float32 " + ShapeString(weights.dimensions()));
  }
  if (gd.size() != 3) {
    return InvalidArg(kOp, "gate", "uint8 [E, F, row bytes]", ShapeString(gd));
  }
  const int64_t e = gd[0], f = gd[1];
  MoeExperts w{};
  KernelType gate_kt, up_kt, down_kt;
  if (ffi::Error err = DecodeExpertTypes(kOp, gate_qtype, up_qtype, down_qtype, gate_kt, up_kt,
                                         down_kt, /*columns=*/true);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckStack("gate", gate, gate_kt, e, f, d, w.gate_t, w.gate_il,
                                  w.gate_col);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = CheckStack("up", up, up_kt, e, f, d, w.up_t, w.up_il, w.up_col);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = ParseActivation(kOp, activation, w.activation); err.failure()) return err;
  if (w.activation != Activation::kSilu && w.activation != Activation::kRelu) {
    return InvalidArg(kOp, "activation", "silu or relu", std::string(activation));
  }
  if (down_kt.arrangement == Arrangement::kDownGroups) {
    if (w.activation != Activation::kRelu || (w.up_il && !w.gate_il) || w.gate_col ||
        w.up_col || mid_thresholds.element_count() != 0) {
      return InvalidArg(kOp, "down groups (the sparse path)",
                        "relu experts, up rows interleaved only under an interleaved gate, no "
                        "columns layout, no mid_thresholds",
                        std::string(activation) + (w.up_il ? ", up interleaved" : "") +
                            (w.gate_il ? ", gate interleaved" : "") +
                            (w.gate_col || w.up_col ? ", columns" : "") +
                            (mid_thresholds.element_count() ? ", mid_thresholds" : ""));
    }
    if (ffi::Error err = CheckGroups(down, down_kt.format, down_qtype, e, f, d, w.down_t);
        err.failure()) {
      return err;
    }
    w.down_groups = true;
  } else if (ffi::Error err =
                 CheckStack("down", down, down_kt, e, d, f, w.down_t, w.down_il, w.down_col);
             err.failure()) {
    return err;
  }
  const auto md = mid_thresholds.dimensions();
  if (mid_thresholds.element_count() != 0 && (md.size() != 2 || md[0] != e || md[1] != f)) {
    return InvalidArg(kOp, "mid_thresholds",
                      "float32 [" + std::to_string(e) + ", " + std::to_string(f) + "] or [0]",
                      "float32 " + ShapeString(md));
  }
  if (k > e) {
    return InvalidArg(kOp, "ids' k (experts per token)",
                      "at most the number of experts (" + std::to_string(e) + ")",
                      std::to_string(k));
  }
  if (static_cast<int64_t>(y->element_count()) != n * d) {
    return InvalidArg(kOp, "y (result)", "float32 [" + std::to_string(n) + ", " +
                                             std::to_string(d) + "]",
                      ShapeString(y->dimensions()));
  }
  if (static_cast<int64_t>(kept->element_count()) != n) {
    return InvalidArg(kOp, "kept (result)", "int32 [" + std::to_string(n) + "]",
                      ShapeString(kept->dimensions()));
  }
  const int32_t* id = ids.typed_data();
  for (int64_t p = 0; p < n * k; ++p) {
    if (id[p] < -1 || id[p] >= e) {
      return InvalidArg(kOp, "ids", "experts in [0, " + std::to_string(e) +
                                        ") or -1 (another shard's)",
                        std::to_string(id[p]));
    }
  }
  if (n == 0 || d == 0 || f == 0) {
    std::fill_n(kept->typed_data(), n, 0);
    return ffi::Error::Success();
  }
  if (mid_thresholds.element_count() != 0) w.mid_thresholds = mid_thresholds.typed_data();
  w.gate = gate.typed_data();
  w.up = up.typed_data();
  w.down = down.typed_data();
  w.n_experts = e;
  w.d_ff = f;
  w.dim = d;
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SetContiguousRows(rt, x.typed_data(), n, d);
    MoeFfn(w, rt.x_rows, id, weights.typed_data(), k, y->typed_data(), rt.moe, rt.pool,
           kept->typed_data());  // stacked: nothing to read
    return ffi::Error::Success();
  } catch (const std::exception& ex) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("moe_ffn: ") + ex.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijMoeFfnCpu, pij::MoeFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // weights
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // gate
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // up
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // down
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // mid_thresholds
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // kept
                                  .Attr<int32_t>("gate_qtype")
                                  .Attr<int32_t>("up_qtype")
                                  .Attr<int32_t>("down_qtype")
                                  .Attr<std::string_view>("activation"));
PIJ_CPU_TARGET("pij_moe_ffn", PijMoeFfnCpu);
