"""Our perplexity scored as llama.cpp's llama-perplexity scores it, next to its own (issue 53).

Both on the same GGUF file, text, context and chunk count: ours is `python -m
powerinfer_jax.evaluate --score second-half` (the tokens after the first ctx/2 of each chunk,
BOS first where the file says add_bos), llama.cpp's is `llama-perplexity -c CTX --chunks N`
(whose "Final estimate" is the same protocol). One row in benchmarks/evaluate_ppl.jsonl: our
evaluate --json fields, the llama.cpp figure and command, and their relative difference.

    python benchmarks/ppl_vs_llamacpp.py --text ../shared/data/wiki.valid.txt \
        [--ctx 512 --chunks 16] [--out benchmarks/evaluate_ppl.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from powerinfer_jax._machine import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]
LLAMA_BIN = Path.home() / ".cache/powerinfer_jax/peers/llamacpp-cpu-native/bin/llama-perplexity"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or .gguf file")
    p.add_argument("--text", required=True)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.llama_bin.is_file():
        raise SystemExit(f"--llama-bin: expected llama-perplexity, got {args.llama_bin}")
    gguf = args.model
    if not gguf.endswith(".gguf"):
        from powerinfer_jax.checkpoint.registry import model_path

        gguf = str(model_path(args.model))
    ours_cmd = [sys.executable, "-m", "powerinfer_jax.evaluate", "--model", gguf, "--text",
                args.text, "--ctx", str(args.ctx), "--max-chunks", str(args.chunks), "--score",
                "second-half", "--dtype", args.dtype, "--threads", str(args.threads), "--json",
                "--no-progress"]
    t0 = time.perf_counter()
    out = subprocess.run(ours_cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    ours_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"evaluate failed: {out.stderr[-2000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    llama_cmd = [str(args.llama_bin), "-m", gguf, "-f", args.text, "-c", str(args.ctx),
                 "--chunks", str(args.chunks), "-t", str(args.threads)]
    t0 = time.perf_counter()
    ll = subprocess.run(llama_cmd, capture_output=True, text=True, timeout=3600)
    llama_s = time.perf_counter() - t0
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", ll.stdout + ll.stderr)
    if ll.returncode != 0 or not m:
        raise SystemExit(f"llama-perplexity failed: {(ll.stdout + ll.stderr)[-2000:]}")
    llama_ppl = float(m.group(1))
    row.update({"bench": "evaluate_ppl", "kind": "vs_llama_perplexity", "commit": git_commit(),
                "machine": machine_info(),
                "command": "python -m powerinfer_jax.evaluate " + " ".join(ours_cmd[3:]),
                "llama_ppl": llama_ppl, "llama_command": " ".join(llama_cmd),
                "relative_diff": row["ppl"] / llama_ppl - 1.0,
                "ours_wall_s": ours_s, "llama_wall_s": llama_s})
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
