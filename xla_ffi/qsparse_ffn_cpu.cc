// CPU FFI handler for the quantized sparse FFN (cpu_backend/qsparse_ffn.h).
// Operands (absent optionals as zero-size arrays):
//   x       f32 [..., D]          leading dims broadcast against y's (vmap: size 1 or equal)
//   gate    u8  [1.., F, Bg] or empty (non-gated)   Bg = QRowBytes(gate_qtype, D)
//   up      u8  [1.., F, Bu]
//   down    u8  [1.., F, Bd]      neuron i's down row, blocked along D (down_qtype's arrangement
//                                 rows), or
//           u8  [1.., F/32, D*b]  the file's blocks in groups of 32 neurons (down groups, b: a
//                                 block's bytes; cpu_backend/quant_kernels.h AxpyGroup)
//   b_up    f32 [F] or empty;  b_down f32 [D] or empty
//   scores  f32 [..., F]          criterion "scores"; empty for "oracle"
// Results: y f32 [..., D], n_active s32 [...]. Attributes: gate_qtype, up_qtype, down_qtype
// (GGML type ids with their arrangement, quant_formats.h: gate's and up's rows or interleaved by
// 16 (criterion "oracle" only), down's rows or down groups), threshold (f32, finite, >= 0),
// activation, criterion ("scores" | "oracle"), gate_floor (f32: FATReLU's gate threshold, 0 =
// none).
#include <cmath>
#include <exception>
#include <mutex>
#include <string>
#include <tuple>

#include "cpu_backend/qsparse_ffn.h"
#include "cpu_backend/quant_interleaved.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/quant_args.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "qsparse_ffn";
using Dims = ffi::Span<const int64_t>;

Dims Leading(Dims dims) { return Dims(dims.begin(), dims.size() == 0 ? 0 : dims.size() - 1); }

