#!/usr/bin/env bash
# A GPU burst of sparsification training (benchmarks/gpu/burst.py says what and why), on
# the remote runner's GPU machine, from the repo root, in two calls on the same warm machine (the
# teacher GGUF does not fit in one call's 64 MiB). First, here: bash benchmarks/gpu/prepare_burst.sh
#
#   call 1: bash benchmarks/gpu/train_burst.sh stage         carry [".burst/p1"]      ~1 min
#           copies the teacher's first half to $PIJ_BURST_STAGE (/tmp/pij_burst) and checks it
#   call 2: bash benchmarks/gpu/train_burst.sh run [args]    carry [".burst/p2", ".whl"]
#           installs the carried wheels (gguf) into $PIJ_SITE (/tmp/site), joins the teacher, checks its
#           sha256, trains for --budget seconds (default 390) after compilation, stops training
#           by --deadline (default 420 s after this script started) and writes the weights'
#           change and burst.json into $OUT (<= 8 files, <= 64 MiB), then burst.log
#
# Back here: python -m benchmarks.gpu.burst_import <the fetched $OUT folder>
# A dry run on the CPU (tiny budget): benchmarks/gpu/dry_run_burst.sh.
set -uo pipefail
STARTED=$(date +%s.%N)
STAGE=${PIJ_BURST_STAGE:-/tmp/pij_burst}
SITE=${PIJ_SITE:-/tmp/site}
OUT=${OUT:-burst_out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.92}
elapsed() { awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $STARTED }"; }
mode=${1:-}; shift || true
case "$mode" in
  stage)
    mkdir -p "$STAGE" || exit 1
    cp .burst/p1/teacher.gguf.part1 "$STAGE/" || exit 1
    want=$(cat .burst/p1/teacher.gguf.part1.sha256)
    got=$(sha256sum "$STAGE/teacher.gguf.part1" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "part 1: sha256 $got, expected $want"; exit 1; }
    echo "staged part 1 in $STAGE ($(stat -c %s "$STAGE/teacher.gguf.part1") bytes, sha256 ok)"
    nvidia-smi -L 2>/dev/null; nproc; $PY --version
    $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
    ;;
  run)
    mkdir -p "$OUT" || exit 1
    if ls .whl/*.whl >/dev/null 2>&1; then  # packages the image lacks (prepare_wheels.sh)
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
      export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    [ -f "$STAGE/teacher.gguf.part1" ] || { echo "no $STAGE/teacher.gguf.part1: run the stage call first (same warm machine)"; exit 1; }
    cat "$STAGE/teacher.gguf.part1" .burst/p2/teacher.gguf.part2 > "$STAGE/teacher.gguf" || exit 1
    want=$($PY -c "import json; print(json.load(open('.burst/p2/manifest.json'))['sha256'])")
    got=$(sha256sum "$STAGE/teacher.gguf" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "teacher: sha256 $got, expected $want"; exit 1; }
    echo "teacher joined, sha256 ok; starting the burst at +$(elapsed) s"
    $PY -m benchmarks.gpu.burst --teacher "$STAGE/teacher.gguf" --data .burst/p2 \
      --out "$OUT" --started-at "$STARTED" "$@" 2>&1 | tee "$OUT/burst.log"
    rc=${PIPESTATUS[0]}
    ls -l "$OUT"
    echo "burst rc=$rc after $(elapsed) s"
    exit $rc
    ;;
  *)
    echo "usage: bash benchmarks/gpu/train_burst.sh stage|run [burst args]"; exit 2 ;;
esac
