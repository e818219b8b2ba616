// nanobind module powerinfer_jax._pij_ext: hands the CPU FFI handlers to Python (as capsules for
// jax.ffi.register_ffi_target) and sizes the shared thread pool.
#include <nanobind/nanobind.h>

#include <atomic>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu_backend/bandwidth.h"
#include "cpu_backend/qlinear.h"
#include "cpu_backend/quant_interleaved.h"
#include "cpu_backend/quant_simd.h"
#include "cpu_backend/simd.h"
#include "cpu_backend/thread_pool.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"

namespace nb = nanobind;

void RegisterNeuronStore(nb::module_& m);  // neuron_store_bindings.cc
void RegisterExpertStore(nb::module_& m);  // expert_store_bindings.cc
void RegisterColumns(nb::module_& m);  // qcolumns_bindings.cc

namespace {

using Blocks = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Bytes = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

struct InterleaveJob {
  const uint8_t* src;
  pij::QType qtype;
  int64_t rows, row_bytes;
  uint8_t* dst;
};

// A job for pij::InterleaveRows, or std::invalid_argument (naming the binding `who`) saying what
// does not fit.
InterleaveJob CheckedInterleaveJob(const char* who, const Blocks& blocks, int32_t qtype, const Bytes& out) {
  const int64_t rows = static_cast<int64_t>(blocks.shape(0)), row_bytes = static_cast<int64_t>(blocks.shape(1));
  if (!pij::IsQType(qtype) || !pij::qkern::CanInterleave(static_cast<pij::QType>(qtype), rows) ||
      row_bytes % pij::GetQTypeInfo(static_cast<pij::QType>(qtype)).bytes != 0 ||
      static_cast<int64_t>(out.shape(0)) != rows || static_cast<int64_t>(out.shape(1)) != row_bytes) {
    throw std::invalid_argument(std::string(who) + ": expected Q4_0/Q4_1/Q8_0 blocks uint8 [rows, row bytes], rows "
                                "a multiple of 16, and out of the same shape; got qtype " +
                                std::to_string(qtype) + ", " + std::to_string(rows) + " rows of " +
                                std::to_string(row_bytes) + " bytes");
  }
  return {blocks.data(), static_cast<pij::QType>(qtype), rows, row_bytes, out.data()};
}

void RunInterleaveJobs(std::span<const InterleaveJob> jobs) {
  nb::gil_scoped_release release;
  pij::CpuRuntime& rt = pij::GetCpuRuntime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  for (const InterleaveJob& j : jobs) pij::InterleaveRows(j.src, j.qtype, j.rows, j.row_bytes, j.dst, rt.pool);
}

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Thread counts from Python: [1, ThreadPool::MaxThreads()], else ValueError (nanobind maps
// std::invalid_argument to it) naming the value and the bound.
void CheckThreadCount(const char* what, int n) {
  const int max = pij::ThreadPool::MaxThreads();
  if (n < 1 || n > max) {
    throw std::invalid_argument(std::string(what) + ": expected an integer in [1, " +
                                std::to_string(max) + "] (4 x the hardware threads, at least " +
                                std::to_string(pij::ThreadPool::kMinMaxThreads) + "), got " +
                                std::to_string(n));
  }
}

// GGUF string arrays (a u64 length, then that many UTF-8 bytes, `count` times) from `offset` of
// `data` (any byte buffer: the reader passes its mmap), as a list of str: the header reader's
// loop, several times faster than in Python for a model's ~100k tokens and merges. Returns
// (strings, end offset, 0), or for the first bad item (its index, its byte offset, 1) when its
// length runs past the end of data and (index, offset of its bytes, 2) when they are not UTF-8,
// so the caller's error can name it. gguf_file._python_strings is the same loop in Python.
nb::tuple GgufStrings(nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data,
                      uint64_t offset, uint64_t count) {
  const uint8_t* base = data.data();
  const uint64_t size = data.shape(0);
  nb::list out;
  uint64_t off = offset;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t n;
    if (off > size || size - off < 8) return nb::make_tuple(i, off, 1);
    std::memcpy(&n, base + off, 8);  // GGUF is little-endian, as every host this builds for
    if (n > size - off - 8) return nb::make_tuple(i, off, 1);
    PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(base + off + 8),
                                       static_cast<Py_ssize_t>(n), "strict");
    if (s == nullptr) {
      PyErr_Clear();
      return nb::make_tuple(i, off + 8, 2);
    }
    out.append(nb::steal(s));
    off += 8 + n;
  }
  return nb::make_tuple(out, off, 0);
}

}  // namespace

