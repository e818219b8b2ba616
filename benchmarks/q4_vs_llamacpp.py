"""Decode tokens/s of our engine against llama.cpp on one Q4_1 GGUF, per ISA build (issue 14).

Per round, back to back, for each ISA build (native: AVX-512 on an AVX-512 machine; avx2: both
systems built for AVX2 only): llama.cpp's llama-bench on the Q4_1 file and on a BF16 GGUF of the
same model (experiments/peers.py writes it once), then our `python -m powerinfer_jax.bench` in each
configuration, each in a fresh process. The machine drifts (a shared VM: 20-30% within minutes),
so the figures to read are the per-round ratios to llama.cpp of the same ISA build and round; the
summary rows give their median over rounds, next to the median tokens/s.

    bash benchmarks/build_llama_bench_cpu.sh LLAMA_CPP_SRC          # both llama-bench builds
    # our AVX2 build in its own venv: BUILD.md "Building for a named instruction set (PIJ_ISA)"
    nice python -m benchmarks.q4_vs_llamacpp --avx2-python ../venv-avx2/bin/python \
        [--rounds 5] [--configs dense_bf16,...] [--out benchmarks/q4_vs_llamacpp.jsonl]
    python -m benchmarks.q4_vs_llamacpp --load-only      # load time and resident memory only

Before the timed rounds the script waits (up to --wait-pytest s) for running pytest processes to
end, SIGSTOPs a running `powerinfer_jax.sparsify` training (SIGCONT always follows, on any exit)
and runs every configuration once untimed (sparsity artifacts and --sparsity auto's cached choice
get built there, not in a timed run). Every row records the load average at its start.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("POWERINFER_JAX_CACHE", Path.home() / ".cache" / "powerinfer_jax"))
MODEL = "smollm2-135m"

# our configurations: name -> (dtype, weights, extra flags of powerinfer_jax.bench)
CONFIGS = {
    "dense_bf16": ("bfloat16", "auto", ["--sparsity", "dense"]),
    "dense_bf16_dtype": ("bfloat16", "dtype", ["--sparsity", "dense"]),
    # the file's blocks: the oracle at the target (the q4 predictor's name before it was refused
    # on kept blocks, where it predicted nothing: rows before that say pred_q4gu_bf16)
    "oracle_t50_bf16": ("bfloat16", "auto", ["--sparsity", "oracle", "--target-sparsity", "0.5"]),
    "auto_bf16": ("bfloat16", "auto", ["--sparsity", "auto"]),
    "dense_f32": ("float32", "auto", ["--sparsity", "dense"]),
}
# the decode block's ablation (one decode step per executable call; not run by default)
ABLATIONS = {f"{name}_block1": (dtype, weights, [*flags, "--decode-block", "1"])
             for name, (dtype, weights, flags) in CONFIGS.items()
             if name in ("dense_bf16", "oracle_t50_bf16")}
LLAMA_CONFIGS = {"llama_q4_1": "Q4_1", "llama_bf16": "BF16"}
ISAS = ("native", "avx2")


# ---------------------------------------------------------------------------------- provenance

def machine() -> dict:
    cpu, flags = "", set()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "avx512_vnni": "avx512_vnni" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "avx_vnni": "avx_vnni" in flags}


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def ext_isa(python: str) -> dict:
    """What an interpreter's powerinfer_jax extension was built for, and where the package is."""
    code = ("import json, powerinfer_jax; from powerinfer_jax import _pij_ext; "
            "print(json.dumps({'isa_info': _pij_ext.isa_info(), 'package': powerinfer_jax.__file__}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ measuring

def llama_bench(binary: Path, gguf: Path, *, threads: int, new_tokens: int) -> tuple[dict, list]:
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
           "-r", "1", "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    gen = [r for r in rows if r.get("n_gen") == new_tokens and r.get("n_prompt") == 0]
    if not gen:
        raise RuntimeError(f"llama-bench: expected a row with n_gen={new_tokens}, got {out[-500:]}")
    return gen[-1], cmd


def ours(python: str, config: str, *, threads: int, new_tokens: int, prompt_tokens: int,
         repeats: int, cwd: Path = REPO) -> tuple[dict, list]:
    dtype, weights, extra = CONFIGS[config]
    cmd = [python, "-m", "powerinfer_jax.bench", "--model", MODEL, "--dtype", dtype,
           "--weights", weights, *extra, "--new-tokens", str(new_tokens), "--prompt-tokens",
           str(prompt_tokens), "--threads", str(threads), "--repeats", str(repeats), "--json"]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


# ------------------------------------------------------------------------------------- summary

def summarize(rows: list[dict]) -> list[dict]:
    """Per (isa, config): median tok/s over rounds and the median over rounds of the ratio to
    llama.cpp Q4_1 and to llama.cpp BF16 of the same ISA build and round."""
    meas = [r for r in rows if r.get("kind") == "decode"]
    by = {}
    for r in meas:
        by.setdefault((r["isa"], r["config"]), {})[r["round"]] = r["tok_s"]
    out = []
    for (isa, config), per_round in sorted(by.items()):
        row = {"kind": "summary", "isa": isa, "config": config,
               "system": "llama.cpp" if config in LLAMA_CONFIGS else "powerinfer_jax",
               "rounds": len(per_round), "median_tok_s": statistics.median(per_round.values())}
        for ref in LLAMA_CONFIGS:
            base = by.get((isa, ref), {})
            ratios = [v / base[k] for k, v in sorted(per_round.items()) if base.get(k)]
            row[f"ratio_to_{ref}_per_round"] = ratios
            row[f"median_ratio_to_{ref}"] = statistics.median(ratios) if ratios else None
        # the same configuration's other ISA build, same round (e.g. native / avx2)
        for other in ISAS:
            if other != isa and (other, config) in by:
                base = by[(other, config)]
                ratios = [v / base[k] for k, v in sorted(per_round.items()) if base.get(k)]
                row[f"median_ratio_to_{other}_build"] = (statistics.median(ratios)
                                                         if ratios else None)
        out.append(row)
    return out


# ---------------------------------------------------------------------------- machine sharing

def pids_of(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    me = os.getpid()
    return [int(p) for p in out.split() if int(p) != me]


def wait_for_pytest(max_s: float) -> float:
    t0 = time.monotonic()
    while pids_of("pytest") and time.monotonic() - t0 < max_s:
        print(f"waiting for pytest {pids_of('pytest')} (load {os.getloadavg()})", file=sys.stderr,
              flush=True)
        time.sleep(30)
    return time.monotonic() - t0


class Paused:
    """SIGSTOP the given processes; SIGCONT them on exit, also on SIGTERM/SIGINT/SIGHUP."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def _cont(self):
        for p in self.pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __enter__(self):
        def handler(signum, frame):
            raise SystemExit(128 + signum)
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, handler)
        for p in self.pids:
            os.kill(p, signal.SIGSTOP)
        print(f"paused {self.pids}", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc):
        self._cont()
        print(f"resumed {self.pids}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- load and memory

_OUR_LOAD = r"""
import json, os, sys, time
t_import = time.perf_counter()
from powerinfer_jax.checkpoint import load_checkpoint, resolve_model
from powerinfer_jax.config import RuntimeConfig, SparsityConfig
from powerinfer_jax.runtime.session import build
import powerinfer_jax.models.transformer  # flax.nnx: library import, as llama.cpp's shared
import powerinfer_jax.checkpoint.gguf     # and the gguf package's tables: libraries load
import jax, jax.numpy as jnp              # before llama.cpp's model-load timer starts
jnp.zeros(1).block_until_ready()  # XLA's CPU client starts here, not inside the load
t_import = time.perf_counter() - t_import
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
path = resolve_model(sys.argv[1])
rss0 = rss()
t0 = time.perf_counter()
ck = load_checkpoint(path, keep_quantized=True)
t1 = time.perf_counter()
s = build(sys.argv[1], RuntimeConfig(dtype="bfloat16", threads=int(sys.argv[2])), SparsityConfig(),
          checkpoint=ck, progress=False)
t2 = time.perf_counter()
res = s.engine.generate([1, 2, 3, 4], max_new_tokens=2)
t3 = time.perf_counter()
print(json.dumps({"import_s": t_import, "load_checkpoint_s": t1 - t0, "build_s": t2 - t1,
                  "first_generate_s": t3 - t2, "load_plus_build_s": t2 - t0,
                  "rss_before": rss0, "rss_after_generate": rss(), "file_bytes": os.path.getsize(path)}))
"""


def warm_read(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def load_rows(args, base: dict, llama_bins: dict) -> list[dict]:
    from powerinfer_jax.checkpoint import resolve_model

    path = Path(resolve_model(MODEL))
    rows = []
    for rep in range(args.load_repeats):
        warm_read(path)
        cmd = [sys.executable, "-c", _OUR_LOAD, MODEL, str(args.threads)]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
        wall = time.perf_counter() - t0
        r = json.loads(out.strip().splitlines()[-1])
        rows.append({**base, "kind": "load", "system": "powerinfer_jax", "isa": "native",
                     "repeat": rep, "weights": "auto", "dtype": "bfloat16", "process_wall_s": wall,
                     "loadavg": os.getloadavg(), "command": "python -c <_OUR_LOAD> " + MODEL, **r})
        simple = llama_bins["native"].parent / "llama-simple"
        if simple.is_file():
            warm_read(path)
            cmd = [str(simple), "-m", str(path), "-n", "2", "Hello"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            load_ms = None
            for line in (p.stderr + p.stdout).splitlines():
                if "load time" in line and "llama_perf_context_print" in line:
                    load_ms = float(line.split("=")[1].split("ms")[0])
            rows.append({**base, "kind": "load", "system": "llama.cpp", "isa": "native",
                         "repeat": rep, "weights": "Q4_1", "process_wall_s": wall,
                         "load_time_s": None if load_ms is None else load_ms / 1e3,
                         "note": "llama_perf_context_print load time: model load (mmap) to the "
                                 "end of the first eval (a 1-2 token prompt)",
                         "rc": p.returncode, "loadavg": os.getloadavg(), "command": " ".join(cmd)})
    return rows


# --------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=",".join(list(LLAMA_CONFIGS) + list(CONFIGS)),
                    help="comma list of " + ", ".join(list(LLAMA_CONFIGS) + list(CONFIGS)
                                                      + list(ABLATIONS)))
    ap.add_argument("--isas", default=",".join(ISAS))
    ap.add_argument("--native-python", default=sys.executable)
    ap.add_argument("--avx2-python", default=os.environ.get("PIJ_AVX2_PYTHON"),
                    help="python of a venv with the PIJ_ISA=avx2 build (default $PIJ_AVX2_PYTHON)")
    ap.add_argument("--llama-root", default=str(CACHE / "peers"),
                    help="where build_llama_bench_cpu.sh put llamacpp-cpu-{native,avx2}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="our bench's timed runs per process")
    ap.add_argument("--wait-pytest", type=float, default=1200.0)
    ap.add_argument("--no-pause", action="store_true", help="do not SIGSTOP a sparsify run")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--load-repeats", type=int, default=3)
    ap.add_argument("--no-load", action="store_true", help="skip the load-time rows")
    ap.add_argument("--load-only", action="store_true")
    ap.add_argument("--sparse-model", default=None, metavar="DIR",
                    help="also time a sparsified model (python -m powerinfer_jax.sparsify's output "
                         "directory): configs sparsified_dense_bf16 and sparsified_oracle_bf16")
    ap.add_argument("--sparse-target", type=float, default=0.85,
                    help="the sparsified model's calibrated target sparsity")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "q4_vs_llamacpp.jsonl"))
    args = ap.parse_args(argv)

    from experiments._common import append_rows, run_id
    from experiments.peers import peer_ggufs

    if args.sparse_model:  # issue 13: a sparsified model (HF directory) beside the dense file
        d, t = args.sparse_model, str(args.sparse_target)
        CONFIGS["sparsified_dense_bf16"] = ("bfloat16", "auto", ["--model", d, "--sparsity",
                                                                 "dense"])
        CONFIGS["sparsified_oracle_bf16"] = ("bfloat16", "auto", [
            "--model", d, "--sparsity", "oracle", "--target-sparsity", t])
    CONFIGS.update(ABLATIONS)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS and c not in LLAMA_CONFIGS:
            ap.error(f"--configs: unknown {c!r}")
    isas = [i for i in args.isas.split(",") if i]
    pythons = {"native": args.native_python, "avx2": args.avx2_python}
    llama_bins = {i: Path(args.llama_root) / f"llamacpp-cpu-{i}" / "bin" / "llama-bench"
                  for i in ISAS}
    for i in isas:
        if not pythons[i]:
            ap.error(f"--{i}-python: needed for the {i} build")
        if any(c in LLAMA_CONFIGS for c in configs) and not llama_bins[i].is_file():
            ap.error(f"no llama-bench at {llama_bins[i]} (benchmarks/build_llama_bench_cpu.sh)")

    base = {"bench": "q4_vs_llamacpp", "run_id": run_id(), "commit": git_commit(),
            "machine": machine(), "threads": args.threads, "model": MODEL}
    from powerinfer_jax.checkpoint import load_checkpoint, resolve_model
    q4 = Path(resolve_model(MODEL))
    ggufs = peer_ggufs(MODEL, None) if all(
        (q4.parent / "peers" / f"{q4.stem.split('.')[0]}.{k}.gguf").is_file()
        for k in ("F32", "BF16")) else peer_ggufs(MODEL, load_checkpoint(q4))
    files = {"Q4_1": ggufs["Q4_1"], "BF16": ggufs["BF16"]}
    isa_of = {i: ext_isa(pythons[i]) for i in isas}
    print(json.dumps({"isa_of": isa_of, "files": {k: str(v) for k, v in files.items()}}),
          file=sys.stderr, flush=True)

    def measure(isa: str, config: str, rnd, warm: bool = False) -> dict:
        la = os.getloadavg()
        t0 = time.time()
        if config in LLAMA_CONFIGS:
            kind = LLAMA_CONFIGS[config]
            r, cmd = llama_bench(llama_bins[isa], files[kind], threads=args.threads,
                                 new_tokens=8 if warm else args.new_tokens)
            row = {"system": "llama.cpp", "dtype": kind, "weights": kind, "tok_s": r["avg_ts"],
                   "llama_bench": {k: r.get(k) for k in ("build_commit", "build_number",
                                                        "cpu_info", "backends", "model_type",
                                                        "model_size", "n_gen", "n_threads",
                                                        "samples_ts", "type_k")}}
        else:
            r, cmd = ours(pythons[isa], config, threads=args.threads,
                          new_tokens=8 if warm else args.new_tokens,
                          prompt_tokens=args.prompt_tokens, repeats=1 if warm else args.repeats,
                          cwd=Path(isa_of[isa]["package"]).parents[1])
            row = {"system": "powerinfer_jax", "dtype": CONFIGS[config][0],
                   "weights": CONFIGS[config][1], "tok_s": r["decode_tok_s"],
                   "decode_tok_s_runs": r.get("decode_tok_s_runs"),
                   "prefill_tok_s": r.get("prefill_tok_s"), "weights_formats": r.get("weights"),
                   "sparsity": r.get("sparsity"), "auto": r.get("auto"),
                   "ext_isa": isa_of[isa]["isa_info"], "package": isa_of[isa]["package"],
                   "bench_commit": r.get("commit"), "source": r.get("source")}
        row = {**base, "kind": "warmup" if warm else "decode", "isa": isa, "config": config,
               "round": rnd, **row, "new_tokens": 8 if warm else args.new_tokens,
               "wall_s": time.time() - t0, "loadavg": la, "command": " ".join(cmd)}
        print(f"[{rnd}] {isa:6s} {config:18s} {row['tok_s']:8.2f} tok/s  load {la[0]:.2f}",
              file=sys.stderr, flush=True)
        return row

    rows: list[dict] = []
    waited = wait_for_pytest(args.wait_pytest)
    pause = [] if args.no_pause else pids_of("powerinfer_jax.sparsify")
    with Paused(pause):
        base["paused_pids"] = pause
        base["waited_for_pytest_s"] = waited
        base["pytest_running_at_start"] = bool(pids_of("pytest"))
        if not args.load_only:
            if not args.no_warmup:
                for isa in isas:
                    for c in configs:
                        measure(isa, c, "warmup", warm=True)
            for rnd in range(args.rounds):
                got = [measure(isa, c, rnd) for isa in isas for c in configs]
                append_rows(args.out, got)
                rows += got
            summ = [{**base, **s} for s in summarize(rows)]
            append_rows(args.out, summ)
            for s in summ:
                print(f"{s['isa']:6s} {s['config']:18s} median {s['median_tok_s']:8.2f} tok/s  "
                      f"/llama Q4_1 {s['median_ratio_to_llama_q4_1'] or float('nan'):.3f}  "
                      f"/llama BF16 {s['median_ratio_to_llama_bf16'] or float('nan'):.3f}")
        if not args.no_load:
            lr = load_rows(args, base, llama_bins)
            append_rows(args.out, lr)
            for r in lr:
                print(json.dumps({k: r.get(k) for k in ("system", "repeat", "load_checkpoint_s",
                                                         "build_s", "load_plus_build_s",
                                                         "first_generate_s", "load_time_s",
                                                         "process_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
