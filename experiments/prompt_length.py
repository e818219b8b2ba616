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
MODES = ("dense", "predictor", "predictor_q4gu")  # q4gu: predictor mode with --gate-up q4
DEFAULT_MODES = ("dense", "predictor_q4gu")


def child(args) -> None:

    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import load_checkpoint

    threads = _cli.configure_threads(args.child_threads)
    ckpt = load_checkpoint(args.model)
    max_len = max(args.lengths) + args.new_tokens
    for mode in args.modes:
        eng = _common.build_mode(args.model, mode, dtype=args.dtype, max_seq_len=max_len,
                                 checkpoint=ckpt, target=TARGET_SPARSITY).engine
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
