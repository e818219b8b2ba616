"""Whole-process start-up of `python -m powerinfer_jax.generate` next to llama.cpp's (issue 37).

Times the whole process (fork to exit, as a user waits for it) of a short generation on a warm
cache, --repeats times, interleaved with llama.cpp's `llama-simple` on the same GGUF file and, with
--baseline-src, the same command from another source tree (an older commit) in the same rounds.
Each of our rows carries the run's own phase breakdown (`generate --json`'s "startup": import,
jax, load, build, executables, first token, decode; exit is what the wall time has beyond
total_s). The summary row gives the medians, the ratios to llama.cpp and whether every run gave
the same tokens (and llama.cpp the same text).

    flock -x /tmp/pij_cpu.lock python benchmarks/startup.py --repeats 5 \
        [--baseline-src /tmp/pij_base] [--out benchmarks/startup.jsonl]

--baseline-src DIR: a checkout of another commit whose extension is the installed one (a symlink
of site-packages' _pij_ext*.so into DIR/powerinfer_jax); it runs with `python -S` and PYTHONPATH
set to DIR and site-packages, so the editable install's redirect does not apply.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from powerinfer_jax._machine import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]

LLAMA_BIN = Path.home() / ".cache/powerinfer_jax/peers/llamacpp-cpu-native/bin/llama-simple"


def timed(argv, env=None, cwd=None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return wall, out


def ours_argv(args) -> list[str]:
    return ["-m", "powerinfer_jax.generate", "--model", args.model, "--prompt", args.prompt,
            "--max-new-tokens", str(args.max_new_tokens), "--json", "--no-stream"]


def run_ours(args, baseline: bool = False) -> dict:
    env = dict(os.environ)
    argv = [sys.executable, *ours_argv(args)]
    if baseline:
        site = sysconfig.get_paths()["purelib"]
        env["PYTHONPATH"] = os.pathsep.join([str(args.baseline_src), site])
        argv = [sys.executable, "-S", *ours_argv(args)]
    wall, out = timed(argv, env=env, cwd=args.baseline_src if baseline else REPO)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "tokens": row["tokens"], "text": row["text"],
            "startup": row.get("startup"), "source": row["source"]}


def run_llama(args, gguf: str) -> dict:
    wall, out = timed([str(args.llama_bin), "-m", gguf, "-n", str(args.max_new_tokens),
                       args.prompt])
    return {"wall_s": wall, "text": out.stdout.strip()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default="Hi")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    p.add_argument("--baseline-src", type=Path, default=None)
    p.add_argument("--out", default=None, help="append the rows to this JSONL file")
    args = p.parse_args(argv)

    warm = run_ours(args)  # fills the caches (compiled steps); not timed
    systems = {"ours": lambda: run_ours(args)}
    if args.baseline_src is not None:
        run_ours(args, baseline=True)
        systems["baseline"] = lambda: run_ours(args, baseline=True)
    if args.llama_bin.is_file():
        systems["llama.cpp"] = lambda: run_llama(args, warm["source"])
    base = {"bench": "startup", "run_id": time.strftime("%Y%m%dT%H%M%S"),
            "commit": git_commit(), "machine": machine_info(),
            "threads": len(os.sched_getaffinity(0)),
            "config": {"model": args.model, "prompt": args.prompt,
                       "max_new_tokens": args.max_new_tokens, "gguf": warm["source"],
                       "llama_bin": str(args.llama_bin),
                       "baseline_src": None if args.baseline_src is None else
                       str(args.baseline_src)}}
    if args.baseline_src is not None:
        base["config"]["baseline_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline_src, capture_output=True,
            text=True).stdout.strip()
    rows, walls = [], {name: [] for name in systems}
    for i in range(args.repeats):  # interleaved: the VM drifts between runs
        for name, run in systems.items():
            load = os.getloadavg()[0]
            r = run()
            walls[name].append(r["wall_s"])
            rows.append({**base, "system": name, "repeat": i, "loadavg": load, **r})
            print(f"{name:10s} repeat {i}: {r['wall_s']:.3f} s", file=sys.stderr)
    ours = [r for r in rows if r["system"] != "llama.cpp"]
    llama = [r for r in rows if r["system"] == "llama.cpp"]
    med = {name: statistics.median(v) for name, v in walls.items()}
    phases = {k: statistics.median(r["startup"][k] for r in ours if r["system"] == "ours")
              for k in warm["startup"] if k.endswith("_s")} if warm.get("startup") else None
    summary = {**base, "system": "summary", "repeats": args.repeats, "median_wall_s": med,
               "ours_phases_median_s": phases,
               "ours_exit_s_median": statistics.median(
                   r["wall_s"] - r["startup"]["total_s"] for r in ours if r["system"] == "ours"),
               "same_tokens": all(r["tokens"] == warm["tokens"] for r in ours),
               "llama_text_equal": all(r["text"].endswith(warm["text"]) for r in llama)
               if llama else None,
               "ratio_to_llama": {n: med[n] / med["llama.cpp"] for n in med if n != "llama.cpp"}
               if "llama.cpp" in med else None}
    rows.append(summary)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
