// nanobind module powerinfer_jax._pij_cuda: the CUDA FFI handlers, registered by
// powerinfer_jax/ops/_ffi.py with platform="CUDA" when this module was built (PIJ_CUDA=ON).
#include <nanobind/nanobind.h>

#include "xla_ffi/sparse_ffn_cuda.h"

namespace nb = nanobind;

NB_MODULE(_pij_cuda, m) {
  m.doc() = "powerinfer_jax CUDA kernels (XLA FFI handlers).";
  m.def("registrations", []() {
    nb::dict d;
    d["pij_sparse_ffn"] = nb::capsule(reinterpret_cast<void*>(PijSparseFfnCuda));
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='CUDA').");
}
