#!/usr/bin/env bash
# The one-command GPU check (issue 39 item 5), run from the repo root on a remote H100/H200 (the
# `device` tool), inside one command's 10 minutes; stops cleanly before PIJ_CHECK_BUDGET_S.
#   1. build    our modules with CUDA (build_and_test.sh, PIJ_BUILD_ONLY=1)
#   2. llama    llama.cpp CUDA for sm_90 (CPU backend native to the machine) from the carried
#               source subset (build_llama_cpp_cuda.sh), in the background from the start, niced
#   3. tests    the CUDA tests and compute-sanitizer memcheck (build_and_test.sh)
#   4. generate the SYNTHETIC 90%-sparse Llama-2-7B-shaped ReLU model, BF16 GGUF + PowerInfer GGUF
#               with predictors (python -m powerinfer_jax.synthetic), in the background from the
#               start: tokenizer and calibration text from .gpu_carry/, few calibration tokens
#   5. bench    our hybrid with the model's predictors at a 25% VRAM budget against llama.cpp -ngl
#               at the same VRAM, interleaved rounds (sparse_7b_bench.py)
# Needs .gpu_carry/ (python -m benchmarks.gpu.sparse_7b_prepare, here) named in the call's carry.
# $OUT gets at most 8 files (the tool's limit): sparse_7b.jsonl (the timing rows), steps.jsonl
# (each step: seconds, status, why skipped), summary.txt, logs.tar.gz (every log), and
# llama-bin.tar.xz (the llama.cpp build, when under 16 MB): copied to .gpu_carry/, the next run
# unpacks it instead of building. A build made on the CPU machine beforehand (nvcc is enough:
# build_llama_cpp_cuda.sh, then sparse_7b_prepare.py packs .peers/llama.cpp-cuda) is carried the
# same way and runs on any host CPU: the check then spends no time building llama.cpp.
#
# --moe: issue 35's check instead of steps 3-5: no CUDA tests (the first check runs them), the
# SYNTHETIC OLMoE-1B-7B-shaped MoE (F16 GGUF, power-law routing: python -m
# powerinfer_jax.synthetic.moe) generated, and our hot experts at a VRAM budget of our dense parts
# plus 25% of the expert bytes timed against llama.cpp -ngl all --n-cpu-moe N at the same budget
# (moe_bench.py); rows in moe.jsonl. Run it as the second call, right after the first.
#
# --dry-run: the same steps on this CPU machine at a tiny shape, to prove the pipeline end to
# end: no CUDA build, tests or sanitizer (skipped, said so); llama.cpp: the carried subset is
# unpacked and configured (CPU), llama-bench is a CPU build ($PIJ_LLAMA_CPP_BIN or the peers');
# generate and bench run as on the GPU (bench --device cpu: no GPU figure).
#
# Usage: bash benchmarks/gpu/sparse_7b_check.sh [--moe] [--dry-run]
#   env: PIJ_CHECK_BUDGET_S  seconds from the start to be done by (default 560; dry run 900)
#        PIJ_THREADS         host threads for both engines (default: nproc)
#        PIJ_CALIB_TOKENS    calibration tokens (default 256; a multiple of 256)
#        PIJ_N_LAYERS        the model's layers (default: Llama-2-7B's 32; fewer when the
#                            generator cannot finish in time: the rows record the shape)
#        PIJ_BENCH_RESERVE_S seconds kept for the timing step: the generator is stopped before
#                            (default 170)
#        PIJ_ROUNDS          interleaved timing rounds (default 2)
#        PIJ_LLAMA_BIN       a llama.cpp build to use instead of building one
#        PIJ_WORK            scratch folder (default /tmp/pij_sparse_7b; dry run: a fresh temp)
#        PIJ_SANITIZE_TIMEOUT compute-sanitizer's limit (default 150 s)
set -uo pipefail
DRY=0
MOE=0
DRY_TMP=''
LLAMA_BUILT=0  # read by finish(), which can run before the llama step
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --moe) MOE=1 ;;
    *) echo "sparse_7b_check.sh: expected --moe and/or --dry-run, got $arg" >&2; exit 2 ;;
  esac
