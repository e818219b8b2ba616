// CPU FFI handler for the sparse FFN over a neuron store's layer (cpu_backend/disk_ffn.h): the
// rows are not operands; the store named by the `store` attribute (a handle from
// _pij_ext.neuron_store_open) holds them in memory or reads them from its bundle file.
// Operands: x f32 [..., D] (leading dims broadcast against y's, as qsparse_ffn's), scores
// f32 [..., F] (criterion "scores"; empty for "oracle"), next_scores f32 [..., F] or empty: the
// next layer's predictor on this layer's input (a guess at its active set, read ahead: neurons
// with a score > threshold in any row). Results: y f32 [..., D], n_active s32 [...].
// Attributes: store (s64), layer (s64), threshold (f32, finite, >= 0), activation, criterion
// ("scores" | "oracle"), gate_floor (f32: FATReLU's gate threshold, 0 = none). Has side effects (reads, the cache): the Python wrapper
// declares them so XLA never drops or merges a call.
#include <cmath>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "cpu_backend/disk_ffn.h"
#include "cpu_backend/neuron_store.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "disk_ffn";
using Dims = ffi::Span<const int64_t>;

Dims Leading(Dims dims) { return Dims(dims.begin(), dims.size() == 0 ? 0 : dims.size() - 1); }

struct CallScratch {
  DiskFfnScratch ffn;
  std::vector<int64_t> next_src;
  std::vector<const float*> next_rows;
};

CallScratch& Scratch() {  // used under the CPU runtime's mutex only
  static CallScratch* scratch = new CallScratch();
  return *scratch;
}

// Every operand has one dtype (typed: XLA checks it); shapes are checked here.
ffi::Error DiskFfnCpuImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scores,
                          ffi::Buffer<ffi::F32> next_scores, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ResultBuffer<ffi::S32> n_active, int64_t store_handle,
                          int64_t layer, float threshold, std::string_view activation,
                          std::string_view criterion, float gate_floor) {
  DiskFfnParams p;
  if (ffi::Error e = ParseActivation(kOp, activation, p.activation); e.failure()) return e;
  if (ffi::Error e = ParseSelection(kOp, criterion, threshold, false, p.criterion); e.failure()) {
    return e;
  }
  p.threshold = threshold;
  const std::shared_ptr<NeuronStore> store = NeuronStores().Get(store_handle);
  if (store == nullptr) {
    return InvalidArg(kOp, "store", "the handle of an open neuron store",
                      std::to_string(store_handle));
  }
  const BundleLayout& l = store->layout();
  if (ffi::Error e = CheckGateFloor(kOp, gate_floor, p.activation, l.gated); e.failure()) {
    return e;
  }
  p.gate_floor = gate_floor;
  if (layer < 0 || layer >= l.num_layers) {
    return InvalidArg(kOp, "layer", "in [0, " + std::to_string(l.num_layers) + ")",
                      std::to_string(layer));
  }
  const int64_t dim = l.dim, f = l.num_neurons;
  const Dims x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != dim) {
    return InvalidArg(kOp, "x", "float32 [..., " + std::to_string(dim) + "] (the store's D)",
                      "float32 " + ShapeString(x_dims));
  }
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
    CallScratch& cs = Scratch();
    if (!BroadcastRows(Leading(x_dims), rows_dims, rt.x_src)) {
      return InvalidArg(kOp, "x shape", "leading dims broadcastable to " + ShapeString(rows_dims),
                        ShapeString(x_dims));
    }
    const bool by_scores = p.criterion == Criterion::kScores;
    const Dims s_dims = scores.dimensions();
    if (by_scores && !(s_dims.size() > 0 && s_dims.back() == f &&
                       BroadcastRows(Leading(s_dims), rows_dims, rt.score_src))) {
      return InvalidArg(kOp, "scores",
                        "float32 [..., " + std::to_string(f) + "] broadcastable to the rows " +
                            ShapeString(rows_dims) + " (criterion scores)",
                        "float32 " + ShapeString(s_dims));
    }
    const Dims n_dims = next_scores.dimensions();
    const bool ahead = next_scores.element_count() != 0;
    if (ahead && !(n_dims.size() > 0 && n_dims.back() == f &&
                   BroadcastRows(Leading(n_dims), rows_dims, cs.next_src))) {
      return InvalidArg(kOp, "next_scores",
                        "empty or float32 [..., " + std::to_string(f) + "] broadcastable to " +
                            ShapeString(rows_dims),
                        "float32 " + ShapeString(n_dims));
    }
    if (rows == 0) return ffi::Error::Success();
    cs.next_rows.clear();
    if (ahead && layer + 1 < l.num_layers) {
      const float* np_ = next_scores.typed_data();
      for (int64_t r = 0; r < rows; ++r) cs.next_rows.push_back(np_ + cs.next_src[r] * f);
    }
    const float* xp = x.typed_data();
    rt.x_rows.resize(rows);
    for (int64_t r = 0; r < rows; ++r) rt.x_rows[r] = xp + rt.x_src[r] * dim;
    rt.score_rows.clear();
    if (by_scores) {
      const float* sp = scores.typed_data();
      rt.score_rows.resize(rows);
      for (int64_t r = 0; r < rows; ++r) rt.score_rows[r] = sp + rt.score_src[r] * f;
    }
    const std::string error = DiskSparseFfn(
        *store, layer, rt.x_rows, rt.score_rows, cs.next_rows, p,
        y->typed_data(), n_active->typed_data(), cs.ffn, rt.pool);
    if (!error.empty()) return ffi::Error::Internal(std::string(kOp) + ": " + error);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string(kOp) + ": " + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijDiskFfnCpu, pij::DiskFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scores
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // next_scores
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // n_active
                                  .Attr<int64_t>("store")
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("threshold")
                                  .Attr<std::string_view>("activation")
                                  .Attr<std::string_view>("criterion")
                                  .Attr<float>("gate_floor"));
PIJ_CPU_TARGET("pij_disk_ffn", PijDiskFfnCpu);
