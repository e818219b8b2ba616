"""Greedy tokens and perplexity of every mode on the default model, for a before/after check of a
refactor ("greedy tokens and perplexity of every mode identical before and after"). Prints one
JSON line per (dtype, mode); run it from each checkout with its own install and diff the lines:

    python -m benchmarks.before_after_modes --dtypes float32 --chunks 4 > after.jsonl
    python -m benchmarks.before_after_modes --modes dense,oracle --weights auto  # file's blocks

--weights dtype (default) dequantizes the quantized file's matrices to the dtype, as loaders
before the block formats did; auto keeps them in the file's blocks (models/qweights.py). The
"s" field is wall seconds for the mode (load, generate, perplexity): a progress note, not a
speed figure.
"""
from __future__ import annotations

import argparse
import json
import time

from powerinfer_jax import _cli
from powerinfer_jax.errors import check_choice

MODES = {"dense": ("dense", {}), "oracle": ("oracle", {}),
         "oracle@0.5": ("oracle", {"target_sparsity": 0.5}),
         "threshold": ("threshold", {"target_sparsity": 0.5}),
         "predictor": ("predictor", {"target_sparsity": 0.5}),
         "predictor_q4gu": ("predictor", {"target_sparsity": 0.5, "gate_up": "q4"}),
         "predictor_lowrank": ("predictor", {"target_sparsity": 0.5, "predictor": "lowrank"})}
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


def build_parser() -> argparse.ArgumentParser:
    from powerinfer_jax.sparsity import corpus  # the project's validation text

    p = argparse.ArgumentParser(prog="python -m benchmarks.before_after_modes",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_cli.DEFAULT_MODEL)
    p.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: "
                   + ", ".join(MODES))
    p.add_argument("--chunks", type=int, default=4, help="perplexity chunks of 512 tokens")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--weights", default="dtype", choices=("dtype", "auto"))
    p.add_argument("--text", default=str(corpus.SHARED_DATA / corpus.VALIDATION_NAME),
                   help="perplexity text (default: the project's wiki.valid.txt)")
    p.add_argument("--threads", type=int, default=2)
    return p


def run_mode(args, dtype: str, label: str, text: str) -> dict:
    import powerinfer_jax as pij

    mode, kw = MODES[label]
    t0 = time.time()
    try:
        llm = pij.load(args.model, dtype=dtype, sparsity=mode, weights=args.weights,
                       threads=args.threads, progress=False, **kw)
    except pij.UserError as e:
        if "sparsity='oracle' with target_sparsity" not in str(e):
            raise
        # the q4 predictor on a model kept in its file's blocks is refused since it predicts
        # nothing: the same computation by its name, to show the tokens are the same
        kw = {k: v for k, v in kw.items() if k not in ("gate_up", "predictor")}
        label += " (as oracle@target)"
        llm = pij.load(args.model, dtype=dtype, sparsity="oracle", weights=args.weights,
                       threads=args.threads, progress=False, **kw)
    toks = [llm.generate(p, max_new_tokens=args.new_tokens).token_ids for p in PROMPTS]
    ppl = llm.perplexity(text, ctx=512, max_chunks=args.chunks)
    return {"mode": label, "dtype": dtype, "weights": args.weights, "tokens": toks,
            "ppl": ppl["ppl"], "ffn_sparsity": ppl["ffn_sparsity"],
            "recall": ppl.get("predictor_recall"), "threads": args.threads,
            "commit": _cli.git_commit(), "s": round(time.time() - t0)}


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    labels = [m for m in args.modes.split(",") if m]
    for m in labels:
        check_choice("--modes", m, tuple(MODES))
    _cli.configure_threads(args.threads)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    for dtype in args.dtypes.split(","):
        for label in labels:
            print(json.dumps(run_mode(args, dtype, label, text)), flush=True)


if __name__ == "__main__":
    main()
