#!/usr/bin/env bash
# Build llama.cpp with CUDA for sm_90 (H100/H200) on a machine WITHOUT a GPU (nvcc 13 is enough),
# from the same llama.cpp tree the CPU peers use: the one vendored in the llama-cpp-python 0.3.36
# sdist (llama.cpp commit below). Produces llama-bench, llama-batched-bench and llama-completion
# plus their shared libraries in one folder to carry to the GPU machine (the `device` tool's
# `carry`), by default .peers/llama.cpp-cuda/ in the repo root (git-ignored).
#
# Usage: bash benchmarks/gpu/build_llama_cpp_cuda.sh [DEST]
#   env: PIJ_PEERS   where the sdist, cuBLAS and the build tree live
#                    (default: $POWERINFER_JAX_CACHE or ~/.cache/powerinfer_jax, then /peers)
#        LLAMA_CPP_SRC  a llama.cpp tree to build instead of the sdist's, e.g. the source subset
#                    sparse_7b_prepare.py packs (its commit in the file LLAMA_CPP_COMMIT)
#        CONFIGURE_ONLY=1  stop after CMake's configure (a check that the tree is complete)
#        GGML_CUDA   ON (default) or OFF: a CPU-only configure where there is no cuBLAS
#        CPU_NATIVE=1  build the CPU backend for THIS machine's CPU only (GGML_NATIVE=ON, no
#                    per-level variants): for a build on the GPU machine itself, where the
#                    variants' ~10 CPU builds would only cost time
#        JOBS        parallel compile jobs (default 2: the build machine's cores are shared)
#        NICE        niceness of the build (default 19)
#
# What it builds and why (the options passed to CMake, exactly):
#   GGML_CUDA=ON CMAKE_CUDA_ARCHITECTURES=90   the H100/H200 only: one device-code pass per file
#   GGML_CUDA_FA_ALL_QUANTS=OFF                 FlashAttention kernels for f16/q4_0/q8_0 KV only
#                                               (the default; our baseline uses an f16 KV cache)
#   GGML_CUDA_NCCL=OFF                          one GPU
#   GGML_CUDA_NO_VMM=ON                         the build machine has no libcuda, not even the
#       toolkit's stub, to link the driver API against; VMM only changes how ggml's CUDA memory
#       pool grows (without it: the legacy pool of cudaMalloc'd buffers), not the kernels, and
#       with CUDA graphs a decode step allocates nothing once warm
#   GGML_NATIVE=OFF GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON BUILD_SHARED_LIBS=ON
#       the CPU backend is built for every x86 level and the best one for the GPU machine's host
#       CPU is chosen at run time: with -ngl < n_layers the layers left on the host run on it,
#       so a build tuned for THIS machine's CPU (or the lowest common level) would be unfair
#   LLAMA_BUILD_SERVER/TESTS/EXAMPLES/APP=OFF LLAMA_OPENSSL=OFF   only what the benchmark needs
#   (LLAMA_CURL no longer exists in this tree: it is deprecated and curl is not used.)
# Targets: llama-bench llama-batched-bench llama-completion (llama-cli now needs the server).
#
# cuBLAS: ggml-cuda links libcublas (.so.13): the CUDA toolkit's when it has one, else the one
# a Python nvidia-cublas wheel installed (the GPU image's python3 has it), else the script installs
# the pip wheel nvidia-cublas==13.0.0.19 (CUDA 13.0's cuBLAS) under $PIJ_PEERS (this build machine's
# CUDA 13.0 has no cuBLAS). BUILD_INFO names the folder ("cublas_lib DIR"): put it on
# LD_LIBRARY_PATH to run the binaries. Exit status: 0 built, 1 failed (log: $BUILD/build.log).
set -euo pipefail

VERSION=0.3.36
LLAMA_CPP_COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f  # vendor/llama.cpp in that sdist
CUBLAS_WHEEL=nvidia-cublas==13.0.0.19
JOBS=${JOBS:-2}
NICE=${NICE:-19}
PEERS=${PIJ_PEERS:-${POWERINFER_JAX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/powerinfer_jax}/peers}
SRC_ROOT=$PEERS/llama-cpp-python-$VERSION
SRC=${LLAMA_CPP_SRC:-$SRC_ROOT/vendor/llama.cpp}
CUBLAS=$PEERS/nvidia-cublas-13.0
CUDA_ON=${GGML_CUDA:-ON}
BUILD=$PEERS/llama.cpp-cuda-sm90-${LLAMA_CPP_COMMIT:0:12}
DEST=${1:-.peers/llama.cpp-cuda}
TARGETS=(llama-bench llama-batched-bench llama-completion)
PY=${PYTHON:-python3}

mkdir -p "$PEERS"
log() { echo "[build_llama_cpp_cuda] $*" >&2; }

# 1. the llama.cpp tree (reused if another helper unpacked it already)
if [ ! -f "$SRC/CMakeLists.txt" ] && [ -n "${LLAMA_CPP_SRC:-}" ]; then
  log "LLAMA_CPP_SRC: expected a llama.cpp tree with CMakeLists.txt, got $SRC"; exit 1
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d "$PEERS/.sdist.XXXXXX")
  log "downloading the llama-cpp-python $VERSION sdist"
  "$PY" -m pip download --quiet --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
  tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
  rm -rf "$SRC_ROOT"; mv "$tmp/llama_cpp_python-$VERSION" "$SRC_ROOT"; rm -rf "$tmp"
fi
if [ -f "$SRC/LLAMA_CPP_COMMIT" ]; then  # a packed subset: no .git
  got=$(cat "$SRC/LLAMA_CPP_COMMIT")