done
ROWS=$([ $MOE = 1 ] && echo moe.jsonl || echo sparse_7b.jsonl)
START=$(date +%s)
BUDGET_S=${PIJ_CHECK_BUDGET_S:-$([ $DRY = 1 ] && echo 900 || echo 560)}
DEADLINE=$((START + BUDGET_S))
CARRY=${PIJ_CARRY:-.gpu_carry}
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/logs
mkdir -p "$LOGS"
STEPS=$OUT/steps.jsonl
: >"$STEPS"
THREADS=${PIJ_THREADS:-$(nproc)}
ROUNDS=${PIJ_ROUNDS:-2}
CALIB_TOKENS=${PIJ_CALIB_TOKENS:-256}
BENCH_RESERVE_S=${PIJ_BENCH_RESERVE_S:-170}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ $DRY = 1 ]; then
  PY=${PYTHON:-python}
  WORK=${PIJ_WORK:-}
  [ -n "$WORK" ] || { WORK=$(mktemp -d /tmp/pij_sparse_7b_dry.XXXXXX); DRY_TMP=$WORK; }
  # a tiny llama shape the generator accepts (multiples of 32, rank < d_model - 32)
  SHAPE=(--shape llama2-7b --d-model 128 --n-layers 4 --n-heads 4 --n-kv-heads 4 --head-dim 32
         --d-ff 512 --rank 15)
  # experts large enough beside the 50k vocabulary that the budget leaves some on the host
  MOE_SHAPE=(--shape olmoe-1b-7b --d-model 128 --n-layers 4 --n-heads 4 --n-kv-heads 4
             --head-dim 32 --d-ff 1024 --n-experts 32 --top-k 4)
  DEVICE=cpu
else
  PY=python3
  WORK=${PIJ_WORK:-/tmp/pij_sparse_7b}
  SHAPE=(--shape llama2-7b ${PIJ_N_LAYERS:+--n-layers $PIJ_N_LAYERS})
  MOE_SHAPE=(--shape olmoe-1b-7b ${PIJ_N_LAYERS:+--n-layers $PIJ_N_LAYERS})
  DEVICE=gpu
fi
mkdir -p "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
COMMIT=$(cat "$CARRY/COMMIT" 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)

now() { date +%s; }
left() { echo $((DEADLINE - $(now))); }
say() { echo "[sparse_7b_check +$(( $(now) - START ))s] $*" | tee -a "$LOGS/check.log"; }
# record NAME STATUS SECONDS [NOTE]: one row of steps.jsonl
record() {
  "$PY" -c 'import json, sys; n, s, t, note = sys.argv[1:5]
print(json.dumps({"step": n, "status": s, "seconds": int(t), "note": note or None}))' \
    "$1" "$2" "$3" "${4:-}" >>"$STEPS"
  say "step $1: $2 in $3 s${4:+ ($4)}"
}
# run_step NAME NEED_S CMD...: run CMD if NEED_S seconds are left, under the time left
run_step() {
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then
    record "$name" skipped 0 "not enough time: needs ~${need} s, $(left) s left"; return 1
  fi
  local t0 rc
  t0=$(now)
  timeout --kill-after=5 "$(left)" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then record "$name" ok $(( $(now) - t0 ))
  else record "$name" "failed (rc $rc)" $(( $(now) - t0 )) "log: logs/$name.log"; fi
  return $rc
}
finish() {
  say "done in $(( $(now) - START )) s (budget ${BUDGET_S} s); rows: $ROWS"
  {
    echo "commit $COMMIT  dry_run $DRY  threads $THREADS  work $WORK"
    cat "$STEPS"
    [ -f "$LOGS/bench.log" ] && grep -E "hybrid / llama|^\{" "$LOGS/bench.log" | tail -12
  } >"$OUT/summary.txt"
  # the llama.cpp build, for the next run to carry (.gpu_carry/llama-bin.tar.xz): the tool
  # returns files up to 16 MB
  if [ $DRY = 0 ] && [ $LLAMA_BUILT = 1 ] && [ -x "$LLAMA_BIN/llama-bench" ]; then
    tar -C "$WORK" -cf - llama-bin | xz -T0 -6 >"$OUT/llama-bin.tar.xz"
    if [ "$(stat -c %s "$OUT/llama-bin.tar.xz")" -gt $((16 * 1000 * 1000)) ]; then
      say "llama-bin.tar.xz: $(du -h "$OUT/llama-bin.tar.xz" | cut -f1), over the 16 MB the tool returns: dropped"
      rm -f "$OUT/llama-bin.tar.xz"
    fi
  fi
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  [ -z "${DRY_TMP:-}" ] || rm -rf "$DRY_TMP"
}
trap finish EXIT

say "commit $COMMIT, dry run $DRY, moe $MOE, $THREADS threads, budget ${BUDGET_S} s, work $WORK"
for f in tokenizer.gguf calib.txt; do
  [ -f "$CARRY/$f" ] || { say "$CARRY/$f: expected (python -m benchmarks.gpu.sparse_7b_prepare, then carry $CARRY), got none"; exit 1; }
done

# 0. wheels the GPU image lacks (gguf)
if [ $DRY = 0 ] && ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
  t0=$(now)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$CARRY"/whl/*.whl >"$LOGS/wheels.log" 2>&1 && record wheels ok $(( $(now) - t0 )) ||
    record wheels failed $(( $(now) - t0 )) "log: logs/wheels.log"
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{ nvidia-smi -L 2>&1 || true; nproc; $PY --version; free -g | head -2; } >"$LOGS/env.txt" 2>&1

