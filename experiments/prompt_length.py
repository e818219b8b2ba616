"""Hypothesis: sparsity helps decode at every prompt length but helps prefill less and less as the
prompt grows (prefill runs the union of the tokens' active neurons, which tends to all of them),
while longer prompts slow decode through the KV cache reads that sparsity does not touch.

For each prompt length, prefill tok/s and decode tok/s of the dense model and the best sparse mode
(predictor with --gate-up q4, target 0.5), one --dtype, each thread count in a child process.

  python -m experiments.prompt_length [--lengths 8 32 128 512 1024] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

from experiments import _common

TARGET_SPARSITY = 0.5
PREDICTOR = "q4"  # predictor mode's predictor (sparsity/q4_predictor.py)
MODES = ("dense", "predictor", "predictor_q4gu")  # q4gu: predictor mode with --gate-up q4
DEFAULT_MODES = ("dense", "predictor_q4gu")


def child(args) -> None:
    import jax.numpy as jnp

    from powerinfer_jax import _cli, ops
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.runtime.decode import Engine
    from powerinfer_jax.sparsity import artifacts as A

    threads = _cli.configure_threads(args.child_threads)
    ops.set_num_threads(threads)
    ckpt = load_checkpoint(args.model)
    max_len = max(args.lengths) + args.new_tokens
    for mode in args.modes:
        model = from_params(ckpt.config, ckpt.params, dtype=jnp.dtype(args.dtype), kernels="auto")
        sparsity, thresholds = SparsityConfig(), None
        if mode.startswith("predictor"):
            arts = A.ensure_artifacts(args.model, ckpt.source, model, ckpt.tokenizer,
                                      TARGET_SPARSITY, need_predictor=PREDICTOR == "lowrank")
            thresholds = A.use_predictor(model, arts, PREDICTOR)
            sparsity = SparsityConfig(mode="predictor", target_sparsity=TARGET_SPARSITY,
                                      predictor=PREDICTOR,
                                      gate_up="q4" if mode == "predictor_q4gu" else "full")
        eng = Engine(model, max_seq_len=max_len, sparsity=sparsity, thresholds=thresholds)
        for n in args.lengths:
            head = _common.header("prompt_length", threads=threads, dtype=args.dtype,
                                  model=args.model, config={"sparsity": mode,
                                                            "prompt_tokens": n},
                                  quick=args.quick)
            try:
                res = _common.bench_engine(eng, ckpt.tokenizer, prompt_tokens=n,
                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                           max_seconds=args.max_seconds)
                res.pop("tokens")
                row = {**head, "status": "ok", "sparsity": mode, **res}
                print(f"threads={threads} {mode:9s} prompt {n:5d}: prefill "
                      f"{res['prefill_tok_s']:8.1f} tok/s decode {res['decode_tok_s']:6.1f} tok/s",
                      flush=True)
            except Exception as e:
                row = {**head, "status": "failed", "sparsity": mode, "prompt_tokens": n,
                       "reason": f"{type(e).__name__}: {e}"}
            _common.emit(row)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="prompt lengths (default 8 32 128 512 1024; quick: 8 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="timed runs' wall-time budget per configuration (default 5, quick: 3)")
    p.add_argument("--out", default=str(_common.RESULTS / "prompt_length.jsonl"))
    args = p.parse_args(argv)
    q = args.quick
    args.lengths = args.lengths or ([8, 128] if q else [8, 32, 128, 512, 1024])
    args.new_tokens = args.new_tokens or (16 if q else 32)
    args.repeats = args.repeats or (1 if q else 3)
    args.max_seconds = args.max_seconds or (3.0 if q else 5.0)
    if args.child_threads is not None:
        return child(args)
    threads = args.threads or [max(_common.available_threads())]
    child_args = ["--model", args.model, "--dtype", args.dtype, "--modes", *args.modes,
                  "--lengths", *map(str, args.lengths), "--new-tokens", str(args.new_tokens),
                  "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds)
                  ] + (["--quick"] if q else [])
    rows = _common.run_children("experiments.prompt_length", threads, child_args)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