else
  got=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
fi
if [ "$got" != "$LLAMA_CPP_COMMIT" ]; then
  log "llama.cpp tree $SRC: expected commit $LLAMA_CPP_COMMIT, got $got (remove $SRC_ROOT to re-fetch)"
  exit 1
fi

# 2. nvcc and cuBLAS
cuda_flags=()
if [ "$CUDA_ON" = ON ]; then
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { log "nvcc: expected on PATH or /usr/local/cuda/bin, got none"; exit 1; }
# nvcc may be a wrapper script (/usr/local/bin/nvcc execs the real one): ask nvcc where it lives
CUDA_ROOT=${CUDAToolkit_ROOT:-$("$NVCC" -dryrun -x cu -c /dev/null -o /dev/null 2>&1 |
  sed -n 's/^#\$ TOP=//p' | head -1)}
CUDA_ROOT=$(readlink -f "$CUDA_ROOT")
NVCC=$CUDA_ROOT/bin/nvcc
# a Python nvidia-cublas wheel's (nvidia/cu13/... or nvidia/cublas/...), if the python has one
py_cublas=$("$PY" -c 'import site, glob; print(next(iter(sorted(h for d in site.getsitepackages()
  for h in glob.glob(d + "/nvidia/**/include/cublas_v2.h", recursive=True))), ""))' 2>/dev/null || true)
if [ -f "$CUDA_ROOT/include/cublas_v2.h" ] && ls "$CUDA_ROOT"/lib64/libcublas.so* >/dev/null 2>&1; then
  CUBLAS_INC=$CUDA_ROOT/include; CUBLAS_LIB=$CUDA_ROOT/lib64
elif [ -n "$py_cublas" ] && ls "$(dirname "$(dirname "$py_cublas")")"/lib/libcublas.so* >/dev/null 2>&1; then
  CUBLAS_INC=$(dirname "$py_cublas"); CUBLAS_LIB=$(dirname "$CUBLAS_INC")/lib
else
  if [ ! -f "$CUBLAS/.complete" ]; then
    log "installing $CUBLAS_WHEEL into $CUBLAS (headers and libraries to link against)"
    rm -rf "$CUBLAS"
    "$PY" -m pip install --quiet --no-deps --target "$CUBLAS" "$CUBLAS_WHEEL"
    touch "$CUBLAS/.complete"
  fi
  CUBLAS_INC=$(dirname "$(find "$CUBLAS" -name cublas_v2.h | head -1)")
  CUBLAS_LIB=$(dirname "$(find "$CUBLAS" -name 'libcublas.so.*' | head -1)")
fi
LIB_CUBLAS=$(ls "$CUBLAS_LIB"/libcublas.so* | head -1)
LIB_CUBLASLT=$(ls "$CUBLAS_LIB"/libcublasLt.so* | head -1)
log "nvcc $("$NVCC" --version | tail -2 | head -1); CUDA root $CUDA_ROOT; cuBLAS $LIB_CUBLAS"
cuda_flags=(-DCMAKE_CUDA_COMPILER="$NVCC" -DCUDAToolkit_ROOT="$CUDA_ROOT"
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF
  -DGGML_CUDA_NO_VMM=ON
  -DCUDA_cublas_LIBRARY="$LIB_CUBLAS" -DCUDA_cublasLt_LIBRARY="$LIB_CUBLASLT"
  -DCMAKE_CUDA_FLAGS="-I$CUBLAS_INC" -DCMAKE_CXX_FLAGS="-I$CUBLAS_INC")
else
  BUILD=$BUILD-cpu-configure; CUBLAS_LIB=none; cuda_flags=(-DGGML_CUDA=OFF)
fi

# 3. configure and build (incremental: an up-to-date build returns at once)
if [ "${CPU_NATIVE:-0}" = 1 ]; then
  cpu_flags=(-DGGML_NATIVE=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF); BUILD=$BUILD-native
else
  cpu_flags=(-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON)
fi
mkdir -p "$BUILD"
echo "# llama.cpp $LLAMA_CPP_COMMIT (llama-cpp-python $VERSION sdist), built $(date -u +%FT%TZ)" \
  >>"$BUILD/build.log"
( set -x
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cuda_flags[@]}" "${cpu_flags[@]}" \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_CCACHE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=OFF &&
  { [ "${CONFIGURE_ONLY:-0}" = 1 ] || nice -n "$NICE" cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"; }
) >>"$BUILD/build.log" 2>&1 || { tail -30 "$BUILD/build.log" >&2; log "build failed (log: $BUILD/build.log)"; exit 1; }
if [ "${CONFIGURE_ONLY:-0}" = 1 ]; then log "configured $SRC in $BUILD (CONFIGURE_ONLY=1)"; exit 0; fi

# 4. stage what the GPU machine needs: the binaries, libllama/libggml*, every backend module
mkdir -p "$DEST"
rm -f "$DEST"/*
cp -L "${TARGETS[@]/#/$BUILD/bin/}" "$DEST/"
cp -L "$BUILD"/bin/*.so* "$DEST/"
printf '%s\n' "llama.cpp $LLAMA_CPP_COMMIT" "llama-cpp-python $VERSION" "cuda_arch 90" \
  "cpu $([ "${CPU_NATIVE:-0}" = 1 ] && echo native || echo all-variants)" \
  "cublas_lib $CUBLAS_LIB" >"$DEST/BUILD_INFO"
log "staged in $DEST ($(du -sh "$DEST" | cut -f1)): $(ls "$DEST" | tr '\n' ' ')"
