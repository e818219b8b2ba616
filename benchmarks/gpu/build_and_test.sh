#!/usr/bin/env bash
# On a GPU machine (the `device` tool's H100/H200), from the repo root: build both extension
# modules with PIJ_CUDA=ON against the local python3's jax, then run the CUDA tests and
# compute-sanitizer memcheck on the hybrid handler. Logs go to $OUT (or ./gpu_logs).
# Usage: bash benchmarks/gpu/build_and_test.sh [pytest args...]   (PIJ_BUILD_ONLY=1: build only)
# Carry .whl (benchmarks/gpu/prepare_wheels.sh) with the call: the image has no `gguf`.
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=$(command -v python3)
# Wheels carried from the build machine (benchmarks/gpu/prepare_wheels.sh): packages the image lacks
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi -L; nproc; $PY --version
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
BUILD=${PIJ_GPU_BUILD:-/tmp/pij_build_cuda}
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DPIJ_CUDA=ON -DPython_EXECUTABLE="$PY" >"$OUT/cmake.log" 2>&1 &&
  cmake --build "$BUILD" -j"$(nproc)" >>"$OUT/cmake.log" 2>&1 || { tail -50 "$OUT/cmake.log"; exit 1; }
# each module replaced by a rename, and only when it changed: a process that has the old one
# mapped (sparse_7b_check.sh starts the generator beside this build) keeps its file; copying over
# it in place killed the --moe check's generator with SIGSEGV on an H200 (2026-11-30)
for so in "$BUILD"/_pij_ext*.so "$BUILD"/_pij_cuda*.so; do
  dest=powerinfer_jax/$(basename "$so")
  cmp -s "$so" "$dest" || { cp "$so" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"; }
done
echo "build: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ "${PIJ_BUILD_ONLY:-0}" = 1 ] && exit 0
t0=$(date +%s)
$PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_hybrid.py tests/test_cuda_session.py "$@" \
  2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
rc=${PIPESTATUS[0]}
echo "pytest: $(( $(date +%s) - t0 )) s"
if [ "${PIJ_SANITIZE:-1}" = 1 ]; then
  # memcheck on the hybrid handler (a few cases: every dtype, both criteria, T=1 and 3)
  t0=$(date +%s)
  timeout "${PIJ_SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider tests/test_cuda_hybrid.py -k "150 and (scores or oracle)" \
    >"$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer memcheck rc=$? in $(( $(date +%s) - t0 )) s (log: sanitizer.log)"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -5
fi
exit $rc
