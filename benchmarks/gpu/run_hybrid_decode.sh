#!/usr/bin/env bash
# On a GPU machine, from the repo root: build (PIJ_CUDA=ON), then benchmarks/gpu/hybrid_decode.py
# with the given arguments, rows to $OUT/gpu_hybrid.jsonl (copy them into benchmarks/ afterwards).
# Usage: bash benchmarks/gpu/run_hybrid_decode.sh <commit> [hybrid_decode.py args...]
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
commit=$1; shift
PIJ_BUILD_ONLY=1 bash benchmarks/gpu/build_and_test.sh >/dev/null || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m benchmarks.gpu.hybrid_decode --commit "$commit" --out "$OUT/gpu_hybrid.jsonl" "$@" \
  2>"$OUT/stderr.log"
rc=$?; tail -5 "$OUT/stderr.log"; exit $rc
