// CPU FFI handler of the MoE FFN over an expert store's layer (cpu_backend/expert_store.h,
// moe_ffn.h): the experts are not operands; the store named by the `store` attribute (a handle
// from _pij_ext.expert_store_open) holds them in memory or reads them from its expert file.
// Operands: x f32 [N, D]; ids s32 [N, k] (each token's experts, in [0, E)); weights f32 [N, k];
// probs f32 [N, E] or empty (the router's probabilities: the "score" cache policy's credit);
// next_ids s32 [N, k'] or empty (a guess at layer + 1's experts, read ahead while this layer
// computes). Result: y f32 [N, D]. Attributes: store, layer (s64), d_ff (s64), gate_qtype,
// up_qtype, down_qtype (GGML type ids with their arrangement, quant_formats.h: rows, interleaved
// by 16, down's also down groups), activation ("silu" | "relu"), as ops.moe_ffn's for one
// expert's matrices at the store's offsets. Has side effects (reads, the cache): the Python wrapper declares them.
#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_backend/expert_store.h"
#include "cpu_backend/moe_ffn.h"
#include "cpu_backend/quant_interleaved.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"
#include "xla_ffi/quant_args.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "expert_ffn";

// One matrix's format (rows of `cols` weights, `rows` of them) and its bytes per expert; `kt`
// its type id, split (down groups: the down projection only).
ffi::Error ParseMatrix(std::string_view what, KernelType kt, int64_t rows, int64_t cols,
                       QType& t, bool& interleaved, int64_t& bytes) {
  const std::string w(what);
  interleaved = kt.arrangement == Arrangement::kInterleaved;
  const bool groups = kt.arrangement == Arrangement::kDownGroups;
  const int32_t qtype_id = kt.format;
  if (!IsQType(qtype_id) ||
      (groups && DownGroupScaleBytes(static_cast<QType>(qtype_id)) == 0)) {
    return InvalidArg(kOp, w + " qtype", groups ? "a 32-weight format id (down groups)"
                                                : "a GGML block type id (Q4_0=2 ... Q6_K=14)",
                      std::to_string(qtype_id));
  }
  t = static_cast<QType>(qtype_id);
  const QTypeInfo info = GetQTypeInfo(t);
  if (interleaved && !qkern::CanInterleave(t, rows)) {
    return InvalidArg(kOp, w + " (rows interleaved by 16)",
                      "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K with a multiple of 16 rows",
                      std::string(info.name) + " with " + std::to_string(rows) + " rows");
  }
  if (cols % info.block != 0 || (groups && (rows % 32 != 0 || cols % 32 != 0))) {
    return InvalidArg(kOp, w + " shape", "rows of whole blocks (down groups: D, F multiples of 32)",
                      std::to_string(rows) + " x " + std::to_string(cols));
  }
  // down groups: [F / 32, D * block bytes] = the same bytes as D rows of F weights
  bytes = rows * QRowBytes(t, cols);
  return ffi::Error::Success();
}

struct CallScratch {
  std::vector<int32_t> experts, ahead;
  std::vector<uint8_t> marks;
  std::vector<const float*> prob_rows;
  std::vector<MoeExpertSource> sources;
  ExpertLease lease;
};

CallScratch& Scratch() {  // used under the CPU runtime's mutex only
  static CallScratch* scratch = new CallScratch();
  return *scratch;
}

// The distinct ids in [0, e) of `ids` (n values), ascending, into out (-1s skipped).
void Distinct(const int32_t* ids, int64_t n, int64_t e, std::vector<uint8_t>& marks,
              std::vector<int32_t>& out) {
  marks.assign(e, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= 0) marks[ids[i]] = 1;
  }
  out.clear();
  for (int64_t i = 0; i < e; ++i) {
    if (marks[i]) out.push_back(static_cast<int32_t>(i));
  }
}

