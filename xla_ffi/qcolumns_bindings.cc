// nanobind functions of the columns layout (cpu_backend/qcolumns.h): arranging a file's matrix
// once at load (on the kernels' pool, without the GIL), and the tests' dequantization and
// portable product.
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "cpu_backend/qcolumns.h"
#include "cpu_backend/qlinear.h"
#include "xla_ffi/cpu_runtime.h"

namespace nb = nanobind;

namespace {

using U8In = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

pij::QType ColumnsQType(const char* fn, int32_t qtype, int64_t rows, int64_t cols) {
  if (!pij::IsQType(qtype) || !pij::CanArrangeColumns(static_cast<pij::QType>(qtype), rows, cols)) {
    throw std::invalid_argument(std::string(fn) + ": expected Q4_0, Q4_1, Q8_0, Q4_K or Q6_K with "
                                "rows a positive multiple of 64 and cols of the block, got type " +
                                std::to_string(qtype) + " [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "]");
  }
  return static_cast<pij::QType>(qtype);
}

}  // namespace

void RegisterColumns(nb::module_& m) {
  m.def("columns_row_bytes", [](int32_t qtype, int64_t rows, int64_t cols) {
    if (!pij::IsQType(qtype) || !pij::CanArrangeColumns(static_cast<pij::QType>(qtype), rows, cols)) {
      return int64_t{-1};
    }
    return pij::ColumnsRowBytes(static_cast<pij::QType>(qtype), rows, cols);
  }, nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
        "Bytes per row of a [rows, cols] matrix in the columns layout (-1: no such layout).");
  m.def("arrange_columns", [](U8In blocks, int32_t qtype, int64_t cols,
                              nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
    const int64_t rows = static_cast<int64_t>(blocks.shape(0));
    const pij::QType t = ColumnsQType("arrange_columns", qtype, rows, cols);
    if (static_cast<int64_t>(blocks.shape(1)) != pij::QRowBytes(t, cols) ||
        static_cast<int64_t>(out.shape(0)) != rows ||
        static_cast<int64_t>(out.shape(1)) != pij::ColumnsRowBytes(t, rows, cols)) {
      throw std::invalid_argument("arrange_columns: expected blocks uint8 [rows, " +
                                  std::to_string(pij::QRowBytes(t, cols)) + "] and out uint8 [rows, " +
                                  std::to_string(pij::ColumnsRowBytes(t, rows, cols)) + "]");
    }
    nb::gil_scoped_release release;
    pij::CpuRuntime& rt = pij::GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    pij::ArrangeColumns(blocks.data(), t, rows, cols, out.data(), rt.pool);
  }, nb::arg("blocks"), nb::arg("qtype"), nb::arg("cols"), nb::arg("out"),
        "out = the file's rows `blocks` in the columns layout (cpu_backend/qcolumns.h).");
  m.def("dequantize_columns", [](U8In w, int32_t qtype,
                                 nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
    const int64_t rows = static_cast<int64_t>(out.shape(0)), cols = static_cast<int64_t>(out.shape(1));
    const pij::QType t = ColumnsQType("dequantize_columns", qtype, rows, cols);
    if (static_cast<int64_t>(w.shape(0)) != rows ||
        static_cast<int64_t>(w.shape(1)) != pij::ColumnsRowBytes(t, rows, cols)) {
      throw std::invalid_argument("dequantize_columns: expected w uint8 [rows, columns row bytes]");
    }
    nb::gil_scoped_release release;
    pij::DequantizeColumns(w.data(), t, rows, cols, out.data());
  }, nb::arg("w"), nb::arg("qtype"), nb::arg("out"),
        "Tests: the float values of a matrix in the columns layout.");
  m.def("qlinear_columns_portable",
        [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x, U8In w,
           int32_t qtype, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> y) {
    const int64_t tokens = static_cast<int64_t>(x.shape(0)), dim = static_cast<int64_t>(x.shape(1));
    const int64_t rows = static_cast<int64_t>(w.shape(0));
    const pij::QType t = ColumnsQType("qlinear_columns_portable", qtype, rows, dim);
    if (static_cast<int64_t>(w.shape(1)) != pij::ColumnsRowBytes(t, rows, dim) ||
        static_cast<int64_t>(y.shape(0)) != tokens || static_cast<int64_t>(y.shape(1)) != rows) {
      throw std::invalid_argument("qlinear_columns_portable: expected x [T, D], w [O, columns row "
                                  "bytes of D] and y [T, O]");
    }
    const int64_t block = pij::GetQTypeInfo(t).block;
    std::vector<const float*> x_rows(tokens);
    for (int64_t i = 0; i < tokens; ++i) x_rows[i] = x.data() + i * dim;
    nb::gil_scoped_release release;
    pij::QActs acts;
    pij::ThreadPool pool(1);
    pij::QuantizeActs(x_rows, dim, block, acts, pool);
    std::vector<pij::QActView> views(tokens);
    for (int64_t i = 0; i < tokens; ++i) views[i] = acts.View(i, block == 256 ? 16 : 32);
    pij::QLinearColumnsRows(w.data(), t, rows, dim, views, 0, rows, nullptr, y.data(), true);
  }, nb::arg("x"), nb::arg("w"), nb::arg("qtype"), nb::arg("y"),
        "Tests: y = x . W (columns layout) through the portable loops (bitwise the vector kernels').");
}
