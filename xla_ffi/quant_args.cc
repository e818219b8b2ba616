#include "xla_ffi/quant_args.h"

#include <string>
#include <tuple>

#include "cpu_backend/qcolumns.h"
#include "xla_ffi/ffi_util.h"

namespace pij {

ffi::Error DecodeKernelType(std::string_view op, std::string_view what, int32_t id,
                            std::initializer_list<Arrangement> allowed, KernelType& out) {
  bool ok = SplitKernelType(id, out);
  if (ok) {
    ok = false;
    for (Arrangement a : allowed) ok = ok || a == out.arrangement;
  }
  if (ok) return ffi::Error::Success();
  std::string takes = "a format id (Q4_0=2 ... Q6_K=14) in ";
  const char* sep = "";
  for (Arrangement a : allowed) {
    takes += sep + std::string(ArrangementName(a)) + " (+" +
             std::to_string(static_cast<int32_t>(a)) + ")";
    sep = " or ";
  }
  return InvalidArg(op, std::string(what) + " qtype", takes, std::to_string(id));
}

ffi::Error DecodeExpertTypes(std::string_view op, int32_t gate_id, int32_t up_id,
                             int32_t down_id, KernelType& gate, KernelType& up,
                             KernelType& down, bool columns) {
  constexpr auto kRows = Arrangement::kRows, kInterleaved = Arrangement::kInterleaved;
  constexpr auto kColumns = Arrangement::kColumns, kGroups = Arrangement::kDownGroups;
  for (auto [what, id, out] : {std::tuple{"gate", gate_id, &gate}, {"up", up_id, &up}}) {
    ffi::Error e = columns ? DecodeKernelType(op, what, id, {kRows, kInterleaved, kColumns}, *out)
                           : DecodeKernelType(op, what, id, {kRows, kInterleaved}, *out);
    if (e.failure()) return e;
  }
  return columns ? DecodeKernelType(op, "down", down_id, {kRows, kInterleaved, kGroups, kColumns},
                                    down)
                 : DecodeKernelType(op, "down", down_id, {kRows, kInterleaved, kGroups}, down);
}

ffi::Error DecodeQWeight(std::string_view op, std::string_view what, ffi::Buffer<ffi::U8> blocks,
                         int32_t qtype_id, int64_t dim, int64_t& rows, QType& qtype) {
  const std::string w(what);
  if (!IsQType(qtype_id)) {
    return InvalidArg(op, w + " qtype",
                      "a GGML block type id: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, "
                      "Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14",
                      std::to_string(qtype_id));
  }
  qtype = static_cast<QType>(qtype_id);
  const QTypeInfo info = GetQTypeInfo(qtype);
  if (dim <= 0 || dim % info.block != 0) {
    return InvalidArg(op, "x's last dim D (" + w + " in " + info.name + ")",
                      "a positive multiple of the " + std::string(info.name) + " block (" +
                          std::to_string(info.block) + ")",
                      std::to_string(dim));
  }
  const int64_t row_bytes = dim / info.block * info.bytes;
  const auto dims = blocks.dimensions();
  const bool shape_ok = dims.size() >= 2 && LeadingOnes(dims, 2) && dims.back() == row_bytes &&
                        (rows < 0 || dims[dims.size() - 2] == rows);
  if (!shape_ok) {
    return InvalidArg(op, w,
                      "uint8 [" + (rows < 0 ? std::string("R") : std::to_string(rows)) + ", " +
                          std::to_string(row_bytes) + "] (" + std::to_string(dim / info.block) +
                          " " + info.name + " blocks of " + std::to_string(info.bytes) +
                          " bytes per row of D = " + std::to_string(dim) + ")",
                      "uint8 " + ShapeString(dims));
  }
  rows = dims[dims.size() - 2];
  return ffi::Error::Success();
}

ffi::Error DecodeColumnsWeight(std::string_view op, std::string_view what,
                               ffi::Buffer<ffi::U8> blocks,
                               int32_t qtype_id, int64_t dim, int64_t& rows, QType& qtype) {
  const std::string w(what);
  if (!IsQType(qtype_id) || !ColumnsType(static_cast<QType>(qtype_id))) {
    return InvalidArg(op, w + " qtype (columns layout)",
                      "Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12 or Q6_K=14", std::to_string(qtype_id));
  }
  qtype = static_cast<QType>(qtype_id);
  const QTypeInfo info = GetQTypeInfo(qtype);
  if (dim <= 0 || dim % info.block != 0) {
    return InvalidArg(op, "x's last dim D (" + w + " in " + info.name + " columns)",
                      "a positive multiple of the " + std::string(info.name) + " block (" +
                          std::to_string(info.block) + ")",
                      std::to_string(dim));
  }
  const auto dims = blocks.dimensions();
  const int64_t r = dims.size() >= 2 ? dims[dims.size() - 2] : 0;
  const int64_t row_bytes = r > 0 && r % kColTile == 0 ? ColumnsRowBytes(qtype, r, dim) : -1;
  const bool shape_ok = dims.size() >= 2 && LeadingOnes(dims, 2) && row_bytes > 0 &&
                        dims.back() == row_bytes && (rows < 0 || r == rows);
  if (!shape_ok) {
    return InvalidArg(op, w,
                      "uint8 [R, columns row bytes] with R a positive multiple of " +
                          std::to_string(kColTile) + " (" + info.name +
                          " in the columns layout, D = " + std::to_string(dim) + ")",
                      "uint8 " + ShapeString(dims));
  }
  rows = dims[dims.size() - 2];
  return ffi::Error::Success();
}

}  // namespace pij
