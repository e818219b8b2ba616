"""Decode tok/s with the weights' arrays advised as transparent huge pages and without
(POWERINFER_JAX_HUGE_PAGES=0; checkpoint/base.aligned_empty), interleaved, with the share of the
process's anonymous memory that the kernel backed with huge pages (/proc/PID/smaps_rollup, the
last sample before the run ends).

  python benchmarks/huge_pages.py --model /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.gguf \
      --rounds 4 [--sparsity dense] [--out benchmarks/huge_pages.jsonl]

One row per (round, side), then a summary row: the median of the rounds' on/off ratios. Run it
under the exclusive CPU lock; SYNTHETIC models are said so in the rows.
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
SIDES = {"off": "0", "on": "1"}


def smaps(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Anonymous", "AnonHugePages"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def run(a, side: str) -> dict:
    cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:a.threads])),
           sys.executable, "-m", "powerinfer_jax.bench", "--model", a.model, "--dtype", a.dtype,
           "--sparsity", a.sparsity, "--threads", str(a.threads), "--prompt-tokens", "16",
           "--new-tokens", str(a.new_tokens), "--repeats", "2", "--max-seq-len", "256", "--json"]
    env = {**os.environ, "POWERINFER_JAX_HUGE_PAGES": SIDES[side]}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    mem = {}
    while proc.poll() is None:
        mem = smaps(proc.pid) or mem
        time.sleep(1.0)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}")
    res = json.loads(out.strip().splitlines()[-1])
    huge = mem.get("AnonHugePages", 0) / max(mem.get("Anonymous", 1), 1)
    return {"decode_tok_s": res["decode_tok_s"], "runs": res["decode_tok_s_runs"],
            "anon_bytes": mem.get("Anonymous"), "huge_share": huge, "cmd": cmd}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--sparsity", default="dense")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "huge_pages.jsonl"))
    a = p.parse_args(argv)
    from powerinfer_jax import _cli

    thp = Path("/sys/kernel/mm/transparent_hugepage")
    head = {"experiment": "huge_pages", "commit": _cli.git_commit(),
            "machine": _cli.machine_info(), "threads": a.threads, "model": a.model,
            "sparsity": a.sparsity, "dtype": a.dtype, "new_tokens": a.new_tokens,
            "synthetic": "synthetic" in a.model.lower(),
            "thp": {k: (thp / k).read_text().strip() for k in ("enabled", "defrag")
                    if (thp / k).is_file()}}
    rows, per = [], {}
    for rnd in range(a.rounds):
        for side in (list(SIDES) if rnd % 2 == 0 else list(SIDES)[::-1]):
            row = {**head, "round": rnd, "side": side, **run(a, side)}
            per.setdefault(rnd, {})[side] = row["decode_tok_s"]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("round", "side", "decode_tok_s",
                                                  "huge_share")}), flush=True)
    ratios = [v["on"] / v["off"] for v in per.values()]
    rows.append({**head, "kind": "summary", "on_over_off": statistics.median(ratios),
                 "ratios": ratios, "rounds": a.rounds})
    print(json.dumps({"on_over_off": rows[-1]["on_over_off"], "ratios": ratios}), flush=True)
    with open(a.out, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
