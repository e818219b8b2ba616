#!/usr/bin/env bash
# End-to-end decode with each sparsity mode vs dense, same model, threads and run (issues 3 and 4):
# appends bench rows to benchmarks/e2e_sparsity.jsonl. Predictor mode runs with the q4 predictor
# at target sparsity 0.5 and 0.6 (with the active neurons' gate/up rows read at the dtype, and with
# --gate-up q4: the q4 estimates as activations, down rows only), and with the trained low-rank
# predictors at 0.5.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/e2e_sparsity.jsonl}
bench() {
  python -m powerinfer_jax.bench --threads 2 --prompt-tokens 64 --new-tokens 128 --repeats 3 \
    --out "$out" --tag e2e_sparsity "$@"
}
for dtype in bfloat16 float32; do
  bench --dtype "$dtype" --sparsity dense
  bench --dtype "$dtype" --sparsity oracle --target-sparsity 0.5
  for target in 0.5 0.6; do
    bench --dtype "$dtype" --sparsity predictor --predictor q4 --target-sparsity "$target" --weights dtype
    bench --dtype "$dtype" --sparsity predictor --predictor q4 --target-sparsity "$target" --weights dtype \
      --gate-up q4
  done
  if [ "${PIJ_E2E_LOWRANK:-1}" = 1 ]; then  # trains the low-rank predictors on first use (~6 min)
    bench --dtype "$dtype" --sparsity predictor --predictor lowrank --target-sparsity 0.5
  fi
  bench --dtype "$dtype" --sparsity dense  # dense again: the machine's drift during the run
done
