"""Decode (and prefill) tokens/s of two checkouts, interleaved: a refactor's "no regression beyond
noise" check, or a kernel change's before/after.

Each side is a Python interpreter whose powerinfer_jax is one checkout (a venv with an editable
install of a worktree at the commit). Every round runs `python -m powerinfer_jax.bench --json` for
every mode on each side in turn, the order swapped every other round (this VM drifts 20-30% over
minutes, so only ratios taken within one round mean anything). One JSONL row per (round, side,
mode), then one summary row per mode: the median of the rounds' after/before ratios.

  python -m benchmarks.ab_commits --before /work/wt/venv-old/bin/python \
      --after /work/venv/bin/python --rounds 3 --out benchmarks/ab_commits.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# dense, and the best sparse mode on the default model's CPU path (the oracle at a target sparsity
# on the file's blocks: what `--sparsity predictor --gate-up q4` computed there before d488629)
MODES = {"dense": ["--sparsity", "dense"],
         "oracle_target": ["--sparsity", "oracle", "--target-sparsity", "0.5"]}


def side_commit(python: str) -> str:
    """The commit of the checkout the interpreter imports powerinfer_jax from."""
    code = "import powerinfer_jax, pathlib; print(pathlib.Path(powerinfer_jax.__file__).parents[1])"
    root = subprocess.run([python, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run_bench(python: str, mode: str, a, side: str) -> dict:
    extra = dict(x.split("=", 1) for x in getattr(a, f"{side}_args") or []).get(mode)
    cmd = [python, "-m", "powerinfer_jax.bench", "--model", a.model, "--threads", str(a.threads),
           "--dtype", a.dtype, "--prompt-tokens", str(a.prompt_tokens), "--new-tokens",
           str(a.new_tokens), "--repeats", str(a.repeats), "--json", *(extra.split() if extra is not None else MODES[mode])]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp")
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}: "
                         f"{out.stderr.strip().splitlines()[-1:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"decode_tok_s": res["decode_tok_s"], "prefill_tok_s": res.get("prefill_tok_s"),
            "cmd": cmd}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="python of the older checkout")
    p.add_argument("--after", required=True, help="python of the newer checkout")
    p.add_argument("--before-args", nargs="*", metavar="MODE=ARGS",
                   help="the before side's bench flags for MODE where its CLI named the same "
                        "computation otherwise (e.g. oracle_target=\"--sparsity predictor "
                        "--target-sparsity 0.5 --gate-up q4\" before d488629's rename)")
    p.add_argument("--after-args", nargs="*", metavar="MODE=ARGS", help="the same for after")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "ab_commits.jsonl"))
    a = p.parse_args(argv)
    from powerinfer_jax._machine import git_commit, machine_info

    sides = {"before": a.before, "after": a.after}
    commits = {s: side_commit(py) for s, py in sides.items()}
    base = {"bench": "ab_commits", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "commit": git_commit(), "machine": machine_info(), "threads": a.threads,
            "dtype": a.dtype, "model": a.model, "prompt_tokens": a.prompt_tokens,
            "new_tokens": a.new_tokens, "repeats": a.repeats, "commits": commits, "tag": a.tag}
    rows = []

    def emit(row):
        rows.append(row)
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in ("round", "side", "mode", "decode_tok_s",
                                              "prefill_tok_s") if k in row}), flush=True)

    for rnd in range(a.rounds):
        order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
        for mode in a.modes:
            for side in order:
                res = run_bench(sides[side], mode, a, side)
                emit({**base, "round": rnd, "side": side, "side_commit": commits[side],
                      "mode": mode, **res})
    for mode in a.modes:
        summary = {**base, "kind": "summary", "mode": mode}
        for metric, prefix in (("decode_tok_s", ""), ("prefill_tok_s", "prefill_")):
            per = {(r["round"], r["side"]): r[metric] for r in rows if r["mode"] == mode}
            if any(v is None for v in per.values()):
                continue
            ratios = [per[(n, "after")] / per[(n, "before")] for n in range(a.rounds)]
            summary.update({
                f"{prefix}ratio_rounds": ratios, f"{prefix}ratio_median": statistics.median(ratios),
                f"{prefix}before_median": statistics.median(per[(n, "before")]
                                                            for n in range(a.rounds)),
                f"{prefix}after_median": statistics.median(per[(n, "after")]
                                                           for n in range(a.rounds))})
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
        print(json.dumps({k: summary[k] for k in ("mode", "ratio_median", "before_median",
                                                  "after_median", "prefill_ratio_median")
                          if k in summary}), flush=True)


if __name__ == "__main__":
    main()