NB_MODULE(_pij_ext, m) {
  m.doc() = "powerinfer_jax CPU kernels (XLA FFI handlers) and thread pool control.";
  m.def("registrations", []() {
    nb::dict d;
    for (const pij::CpuTarget& t : pij::CpuTargets()) {  // each adapter's PIJ_CPU_TARGET lines
      if (d.contains(t.name)) {
        throw std::logic_error(std::string("registrations: target names: expected each once, "
                                           "got ") + t.name + " twice (two PIJ_CPU_TARGET lines)");
      }
      d[t.name] = Capsule(t.handler);
    }
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').");
  m.def("set_num_threads", [](int n) {
    CheckThreadCount("set_num_threads: n", n);
    bool ok;
    {
      nb::gil_scoped_release release;  // joining workers may wait for a running call to finish
      ok = pij::GetCpuRuntime().pool.SetNumThreads(n);
    }
    if (!ok) throw std::invalid_argument("set_num_threads: n: above the pool's maximum");
  }, nb::arg("n"), "Resize the kernel thread pool (the calling thread counts as one).");
  m.def("gguf_strings", &GgufStrings, nb::arg("data"), nb::arg("offset"), nb::arg("count"),
        "`count` GGUF strings from byte `offset` of `data` (a byte buffer, e.g. the file's "
        "mmap): (list, end, 0), or "
        "(index, byte offset, 1: past the end | 2: not UTF-8) for the first bad one.");
  m.def("max_threads", []() { return pij::ThreadPool::MaxThreads(); },
        "The most threads set_num_threads accepts: max(256, 4 x hardware threads).");
  m.def("get_num_threads", []() { return pij::GetCpuRuntime().pool.NumThreads(); });
  m.def("host_pool", []() {
    // The runtime is a leaked singleton, so the pointer outlives every module that holds it.
    return nb::capsule(static_cast<void*>(&pij::GetCpuRuntime().pool), "pij.ThreadPool");
  }, "The kernels' thread pool, for the CUDA module's cold rows (one pool per process).");
  m.def("stream_sum", [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> a) {
    nb::gil_scoped_release release;
    return pij::StreamSum(std::span<const float>(a.data(), a.shape(0)), pij::GetCpuRuntime().pool);
  }, nb::arg("data"), "Sum a float32 array with all pool threads: times the machine's read bandwidth.");
  m.def("runs_sum", [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> a,
                       int64_t run, int64_t stride,
                       nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> keep) {
    const int64_t n = static_cast<int64_t>(a.shape(0));
    if (run <= 0 || run % 16 != 0 || stride < run || n % stride != 0 ||
        static_cast<int64_t>(keep.shape(0)) != n / stride) {
      throw std::invalid_argument(
          "runs_sum: expected run a positive multiple of 16, stride >= run dividing the data's "
          "length, and one keep flag per stride, got run " + std::to_string(run) + ", stride " +
          std::to_string(stride) + ", " + std::to_string(n) + " floats, " +
          std::to_string(keep.shape(0)) + " flags");
    }
    nb::gil_scoped_release release;
    return pij::RunsSum(std::span<const float>(a.data(), n), run, stride,
                        std::span<const uint8_t>(keep.data(), keep.shape(0)),
                        pij::GetCpuRuntime().pool);
  }, nb::arg("data"), nb::arg("run"), nb::arg("stride"), nb::arg("keep"),
     "Sum the kept runs of a float32 array with all pool threads: times the bandwidth of "
     "input sparsity's read pattern.");
  m.def("pool_stress", [](int threads, int64_t runs, int64_t tasks) {
    CheckThreadCount("pool_stress: threads", threads);
    if (runs < 0 || tasks < 0) {
      throw std::invalid_argument("pool_stress: expected runs >= 0 and tasks >= 0");
    }
    nb::gil_scoped_release release;
    pij::ThreadPool pool(threads);  // a private pool: the kernels' pool is left alone
    std::atomic<int64_t> done{0};
    for (int64_t r = 0; r < runs; ++r) {
      pool.Run(0, tasks, [&](int64_t, int) { done.fetch_add(1, std::memory_order_relaxed); });
    }
    return done.load();
  }, nb::arg("threads"), nb::arg("runs"), nb::arg("tasks"),
        "Tests: `runs` back-to-back tiny jobs on a fresh pool; returns the tasks executed.");
  m.def("simd_name", []() { return pij::simd::Name(); },
        "The vector instruction set the kernels were compiled for.");
  m.def("isa_info", []() {
    nb::dict d;
    d["simd"] = pij::simd::Name();             // float kernels: avx512 | avx2 | scalar
    d["int8_dot"] = pij::qsimd::DotName();     // quantized kernels: avx512vnni | avxvnni | avx2 | scalar
    d["build_isa"] = PIJ_ISA_NAME;             // the CMake PIJ_ISA the module was built with
    return d;
  }, "Which instruction sets the module was compiled for.");
  m.def("interleave_into", [](Blocks blocks, int32_t qtype, Bytes out) {
    const InterleaveJob job = CheckedInterleaveJob("interleave_into", blocks, qtype, out);
    RunInterleaveJobs({&job, 1});
  }, nb::arg("blocks"), nb::arg("qtype"), nb::arg("out"),
        "out = blocks' rows interleaved by 16 (ops.qlinear's fastest layout; checkpoint.quants.interleave).");
  m.def("interleave_many", [](const std::vector<std::tuple<Blocks, int32_t, Bytes>>& jobs) {
    std::vector<InterleaveJob> checked;
    checked.reserve(jobs.size());
    for (const auto& [blocks, qtype, out] : jobs) {
      checked.push_back(CheckedInterleaveJob("interleave_many", blocks, qtype, out));
    }
    RunInterleaveJobs(checked);
  }, nb::arg("jobs"),
        "interleave_into over [(blocks, qtype, out), ...], every job checked first, then all of them "
        "in one call without the GIL (a model's load runs them beside its Python work).");
  m.def("qlinear_interleaved_portable",
        [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
           nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> blocks, int32_t qtype,
           nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> y) {
    const int64_t tokens = static_cast<int64_t>(x.shape(0)), dim = static_cast<int64_t>(x.shape(1));
    const int64_t rows = static_cast<int64_t>(blocks.shape(0));
    if (!pij::IsQType(qtype) || !pij::qkern::CanInterleave(static_cast<pij::QType>(qtype), rows) ||
        dim % 32 != 0 ||
        static_cast<int64_t>(blocks.shape(1)) != pij::QRowBytes(static_cast<pij::QType>(qtype), dim) ||
        static_cast<int64_t>(y.shape(0)) != tokens || static_cast<int64_t>(y.shape(1)) != rows) {
      throw std::invalid_argument("qlinear_interleaved_portable: expected x [T, D], interleaved "
                                  "Q4_0/Q4_1/Q8_0 blocks [O, row bytes of D] (O a multiple of 16) "
                                  "and y [T, O]");
    }
    std::vector<const float*> x_rows(tokens);
    for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x.data() + t * dim;
    pij::QLinearOut out{blocks.data(), static_cast<pij::QType>(qtype), nullptr, rows, y.data(), true};
    nb::gil_scoped_release release;
    pij::QLinearInterleavedPortable(out, dim, x_rows);
  }, nb::arg("x"), nb::arg("blocks"), nb::arg("qtype"), nb::arg("y"),
        "Tests: y = x . rows of interleaved blocks through the portable loops (bitwise the vector kernels').");
  RegisterNeuronStore(m);
  RegisterExpertStore(m);
  RegisterColumns(m);
  m.def("dequantize_into", [](nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> blocks,
                              int32_t qtype,
                              nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
    if (!pij::IsQType(qtype)) {
      throw std::invalid_argument("dequantize_into: qtype: expected a GGML block type id, got " +
                                  std::to_string(qtype));
    }
    const pij::QType t = static_cast<pij::QType>(qtype);
    const int64_t rows = static_cast<int64_t>(out.shape(0)), cols = static_cast<int64_t>(out.shape(1));
    if (cols % pij::GetQTypeInfo(t).block != 0 || static_cast<int64_t>(blocks.shape(0)) != rows ||
        static_cast<int64_t>(blocks.shape(1)) != pij::QRowBytes(t, cols)) {
      throw std::invalid_argument("dequantize_into: blocks: expected uint8 [rows, row bytes] "
                                  "matching out [rows, cols] in the given type");
    }
    nb::gil_scoped_release release;
    pij::DequantizeRows(blocks.data(), t, rows, cols, out.data());
  }, nb::arg("blocks"), nb::arg("qtype"), nb::arg("out"),
        "Tests: out[r] = the weights of row r of blocks (GGML block type qtype), via the kernels' unpacking.");
}
