#!/usr/bin/env bash
# The GPU burst's whole path on this CPU with a tiny budget, as the two runner calls run it:
# prepare (when .burst/ is missing) -> train_burst.sh stage -> train_burst.sh run with the
# compiled extension blocked (benchmarks/gpu/noext) and the carried wheels installed into a temp
# folder -> files in a fake $OUT (limits checked) -> import-burst -> evaluation rows.
# Usage: bash benchmarks/gpu/dry_run_burst.sh [burst args]   (BUDGET=20 seconds of training)
# Timing here is not the GPU's: this checks that every step works, not how fast.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
[ -f .burst/p2/manifest.json ] || bash benchmarks/gpu/prepare_burst.sh
WORK=$(mktemp -d /tmp/pij_burst_dry.XXXXXX)
export PIJ_BURST_STAGE=$WORK/stage PIJ_SITE=$WORK/site OUT=$WORK/out PYTHON=$PY
bash benchmarks/gpu/train_burst.sh stage
PYTHONPATH=$PWD/benchmarks/gpu/noext bash benchmarks/gpu/train_burst.sh run \
  --budget "${BUDGET:-20}" --deadline 900 --batch 2 --seq-len 128 --samples 4 --sample-batch 4 \
  --eval-chunks 2 --eval-points 1 --refit-tokens 256 --warmup-steps 2 "$@"
$PY -m benchmarks.gpu.burst_import "$OUT" --out "$WORK/model" --no-progress \
  ${PIJ_TRAIN_TEXT:+--corpus "$PIJ_TRAIN_TEXT"} ${PIJ_VALID_TEXT:+--eval-text "$PIJ_VALID_TEXT"} \
  --curve "$WORK/curve.jsonl"
echo "dry run done: $WORK (out: $OUT, model: $WORK/model, rows: $WORK/curve.jsonl)"
