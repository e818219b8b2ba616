"""A kernel change's A/B: the same Python checkout, two builds of the compiled module
(`powerinfer_jax._pij_ext`), interleaved, so that a C++ change is timed without a second venv or
worktree (benchmarks/ab_commits.py compares whole checkouts).

Build the other side with CMake into a folder of its own (BUILD.md, "A/B of a kernel change"):

    cmake -S <checkout at the old commit> -B /tmp/before -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE=$(which python) && cmake --build /tmp/before -j2
    python -m benchmarks.ext_ab --before /tmp/before/_pij_ext*.so \
        --after build/cp311-*/native/_pij_ext*.so \
        --rounds 3 --model /work/models/s90/...powerinfer.gguf --out benchmarks/ext_ab.jsonl

Per round, each side in turn (the order swapped every other round; this VM drifts 20-30% over
minutes, so only ratios within a round mean anything), each probe in a fresh process:
  qlinear_rows   decode matvecs over weights in the file's row layout (Q4_0, 4096 x 4096, the
                 layout the sparse FFN's gate/up rows and the MoE experts are read in): GB/s from
                 DRAM (64 matrices, 604 MB) and from the last-level cache (4 matrices, 38 MB)
  decode         `python -m powerinfer_jax.bench --json` on --model with --bench-args (default: the
                 predictor mode, 2 threads): decode tokens/s
One JSONL row per (round, side, probe), then per probe the median of the rounds' after/before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BENCH = ("--sparsity powerinfer --dtype bfloat16 --threads 2 --prompt-tokens 16 "
                 "--new-tokens 64 --repeats 3 --max-seq-len 256")


def load_extension(path: str) -> None:
    """Make `powerinfer_jax._pij_ext` the module built at `path` (before anything imports it)."""
    import importlib.util  # lazy: only the child processes load a build by path

    import powerinfer_jax

    spec = importlib.util.spec_from_file_location("powerinfer_jax._pij_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["powerinfer_jax._pij_ext"] = module
    powerinfer_jax._pij_ext = module


def qlinear_rows_gbs(threads: int, count: int, repeats: int = 7) -> float:
    """GB/s of decode matvecs chained over `count` Q4_0 4096 x 4096 matrices in the row layout."""
    import jax  # lazy: child process only
    import jax.numpy as jnp
    import numpy as np

    from powerinfer_jax.ops import _ffi

    _ffi.set_num_threads(threads)
    d, row_bytes = 4096, 4096 // 32 * 18
    rng = np.random.default_rng(0)
    mats = []
    for _ in range(count):
        b = rng.integers(0, 256, size=(d, d // 32, 18), dtype=np.uint8)
        b[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
        mats.append(jnp.asarray(b.reshape(d, row_bytes)))

    @jax.jit
    def chain(x, ms):
        for m in ms:
            x = _ffi.qlinear(x, m, "Q4_0", None)
            x = x / (jnp.abs(x).max() + 1.0)
        return x

    x = jnp.ones((1, d), jnp.float32)
    chain(x, mats).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        chain(x, mats).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return count * d * row_bytes / best / 1e9


def child(args) -> None:
    load_extension(args.extension)
    if args.probe == "qlinear_rows":
        out = {"dram_gbs": qlinear_rows_gbs(args.threads, 64),
               "cache_gbs": qlinear_rows_gbs(args.threads, 4)}
    else:
        import runpy  # lazy: child process only

        sys.argv = ["powerinfer_jax.bench", "--model", args.model, *args.bench_args.split(),
                    "--json"]
        runpy.run_module("powerinfer_jax.bench", run_name="__main__", alter_sys=True)
        return
    print(json.dumps(out))


def run_probe(probe: str, extension: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.ext_ab", "--child", "--probe", probe,
           "--extension", extension, "--threads", str(args.threads), "--model", str(args.model),
           "--bench-args", args.bench_args]
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    proc = subprocess.run(["taskset", "-c", ",".join(map(str, cpus)), *cmd], check=False,
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{probe} with {extension} failed:\n{proc.stderr[-3000:]}")
    row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    if probe == "decode":
        return {"decode_tok_s": row["decode_tok_s"], "decode_tok_s_runs": row["decode_tok_s_runs"]}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the old build's _pij_ext .so")
    ap.add_argument("--after", help="the new build's _pij_ext .so")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="",
                    help="decode probe: a GGUF or a model name (none: qlinear_rows only)")
    ap.add_argument("--bench-args", default=DEFAULT_BENCH)
    ap.add_argument("--probes", nargs="+", choices=["qlinear_rows", "decode"],
                    default=["qlinear_rows", "decode"], help="decode needs --model")
    ap.add_argument("--note", default="", help="what the two builds differ in")
    ap.add_argument("--out", default="benchmarks/ext_ab.jsonl")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--extension", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return
    for side in ("before", "after"):
        path = getattr(args, side)
        if not path or not Path(path).is_file():
            raise SystemExit(f"--{side}: expected a built _pij_ext .so file, got {path!r}")
    if args.model and "/" in args.model and not Path(args.model).is_file():
        raise SystemExit(f"--model: expected a GGUF file or a model name, got {args.model!r}")
    probes = [p for p in args.probes if p != "decode" or args.model]
    from powerinfer_jax._machine import git_commit, machine_info

    base = {"experiment": "ext_ab", "commit": git_commit(), "machine": machine_info(),
            "threads": args.threads, "note": args.note,
            "model": args.model, "bench_args": args.bench_args,
            "builds": {"before": args.before, "after": args.after}}
    got: dict = {p: {"before": [], "after": []} for p in probes}
    with open(args.out, "a", encoding="utf-8") as f:
        for r in range(args.rounds):
            sides = ("before", "after") if r % 2 == 0 else ("after", "before")
            for probe in probes:
                for side in sides:
                    res = run_probe(probe, getattr(args, side), args)
                    got[probe][side].append(res)
                    row = {**base, "round": r, "side": side, "probe": probe, **res,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(json.dumps({k: row[k] for k in ("round", "side", "probe")} | res))
        for probe in probes:
            keys = [k for k in got[probe]["before"][0] if not k.endswith("_runs")]
            summary = {**base, "kind": "summary", "probe": probe, "rounds": args.rounds}
            for k in keys:
                ratios = [a[k] / b[k] for a, b in zip(got[probe]["after"], got[probe]["before"])]
                summary[f"{k}_after_over_before"] = statistics.median(ratios)
                summary[f"{k}_ratios"] = ratios
            f.write(json.dumps(summary) + "\n")
            print(json.dumps({k: v for k, v in summary.items() if "over" in k or k == "probe"}))


if __name__ == "__main__":
    main()
