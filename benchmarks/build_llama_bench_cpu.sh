#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` (and `llama-simple`, for a load-time figure) for CPU, twice:
# a native build (-march=native, AVX-512 on an AVX-512 machine) and an AVX2-only build, so
# benchmarks/q4_vs_llamacpp.py can time both ISA builds of llama.cpp against both ISA builds of
# ours on one file.
#
#   bash benchmarks/build_llama_bench_cpu.sh SRC [OUT_ROOT]
#
# SRC: a llama.cpp source tree (e.g. the one vendored in the llama-cpp-python sdist that the CPU
# peers run: <cache>/peers/llama-cpp-python-0.3.36/vendor/llama.cpp).
# OUT_ROOT: default ${POWERINFER_JAX_CACHE:-~/.cache/powerinfer_jax}/peers; the builds go to
# OUT_ROOT/llamacpp-cpu-native and OUT_ROOT/llamacpp-cpu-avx2 (binaries in bin/).
# ISAS="native avx2" (default) picks which builds (also native-noamx: no AMX); JOBS=2, NICE=5. Static libraries, no curl,
# no CUDA. Prints the two llama-bench paths on its last lines.
set -euo pipefail

SRC="${1:?usage: build_llama_bench_cpu.sh LLAMA_CPP_SRC [OUT_ROOT]}"
CACHE="${POWERINFER_JAX_CACHE:-${HOME}/.cache/powerinfer_jax}"
OUT_ROOT="${2:-${CACHE}/peers}"
JOBS="${JOBS:-2}"
NICE="${NICE:-5}"
ISAS="${ISAS:-native avx2}"
TARGETS="${TARGETS:-llama-bench llama-simple}"
[[ -f "${SRC}/CMakeLists.txt" ]] || { echo "no llama.cpp tree at ${SRC}" >&2; exit 2; }

COMMON=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF)

for isa in ${ISAS}; do
  case "${isa}" in
    native) FLAGS=(-DGGML_NATIVE=ON) ;;
    # the machine's instruction set without AMX: on a Xeon with AMX in a VM the native build's
    # AMX path stopped llama-bench's prefill with SIGSEGV (decode, batch 1, ran); ours uses no
    # AMX either
    native-noamx) FLAGS=(-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                         "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16") ;;
    avx2)   FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "unknown ISA ${isa} (native|native-noamx|avx2)" >&2; exit 2 ;;
  esac
  BUILD="${OUT_ROOT}/llamacpp-cpu-${isa}"
  nice -n "${NICE}" cmake -S "${SRC}" -B "${BUILD}" "${COMMON[@]}" "${FLAGS[@]}"
  # shellcheck disable=SC2086
  nice -n "${NICE}" cmake --build "${BUILD}" --config Release -j "${JOBS}" --target ${TARGETS}
done
for isa in ${ISAS}; do echo "${OUT_ROOT}/llamacpp-cpu-${isa}/bin/llama-bench"; done
