#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-batched-bench`) for benchmarks/serve_load.py from
# the llama.cpp tree vendored in the llama-cpp-python sdist: the same llama.cpp the peers
# experiment runs through llama-cpp-python, so both comparisons measure one llama.cpp.
#
#   bash benchmarks/build_llama_server.sh [WORK_DIR]     (default: ../llama_cpp_build, outside the repo)
#
# CPU only, -march=native (GGML_NATIVE), static libraries, no web UI download, no curl/openssl.
# Runs under nice with 2 jobs (the build takes ~15-30 min on 2 shared cores). Prints the path of
# the llama-server binary on its last line. Needs python3 with pip, cmake >= 3.14 and a C++17
# compiler; the only download is the sdist from PyPI.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-${REPO_ROOT}/../llama_cpp_build}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
mkdir -p "${WORK}"
WORK="$(cd "${WORK}" && pwd)"
SDIST="${WORK}/llama_cpp_python-${VERSION}.tar.gz"
SRC="${WORK}/llama_cpp_python-${VERSION}/vendor/llama.cpp"
BUILD="${WORK}/build-${VERSION}"

if [[ ! -f "${SDIST}" ]]; then
  "${PYTHON}" -m pip download --no-binary llama-cpp-python --no-deps "llama-cpp-python==${VERSION}" -d "${WORK}"
fi
if [[ ! -f "${SRC}/CMakeLists.txt" ]]; then
  tar -xzf "${SDIST}" -C "${WORK}"
fi

nice -n 10 cmake -S "${SRC}" -B "${BUILD}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
nice -n 10 cmake --build "${BUILD}" --config Release -j "${JOBS}" \
  --target llama-server llama-batched-bench

echo "${BUILD}/bin/llama-server"