# 4 (background from the start). the synthetic model: CPU XLA, so it takes no GPU memory
MODEL=$WORK/$([ $MOE = 1 ] && echo moe_model || echo model)
GEN_T0=$(now)
GEN_S=$(( $(left) - BENCH_RESERVE_S > 60 ? $(left) - BENCH_RESERVE_S : 60 ))
if [ $MOE = 1 ]; then
  # F16: llama.cpp's bytes per weight equal ours (bfloat16), so a budget buys both the same share
  GEN=(-m powerinfer_jax.synthetic.moe "${MOE_SHAPE[@]}" --qtype F16
       --calib-tokens "${PIJ_MOE_CALIB_TOKENS:-1024}")
else
  GEN=(-m powerinfer_jax.synthetic "${SHAPE[@]}" --sparsity 0.9 --qtype BF16
       --formats gguf,powerinfer --calib-tokens "$CALIB_TOKENS")
fi
( export JAX_PLATFORMS=cpu
  timeout --kill-after=5 "$GEN_S" $PY "${GEN[@]}" --tokenizer "$CARRY/tokenizer.gguf" \
    --calib-text "$CARRY/calib.txt" --verify-tokens 0 --out "$MODEL" ) >"$LOGS/generate.log" 2>&1 &
GEN_PID=$!

# 2 (background from the start, at a lower priority than our build). llama.cpp
LLAMA_BIN=${PIJ_LLAMA_BIN:-}
LLAMA_PID=''
HOST_CPU=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | xargs)
if [ -z "$LLAMA_BIN" ] && [ $DRY = 0 ] && [ -f "$CARRY/llama-bin.tar.xz" ]; then
  # a carried build: minutes saved. Either packed by sparse_7b_prepare.py --llama-bin (built on
  # the CPU machine with every CPU level as a backend chosen at run time: runs on any host), or
  # one an earlier run sent back, whose CPU backend is native to the CPU it was built on: used
  # only on the same CPU model
  mkdir -p "$WORK" && rm -rf "$WORK/llama-bin" && tar xJf "$CARRY/llama-bin.tar.xz" -C "$WORK"
  if grep -qxF "cpu all-variants" "$WORK/llama-bin/BUILD_INFO" 2>/dev/null ||
     grep -qxF "host_cpu $HOST_CPU" "$WORK/llama-bin/BUILD_INFO" 2>/dev/null; then
    LLAMA_BIN=$WORK/llama-bin
  else
    say "carried llama-bin: built on $(sed -n 's/^host_cpu //p' "$WORK/llama-bin/BUILD_INFO"), this is $HOST_CPU: building"
    rm -rf "$WORK/llama-bin"
  fi
fi
if [ -n "$LLAMA_BIN" ]; then
  record llama skipped 0 "a build given: $LLAMA_BIN ($(head -1 "$LLAMA_BIN/BUILD_INFO" 2>/dev/null))"
else
  LLAMA_BUILT=1
  LLAMA_T0=$(now)
  mkdir -p "$WORK/peers"
  if [ $DRY = 1 ]; then
    ( tar xJf "$CARRY/llama.cpp-src.tar.xz" -C "$WORK" &&
      LLAMA_CPP_SRC=$WORK/llama.cpp PIJ_PEERS=$WORK/peers GGML_CUDA=OFF CONFIGURE_ONLY=1 CPU_NATIVE=1 \
        bash benchmarks/gpu/build_llama_cpp_cuda.sh ) >"$LOGS/llama.log" 2>&1 &
    LLAMA_BIN=${PIJ_LLAMA_CPP_BIN:-${POWERINFER_JAX_CACHE:-$HOME/.cache/powerinfer_jax}/peers/llamacpp-cpu-native/bin}
  else
    ( tar xJf "$CARRY/llama.cpp-src.tar.xz" -C "$WORK" &&
      timeout --kill-after=5 $(( $(left) - 120 > 30 ? $(left) - 120 : 30 )) env LLAMA_CPP_SRC="$WORK/llama.cpp" \
        PIJ_PEERS="$WORK/peers" JOBS="$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))" NICE=10 CPU_NATIVE=1 \
        bash benchmarks/gpu/build_llama_cpp_cuda.sh "$WORK/llama-bin" ) >"$LOGS/llama.log" 2>&1 &
    LLAMA_BIN=$WORK/llama-bin
  fi
  LLAMA_PID=$!
fi

# 1. our modules with CUDA
if [ $DRY = 1 ]; then
  record build skipped 0 "dry run: no CUDA (the venv's editable install holds the CPU module)"
else
  run_step build 120 env OUT="$LOGS/cuda" PIJ_BUILD_ONLY=1 bash benchmarks/gpu/build_and_test.sh
