"""MoE expert placement on a CPU-only machine (issue 35 item 3): the same file run unplaced and
under --vram-budget GiB, where the most often routed experts of each layer are kept as floats
(the notional accelerator's, computed with XLA) and the rest stay the file's blocks on the host
pool (models/moe.py). On a CPU both halves run on the CPU, so this measures the placement's
function and cost at a real shape, not a speed-up: the GPU check is where the hot half gains.

    flock -x /tmp/pij_cpu.lock python -m benchmarks.moe_placement --rounds 2 \\
        --model DIR/synthetic-olmoe-1b-7b-e64k8-h0.8-relu-s0.9-Q4_0.gguf --budgets 6.5

Per round, in fresh processes, alternating the order: `python -m powerinfer_jax.bench` with no
budget, then with each budget. Rows (JSONL, benchmarks/moe_placement.jsonl): decode and prefill
tok/s, the placement (hot fraction per layer, the routings its hot experts serve), peak RSS.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.q4_vs_llamacpp import git_commit, machine

REPO = Path(__file__).resolve().parents[1]


def run(model: str, budget: float | None, a) -> dict:
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", model, "--threads",
           str(a.threads), "--dtype", a.dtype, "--prompt-tokens", str(a.prompt_tokens),
           "--new-tokens", str(a.new_tokens), "--repeats", "2", "--max-seq-len", "128", "--json"]
    if budget is not None:
        cmd += ["--vram-budget", str(budget)]
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "PIJ_MAXRSS_KB %M", *cmd], cwd=REPO,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = [int(l.split()[1]) * 1024 for l in proc.stderr.splitlines()
           if l.startswith("PIJ_MAXRSS_KB")]
    if proc.returncode != 0:
        return {"ok": False, "cmd": cmd, "error": proc.stderr[-1500:], "wall_s": wall}
    out = proc.stdout
    res = json.loads(out.strip().splitlines()[-1])
    place = res.get("placement") or {}
    hot = place.get("hot_fraction") or []
    return {"ok": True, "cmd": cmd, "wall_s": wall, "peak_rss_bytes": rss[-1] if rss else None,
            "decode_tok_s": res.get("decode_tok_s"), "prefill_tok_s": res.get("prefill_tok_s"),
            "hot_fraction_mean": sum(hot) / len(hot) if hot else None,
            "served_fraction": place.get("served_fraction"), "placement": place or None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budgets", type=float, nargs="+", required=True, metavar="GIB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "moe_placement.jsonl"))
    a = ap.parse_args(argv)
    base = {"experiment": "moe_placement", "commit": git_commit(), "machine": machine(),
            "model": a.model, "threads": a.threads, "dtype": a.dtype,
            "synthetic": "random weights (SYNTHETIC): python -m powerinfer_jax.synthetic.moe"}
    configs = [None, *a.budgets]
    with open(a.out, "a", encoding="utf-8") as f:
        for rnd in range(a.rounds):
            for budget in (configs if rnd % 2 == 0 else configs[::-1]):
                row = {**base, "round": rnd, "vram_budget_gib": budget,
                       **run(a.model, budget, a)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps({k: row[k] for k in ("round", "vram_budget_gib", "ok")}
                                 | {k: row.get(k) for k in ("decode_tok_s", "served_fraction",
                                                             "hot_fraction_mean")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