ffi::Error ExpertFfnCpuImpl(ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                            ffi::AnyBuffer probs, ffi::AnyBuffer next_ids,
                            ffi::Result<ffi::AnyBuffer> y, int64_t store_handle, int64_t layer,
                            int64_t d_ff, int32_t gate_qtype, int32_t up_qtype,
                            int32_t down_qtype, std::string_view activation) {
  const std::shared_ptr<ExpertStore> store = ExpertStores().Get(store_handle);
  if (store == nullptr) {
    return InvalidArg(kOp, "store", "the handle of an open expert store",
                      std::to_string(store_handle));
  }
  const ExpertLayout& l = store->layout();
  if (layer < 0 || layer >= l.num_layers) {
    return InvalidArg(kOp, "layer", "in [0, " + std::to_string(l.num_layers) + ")",
                      std::to_string(layer));
  }
  const auto xd = x.dimensions(), idd = ids.dimensions();
  if (x.element_type() != ffi::DataType::F32 || xd.size() != 2) {
    return InvalidArg(kOp, "x", "float32 [N, D]",
                      std::string(DtypeName(x.element_type())) + " " + ShapeString(xd));
  }
  const int64_t n = xd[0], d = xd[1], e = l.num_experts, f = d_ff;
  if (ids.element_type() != ffi::DataType::S32 || idd.size() != 2 || idd[0] != n || idd[1] < 1 ||
      idd[1] > e) {
    return InvalidArg(kOp, "ids", "int32 [" + std::to_string(n) + ", k] with 1 <= k <= " +
                                      std::to_string(e),
                      std::string(DtypeName(ids.element_type())) + " " + ShapeString(idd));
  }
  const int64_t k = idd[1];
  if (weights.element_type() != ffi::DataType::F32 ||
      ShapeString(weights.dimensions()) != ShapeString(idd)) {
    return InvalidArg(kOp, "weights", "float32 " + ShapeString(idd),
                      std::string(DtypeName(weights.element_type())) + " " +
                          ShapeString(weights.dimensions()));
  }
  const auto pd = probs.dimensions(), nd = next_ids.dimensions();
  const bool credit = probs.element_count() != 0;
  if (credit && (probs.element_type() != ffi::DataType::F32 || pd.size() != 2 || pd[0] != n ||
                 pd[1] != e)) {
    return InvalidArg(kOp, "probs", "empty or float32 [" + std::to_string(n) + ", " +
                                        std::to_string(e) + "]",
                      std::string(DtypeName(probs.element_type())) + " " + ShapeString(pd));
  }
  const bool ahead = next_ids.element_count() != 0;
  if (ahead && (next_ids.element_type() != ffi::DataType::S32 || nd.size() != 2 || nd[0] != n)) {
    return InvalidArg(kOp, "next_ids", "empty or int32 [" + std::to_string(n) + ", k']",
                      std::string(DtypeName(next_ids.element_type())) + " " + ShapeString(nd));
  }
  MoeExperts w{};
  w.n_experts = e;
  w.d_ff = f;
  w.dim = d;
  if (ffi::Error err = ParseActivation(kOp, activation, w.activation); err.failure()) return err;
  if (w.activation != Activation::kSilu && w.activation != Activation::kRelu) {
    return InvalidArg(kOp, "activation", "silu or relu", std::string(activation));
  }
  KernelType gate_kt, up_kt, down_kt;
  if (ffi::Error err = DecodeExpertTypes(kOp, gate_qtype, up_qtype, down_qtype, gate_kt, up_kt,
                                         down_kt);
      err.failure()) {
    return err;
  }
  w.down_groups = down_kt.arrangement == Arrangement::kDownGroups;
  if (w.down_groups && w.activation != Activation::kRelu) {
    return InvalidArg(kOp, "down groups", "relu experts", std::string(activation));
  }
  int64_t gate_bytes, up_bytes, down_bytes;
  if (f < 1) return InvalidArg(kOp, "d_ff", ">= 1", std::to_string(f));
  if (ffi::Error err = ParseMatrix("gate", gate_kt, f, d, w.gate_t, w.gate_il, gate_bytes);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = ParseMatrix("up", up_kt, f, d, w.up_t, w.up_il, up_bytes);
      err.failure()) {
    return err;
  }
  if (ffi::Error err = ParseMatrix("down", down_kt, d, f, w.down_t, w.down_il, down_bytes);
      err.failure()) {
    return err;
  }
  if (w.down_groups && w.up_il && !w.gate_il) {
    return InvalidArg(kOp, "up (down groups)", "rows, or interleaved under an interleaved gate",
                      "interleaved up under a gate of file rows");
  }
  if (l.gate_offset + gate_bytes > l.up_offset || l.up_offset + up_bytes > l.down_offset ||
      l.down_offset + down_bytes > l.slot_bytes) {
    return InvalidArg(kOp, "expert matrices (gate, up, down bytes)",
                      "within the store's offsets " + std::to_string(l.gate_offset) + ", " +
                          std::to_string(l.up_offset) + ", " + std::to_string(l.down_offset) +
                          " of a " + std::to_string(l.slot_bytes) + "-byte slot",
                      std::to_string(gate_bytes) + ", " + std::to_string(up_bytes) + ", " +
                          std::to_string(down_bytes));
  }
  if (y->element_type() != ffi::DataType::F32 ||
      static_cast<int64_t>(y->element_count()) != n * d) {
    return InvalidArg(kOp, "y (result)", "float32 [" + std::to_string(n) + ", " +
                                             std::to_string(d) + "]",
                      ShapeString(y->dimensions()));
  }
  const auto* id = static_cast<const int32_t*>(ids.untyped_data());
  for (int64_t p = 0; p < n * k; ++p) {
    if (id[p] < -1 || id[p] >= e) {
      return InvalidArg(kOp, "ids", "experts in [0, " + std::to_string(e) + ") or -1",
                        std::to_string(id[p]));
    }
  }
  const int64_t k_next = ahead ? nd[1] : 0;
  const auto* next = static_cast<const int32_t*>(next_ids.untyped_data());
  for (int64_t p = 0; p < n * k_next; ++p) {
    if (next[p] < -1 || next[p] >= e) {
      return InvalidArg(kOp, "next_ids", "experts in [0, " + std::to_string(e) + ") or -1",
                        std::to_string(next[p]));
    }
  }
  if (n == 0) return ffi::Error::Success();
  try {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    CallScratch& cs = Scratch();
    if (credit) {
      const auto* pp = static_cast<const float*>(probs.untyped_data());
      cs.prob_rows.clear();
      for (int64_t t = 0; t < n; ++t) cs.prob_rows.push_back(pp + t * e);
      store->Credit(layer, cs.prob_rows);
    }
    Distinct(id, n * k, e, cs.marks, cs.experts);
    std::string error;
    if (!store->Acquire(layer, cs.experts, n, cs.lease, &error)) {
      return ffi::Error::Internal(std::string(kOp) + ": " + error);
    }
    if (ahead && layer + 1 < l.num_layers) {  // behind this call's own reads
      Distinct(next, n * k_next, e, cs.marks, cs.ahead);
      store->Prefetch(layer + 1, cs.ahead, n);
    }
    cs.sources.assign(e, MoeExpertSource{});
    const ExpertLease& lease = cs.lease;
    for (size_t i = 0; i < cs.experts.size(); ++i) {
      const uint8_t* base = lease.base[i];
      cs.sources[cs.experts[i]] = MoeExpertSource{
          base + l.gate_offset, base + l.up_offset, base + l.down_offset,
          std::span<const std::atomic<uint32_t>* const>(
              lease.flags.data() + lease.flag_begin[i],
              lease.flag_begin[i + 1] - lease.flag_begin[i])};
    }
    w.sources = cs.sources.data();
    SetContiguousRows(rt, static_cast<const float*>(x.untyped_data()), n, d);
    const bool ok = MoeFfn(w, rt.x_rows, id, static_cast<const float*>(weights.untyped_data()),
                           k, static_cast<float*>(y->untyped_data()), rt.moe, rt.pool);
    // every read of this call has ended before its slots go back (a failed call too)
    ExpertStore::WaitAll(lease.flags);
    store->AddWaitNs(rt.moe.wait_ns.load());
    store->Release(cs.lease);
    if (!ok) return ffi::Error::Internal(std::string(kOp) + ": reading experts: " +
                                         store->ReadError());
    return ffi::Error::Success();
  } catch (const std::exception& ex) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string(kOp) + ": " + ex.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijExpertFfnCpu, pij::ExpertFfnCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // ids
                                  .Arg<xla::ffi::AnyBuffer>()  // weights
                                  .Arg<xla::ffi::AnyBuffer>()  // probs
                                  .Arg<xla::ffi::AnyBuffer>()  // next_ids
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("store")
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("d_ff")
                                  .Attr<int32_t>("gate_qtype")
                                  .Attr<int32_t>("up_qtype")
                                  .Attr<int32_t>("down_qtype")
                                  .Attr<std::string_view>("activation"));
PIJ_CPU_TARGET("pij_expert_ffn", PijExpertFfnCpu);