fi

# 3. the CUDA tests and compute-sanitizer (the build above is up to date: ninja returns at once)
if [ $DRY = 1 ]; then
  record tests skipped 0 "dry run: no GPU (the CUDA tests need one)"
  record sanitizer skipped 0 "dry run: no GPU (compute-sanitizer needs one)"
elif [ $MOE = 1 ]; then
  record tests skipped 0 "--moe: the first check (no --moe) runs the CUDA tests"
  record sanitizer skipped 0 "--moe: the first check (no --moe) runs compute-sanitizer"
elif grep -q '"step": "build", "status": "ok"' "$STEPS"; then
  run_step tests 90 env OUT="$LOGS/cuda" PIJ_SANITIZE_TIMEOUT="${PIJ_SANITIZE_TIMEOUT:-150}" \
    bash benchmarks/gpu/build_and_test.sh
  # build_and_test.sh exits with pytest's status; compute-sanitizer's is in its output
  san=$(sed -n 's/^compute-sanitizer memcheck rc=\([0-9]*\) in \([0-9]*\) s.*/\1 \2/p' "$LOGS/tests.log")
  if [ -z "$san" ]; then record sanitizer "failed (no result)" 0 "log: logs/tests.log"
  elif [ "${san% *}" = 0 ]; then record sanitizer ok "${san#* }" "$(grep -m1 'ERROR SUMMARY' "$LOGS/cuda/sanitizer.log")"
  else record sanitizer "failed (rc ${san% *})" "${san#* }" "log: logs/cuda/sanitizer.log"; fi
else
  record tests skipped 0 "the build failed"
fi

# wait for the background steps
if [ -n "$LLAMA_PID" ]; then
  wait "$LLAMA_PID"; rc=$?
  [ $rc = 0 ] && [ $DRY = 0 ] && echo "host_cpu $HOST_CPU" >>"$LLAMA_BIN/BUILD_INFO"
  if [ $rc = 0 ]; then record llama ok $(( $(now) - LLAMA_T0 )) \
    "$([ $DRY = 1 ] && echo "dry run: subset unpacked and configured (CPU); llama-bench: $LLAMA_BIN")"
  else record llama "failed (rc $rc)" $(( $(now) - LLAMA_T0 )) "log: logs/llama.log"; fi
fi
wait "$GEN_PID"; rc=$?
if [ $rc = 0 ]; then record generate ok $(( $(now) - GEN_T0 )) "$(tail -1 "$LOGS/generate.log" | cut -c1-300)"
else record generate "failed (rc $rc)" $(( $(now) - GEN_T0 )) "log: logs/generate.log"; fi

# 5. the timing
if [ ! -f "$MODEL/synthetic.json" ] || [ ! -x "$LLAMA_BIN/llama-bench" ]; then
  record bench skipped 0 "needs the model ($MODEL) and llama-bench ($LLAMA_BIN)"
else
  # cuBLAS and the CUDA runtime (libggml-cuda needs libcublas.so.13, libcudart.so.13): the
  # build's own folder when it was built here, else the GPU image's (CUDA's lib64 or the
  # nvidia wheels its python3 has: a carried build names none)
  CUBLAS_LIB=$(sed -n 's/^cublas_lib //p' "$LLAMA_BIN/BUILD_INFO" 2>/dev/null)
  for d in "$CUBLAS_LIB" /usr/local/cuda/lib64 $($PY -c 'import glob, site
print(" ".join(sorted({p.rsplit("/", 1)[0] for d in site.getsitepackages()
  for p in glob.glob(d + "/nvidia/**/lib/lib*.so.13", recursive=True)})))' 2>/dev/null); do
    [ -n "$d" ] && [ "$d" != none ] && [ -d "$d" ] &&
      export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  if [ $DRY = 0 ] && [ -f "$LLAMA_BIN/libggml-cuda.so" ]; then
    missing=$(LD_LIBRARY_PATH=$LLAMA_BIN:$LD_LIBRARY_PATH ldd "$LLAMA_BIN/libggml-cuda.so" | grep "not found" | xargs)
    [ -z "$missing" ] || say "libggml-cuda.so: libraries not found: $missing (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
  fi
  run_step bench 60 $PY -m benchmarks.gpu.$([ $MOE = 1 ] && echo moe_bench || echo sparse_7b_bench) \
    --model-dir "$MODEL" --llama-bin "$LLAMA_BIN" --budget 0.25 --device $DEVICE \
    --threads "$THREADS" --rounds "$ROUNDS" --deadline $((DEADLINE - 10)) --commit "$COMMIT" \
    --out "$OUT/$ROWS"
  grep -E "hybrid / llama" "$LOGS/bench.log" | tee -a "$LOGS/check.log"
fi
grep -q '"status": "failed' "$STEPS" && exit 1
exit 0