// Every operand has one dtype (typed: XLA checks it); shapes and type ids are checked here.
ffi::Error QSparseFfnCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> gate,
                             ffi::Buffer<ffi::U8> up, ffi::Buffer<ffi::U8> down,
                             ffi::Buffer<ffi::F32> b_up, ffi::Buffer<ffi::F32> b_down,
                             ffi::Buffer<ffi::F32> scores, ffi::ResultBuffer<ffi::F32> y,
                             ffi::ResultBuffer<ffi::S32> n_active, int32_t gate_qtype,
                             int32_t up_qtype, int32_t down_qtype, float threshold,
                             std::string_view activation, std::string_view criterion,
                             float gate_floor) {
  QFfnWeights w;
  QSparseFfnParams p;
  if (ffi::Error e = ParseActivation(kOp, activation, p.activation); e.failure()) return e;
  if (ffi::Error e = ParseSelection(kOp, criterion, threshold, false, p.criterion); e.failure()) {
    return e;
  }
  p.threshold = threshold;
  if (ffi::Error e = CheckGateFloor(kOp, gate_floor, p.activation, gate.element_count() > 0);
      e.failure()) {
    return e;
  }
  p.gate_floor = gate_floor;
  const Dims x_dims = x.dimensions();
  if (x_dims.size() == 0) return InvalidArg(kOp, "x", "float32 [..., D]", "float32 []");
  const int64_t dim = x_dims.back();
  int64_t f = -1;
  // gate and up rows interleaved by 16 (quant_interleaved.h): criterion oracle (every neuron's
  // gate is computed, a group at a time); both, or the gate alone on a relu/drelu FFN (whose
  // up rows are read only for the neurons whose gate fires)
  KernelType up_kt, gate_kt, down_kt;
  for (auto [what, id, kt] : {std::tuple("up", up_qtype, &up_kt),
                              std::tuple("gate", gate_qtype, &gate_kt)}) {
    if (ffi::Error e = DecodeKernelType(kOp, what, id,
                                        {Arrangement::kRows, Arrangement::kInterleaved}, *kt);
        e.failure()) {
      return e;
    }
  }
  if (ffi::Error e = DecodeKernelType(kOp, "down", down_qtype,
                                      {Arrangement::kRows, Arrangement::kDownGroups}, down_kt);
      e.failure()) {
    return e;
  }
  w.up_interleaved = up_kt.arrangement == Arrangement::kInterleaved;
  if (ffi::Error e = DecodeQWeight(kOp, "up", up, up_kt.format, dim, f, w.up_type); e.failure()) {
    return e;
  }
  const bool gate_interleaved = gate_kt.arrangement == Arrangement::kInterleaved;
  if (gate.element_count() != 0) {
    if (ffi::Error e = DecodeQWeight(kOp, "gate", gate, gate_kt.format, dim, f, w.gate_type);
        e.failure()) {
      return e;
    }
    w.gate = gate.typed_data();
  }
  w.gate_interleaved = w.gate != nullptr && gate_interleaved;
  if (w.up_interleaved || w.gate_interleaved) {
    const bool relu_gate = p.activation == Activation::kRelu || p.activation == Activation::kDrelu;
    const bool pair_ok = w.gate == nullptr ? w.up_interleaved
                                           : w.gate_interleaved && (w.up_interleaved || relu_gate);
    const bool ok = pair_ok && (!w.up_interleaved || qkern::CanInterleave(w.up_type, f)) &&
                    (!w.gate_interleaved || qkern::CanInterleave(w.gate_type, f)) &&
                    p.criterion == Criterion::kOracle;
    if (!ok) {
      return InvalidArg(kOp, "gate/up rows interleaved by 16",
                        "both interleaved (or the gate alone with relu/drelu), Q4_0/Q4_1/Q8_0, "
                        "F a multiple of 16, criterion oracle",
                        std::string("up ") + GetQTypeInfo(w.up_type).name +
                            (w.up_interleaved ? " interleaved" : " rows") + ", gate " +
                            (gate_interleaved ? "interleaved" : "rows") + ", F " +
                            std::to_string(f) + ", criterion " + std::string(criterion));
    }
  }
  if (down_kt.arrangement == Arrangement::kDownGroups) {  // [F / 32, D * block bytes]
    if (!IsQType(down_kt.format) ||
        DownGroupScaleBytes(static_cast<QType>(down_kt.format)) == 0) {
      return InvalidArg(kOp, "down_qtype (down groups)",
                        "a 32-weight format id: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8 (+1024)",
                        std::to_string(down_qtype));
    }
    if (f % 32 != 0 || dim % 32 != 0) {
      return InvalidArg(kOp, "F and D (down groups)", "multiples of 32",
                        std::to_string(f) + " and " + std::to_string(dim));
    }
    int64_t groups = f / 32;
    if (ffi::Error e = DecodeQWeight(kOp, "down (groups of 32 neurons)", down, down_kt.format,
                                     32 * dim, groups, w.down_type);
        e.failure()) {
      return e;
    }
    w.down_groups = true;
  } else if (ffi::Error e = DecodeQWeight(kOp, "down", down, down_kt.format, dim, f, w.down_type);
             e.failure()) {
    return e;
  }
  if (ffi::Error e = DecodeOptionalF32(kOp, "b_up", b_up, f, w.b_up); e.failure()) return e;
  if (ffi::Error e = DecodeOptionalF32(kOp, "b_down", b_down, dim, w.b_down); e.failure()) return e;
  w.up = up.typed_data();
  w.down = down.typed_data();
  w.num_neurons = f;
  w.dim = dim;

  const Dims y_dims = y->dimensions();
  if (y_dims.size() == 0 || y_dims.back() != dim ||
      n_active->element_count() * dim != y->element_count()) {
    return InvalidArg(kOp, "results", "float32 [..., " + std::to_string(dim) + "] and int32 [...]",
                      ShapeString(y_dims) + ", " + ShapeString(n_active->dimensions()));
  }
  const Dims rows_dims = Leading(y_dims);
  const int64_t rows = static_cast<int64_t>(n_active->element_count());
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    if (!BroadcastRows(Leading(x_dims), rows_dims, rt.x_src)) {
      return InvalidArg(kOp, "x shape", "leading dims broadcastable to " + ShapeString(rows_dims),
                        ShapeString(x_dims));
    }
    const bool by_scores = p.criterion == Criterion::kScores;
    const Dims s_dims = scores.dimensions();
    const bool scores_ok = s_dims.size() > 0 && s_dims.back() == f &&
                           BroadcastRows(Leading(s_dims), rows_dims, rt.score_src);
    if (by_scores && !scores_ok) {
      return InvalidArg(kOp, "scores",
                        "float32 [..., " + std::to_string(f) + "] broadcastable to the rows " +
                            ShapeString(rows_dims) + " (criterion scores)",
                        "float32 " + ShapeString(s_dims));
    }
    if (rows == 0) return ffi::Error::Success();
    const float* xp = x.typed_data();
    rt.x_rows.resize(rows);
    for (int64_t r = 0; r < rows; ++r) rt.x_rows[r] = xp + rt.x_src[r] * dim;
    rt.score_rows.clear();
    if (by_scores) {
      const float* sp = scores.typed_data();
      rt.score_rows.resize(rows);
      for (int64_t r = 0; r < rows; ++r) rt.score_rows[r] = sp + rt.score_src[r] * f;
    }
    QSparseFfn(w, rt.x_rows, rt.score_rows, p, y->typed_data(), n_active->typed_data(),
               rt.qsparse_ffn, rt.pool);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("qsparse_ffn: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijQSparseFfnCpu, pij::QSparseFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // gate
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // up
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()   // down
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // b_up
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // b_down
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scores
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // n_active
                                  .Attr<int32_t>("gate_qtype")
                                  .Attr<int32_t>("up_qtype")
                                  .Attr<int32_t>("down_qtype")
                                  .Attr<float>("threshold")
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("criterion")
                                  .Attr<float>("gate_floor"));
PIJ_CPU_TARGET("pij_qsparse_ffn", PijQSparseFfnCpu);
