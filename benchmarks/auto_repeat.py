"""`--sparsity auto` decided again and again on fresh decision caches (issue 37): every run must
pick the same mode or report a tie.

Each run is a fresh process (`python -m powerinfer_jax.generate --sparsity auto --json`, a short
generation) after the cached decision files (`auto_choice-*.json` in the model's artifacts
directory) are removed; everything else (the model, compiled steps, the full sparsity artifacts
if a run built them) stays, as it would for a user. One row per run (verdict, chosen mode,
ratio, interval, rounds, the estimate) and a summary row.

    flock -x /tmp/pij_cpu.lock python benchmarks/auto_repeat.py --runs 10 \
        [--dtype bfloat16] [--out benchmarks/auto_repeat.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from powerinfer_jax._machine import git_commit, machine_info
from powerinfer_jax.cache import cache_dir

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    root = cache_dir() / "models" / args.model / "sparsity"  # the registry model's artifacts
    base = {"bench": "auto_repeat", "run_id": time.strftime("%Y%m%dT%H%M%S"),
            "commit": git_commit(), "machine": machine_info(),
            "threads": len(os.sched_getaffinity(0)),
            "config": {"model": args.model, "dtype": args.dtype, "artifacts": str(root)}}
    rows = []
    for i in range(args.runs):
        for f in root.glob("auto_choice-*.json"):
            f.unlink()
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", "--model",
                              args.model, "--dtype", args.dtype, "--sparsity", "auto",
                              "--prompt", "Hi", "--max-new-tokens", "4", "--json"],
                             capture_output=True, text=True, cwd=REPO, timeout=3600)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        auto = json.loads(out.stdout.strip().splitlines()[-1])["auto"]
        rows.append({**base, "run": i, "wall_s": time.perf_counter() - t0,
                     "loadavg": os.getloadavg()[0], **auto})
        print(f"run {i}: {auto['verdict']} -> {auto['chosen']} ({auto['why']})",
              file=sys.stderr)
    chosen = {r["chosen"] for r in rows}
    verdicts = [r["verdict"] for r in rows]
    summary = {**base, "summary": True, "runs": len(rows),
               "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
               "chosen": sorted(chosen),
               "same_mode_or_tie": len({r["chosen"] for r in rows if r["verdict"] != "tie"})
               <= 1}
    rows.append(summary)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
