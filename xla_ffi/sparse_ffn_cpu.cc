// CPU FFI handler for the sparse FFN: decode + validate (sparse_ffn_args), dispatch on the weight
// dtype once, run cpu_backend's kernel on the shared thread pool. Attributes beyond the shared
// decoder's: gate_floor (f32: FATReLU's gate threshold, 0 = none; gated relu/drelu only).
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/sparse_ffn.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/sparse_ffn_args.h"

namespace pij {
namespace {

template <typename W>
void RunTyped(const SparseFfnCall& call, CpuRuntime& rt) {
  FfnWeights<W> w;
  w.gate = static_cast<const W*>(call.gate);
  w.up = static_cast<const W*>(call.up);
  w.down_t = static_cast<const W*>(call.down_t);
  w.b_up = call.b_up;
  w.b_down = call.b_down;
  w.num_neurons = call.num_neurons;
  w.dim = call.dim;
  FfnTokens tokens{rt.x_rows, rt.score_rows};
  SparseFfn<W>(w, tokens, call.params, rt.pool, rt.ffn_scratch, call.y, call.n_active);
}

ffi::Error SparseFfnCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                            ffi::AnyBuffer w_down_t, ffi::AnyBuffer b_up, ffi::AnyBuffer b_down,
                            ffi::AnyBuffer scores, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> n_active, float threshold,
                            std::string_view activation, std::string_view criterion,
                            float gate_floor) {
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    SparseFfnCall call;
    if (ffi::Error e = DecodeSparseFfn(x, w_gate, w_up, w_down_t, b_up, b_down, scores, *y,
                                       *n_active, threshold, activation, criterion, call, rt.x_src,
                                       rt.score_src);
        e.failure()) {
      return e;
    }
    if (ffi::Error e = CheckGateFloor("sparse_ffn", gate_floor, call.params.activation,
                                      w_gate.element_count() > 0);
        e.failure()) {
      return e;
    }
    call.params.gate_floor = gate_floor;
    if (call.rows == 0) return ffi::Error::Success();
    rt.x_rows.resize(call.rows);
    for (int64_t r = 0; r < call.rows; ++r) rt.x_rows[r] = call.x + rt.x_src[r] * call.dim;
    rt.score_rows.clear();
    if (call.scores != nullptr) {
      rt.score_rows.resize(call.rows);
      for (int64_t r = 0; r < call.rows; ++r) {
        rt.score_rows[r] = call.scores + rt.score_src[r] * call.num_neurons;
      }
    }
    switch (call.weight_type) {  // the one dtype dispatch
      case ffi::DataType::F32: RunTyped<float>(call, rt); break;
      case ffi::DataType::BF16: RunTyped<Bf16>(call, rt); break;
      case ffi::DataType::F16: RunTyped<F16>(call, rt); break;
      default: return ffi::Error::Internal("sparse_ffn: unreachable weight dtype");
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // e.g. bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("sparse_ffn: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijSparseFfnCpu, pij::SparseFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down_t
                                  .Arg<xla::ffi::AnyBuffer>()  // b_up
                                  .Arg<xla::ffi::AnyBuffer>()  // b_down
                                  .Arg<xla::ffi::AnyBuffer>()  // scores
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::AnyBuffer>()  // n_active
                                  .Attr<float>("threshold")
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("criterion")
                                  .Attr<float>("gate_floor"));
PIJ_CPU_TARGET("pij_sparse_ffn", PijSparseFfnCpu);
