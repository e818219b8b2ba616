#!/usr/bin/env bash
# End-to-end decode with each sparsity mode vs dense, same model, threads and run (issues 3 and 4):
# appends bench rows to benchmarks/e2e_sparsity.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/e2e_sparsity.jsonl}
for dtype in bfloat16 float32; do
  for mode in dense oracle predictor; do
    python -m powerinfer_jax.bench --sparsity "$mode" --dtype "$dtype" --threads 2 \
      --prompt-tokens 64 --new-tokens 128 --repeats 3 --out "$out" --tag e2e_sparsity
  done
done
