#!/usr/bin/env bash
# The sparse FFN op microbenchmark grid of issue 3: SmolLM2 (D=576, F=1536) and Llama-2-7B
# (D=4096, F=11008) shapes, 5-100% active, float32 and bfloat16 weights, 1 and 2 threads.
# Appends one JSONL row per point to benchmarks/sparse_ffn_op.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/sparse_ffn_op.jsonl}
for shape in "576 1536" "4096 11008"; do
  set -- $shape
  for dtype in bfloat16 float32; do
    for threads in 2 1; do
      for active in 0.05 0.1 0.25 0.5 1.0; do
        python -m powerinfer_jax.bench --op sparse_ffn --d "$1" --f "$2" --active "$active" \
          --dtype "$dtype" --threads "$threads" --repeats 40 --out "$out" --tag op_grid
      done
    done
  done
done
