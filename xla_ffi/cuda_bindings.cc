// nanobind module powerinfer_jax._pij_cuda: the CUDA FFI handlers, registered by
// powerinfer_jax/ops/_ffi.py with platform="CUDA" when this module was built (PIJ_CUDA=ON), and the
// host store of cold FFN rows the hybrid handler reads (rows copied once; referenced by handle).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string_view.h>

#include <stdexcept>
#include <string>
#include <string_view>

#include "xla_ffi/sparse_ffn_cuda.h"
#include "xla_ffi/sparse_ffn_hybrid_cuda.h"

namespace nb = nanobind;

namespace {

// Read-only views are fine (rows are copied): numpy views of jax arrays are not writable.
using HostArray = nb::ndarray<nb::ro, nb::device::cpu, nb::c_contig>;

// The weights' dtype comes by name: numpy has no bfloat16 of its own, so 16-bit rows arrive as
// uint16 views (ops/_ffi.py) and the name says how to read them.
pij::RowType TypeNamed(std::string_view name) {
  if (name == "float32") return pij::RowType::kF32;
  if (name == "bfloat16") return pij::RowType::kBf16;
  if (name == "float16") return pij::RowType::kF16;
  throw std::invalid_argument("register_cold_rows: dtype: expected float32, bfloat16 or float16, "
                              "got " + std::string(name));
}

void CheckMatrix(const char* what, const HostArray& a, pij::RowType type, int64_t f, int64_t d) {
  const size_t bytes = pij::RowTypeSize(type);
  if (a.ndim() != 2 || static_cast<int64_t>(a.shape(0)) != f ||
      static_cast<int64_t>(a.shape(1)) != d || a.itemsize() != bytes) {
    throw std::invalid_argument(std::string("register_cold_rows: ") + what + ": expected [" +
                                std::to_string(f) + ", " + std::to_string(d) + "] of " +
                                std::to_string(bytes) + "-byte elements (up's shape and dtype)");
  }
}

}  // namespace

NB_MODULE(_pij_cuda, m) {
  m.doc() = "powerinfer_jax CUDA kernels (XLA FFI handlers) and the hybrid handler's cold rows.";
  m.def("registrations", []() {
    nb::dict d;
    d["pij_sparse_ffn"] = nb::capsule(reinterpret_cast<void*>(PijSparseFfnCuda));
    d["pij_sparse_ffn_hybrid"] = nb::capsule(reinterpret_cast<void*>(PijSparseFfnHybridCuda));
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='CUDA').");
  m.def("register_cold_rows", [](HostArray up, HostArray down_t, nb::object gate,
                                 nb::object b_up, std::string_view dtype) {
    const pij::RowType type = TypeNamed(dtype);
    if (up.ndim() != 2) throw std::invalid_argument("register_cold_rows: up: expected [F_cold, D]");
    const int64_t f = up.shape(0), d = up.shape(1);
    CheckMatrix("up", up, type, f, d);
    CheckMatrix("down_t", down_t, type, f, d);
    const void* gate_ptr = nullptr;
    const float* b_up_ptr = nullptr;
    HostArray g, b;
    if (!gate.is_none()) {
      g = nb::cast<HostArray>(gate);
      CheckMatrix("gate", g, type, f, d);
      gate_ptr = g.data();
    }
    if (!b_up.is_none()) {
      b = nb::cast<HostArray>(b_up);
      if (b.ndim() != 1 || static_cast<int64_t>(b.shape(0)) != f || b.dtype() != nb::dtype<float>()) {
        throw std::invalid_argument("register_cold_rows: b_up: expected float32 [" +
                                    std::to_string(f) + "]");
      }
      b_up_ptr = static_cast<const float*>(b.data());
    }
    return pij::HybridColdStore().Add(type, f, d, gate_ptr, up.data(), down_t.data(), b_up_ptr);
  }, nb::arg("up"), nb::arg("down_t"), nb::arg("gate").none() = nb::none(),
     nb::arg("b_up").none() = nb::none(), nb::arg("dtype"),
     "Copy one layer's cold rows into host memory owned by the backend; returns the handle the "
     "hybrid custom call takes as its cold_handle attribute. 16-bit rows come as uint16 views "
     "and `dtype` names their type.");
  m.def("release_cold_rows", [](int64_t handle) { return pij::HybridColdStore().Remove(handle); },
        nb::arg("handle"), "Free a layer's cold rows (no running computation may still use them).");
  m.def("cold_store_bytes", []() { return pij::HybridColdStore().Bytes(); });
  m.def("use_host_pool", [](nb::capsule pool) {
    if (std::string_view(pool.name()) != "pij.ThreadPool") {
      throw std::invalid_argument("use_host_pool: expected the capsule of "
                                  "powerinfer_jax._pij_ext.host_pool(), got " +
                                  std::string(pool.name()));
    }
    pij::UseHostPool(static_cast<pij::ThreadPool*>(pool.data()));
  }, nb::arg("pool"), "Run cold rows on the CPU module's thread pool (one pool per process).");
}
