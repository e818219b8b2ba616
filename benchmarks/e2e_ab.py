"""Decode tokens/s of sparse modes vs dense, interleaved in one process (issue 4's speed check).

This machine's decode speed drifts by up to 30% over minutes (other tenants of the VM), so
back-to-back runs of separate processes can rank two modes either way. Here every engine is built
and compiled first, then each round benches every mode once, in turn; the medians over rounds and
each round's ratio to dense are recorded. One JSONL row per (dtype, mode) with the config, commit,
machine, threads and dtype, appended to benchmarks/e2e_ab.jsonl.

Modes: dense; predictor (q4 predictor, gate/up rows read at the dtype); predictor_q4gu (the q4
estimates as activations: --gate-up q4, one custom call per layer); dense_xla_attention (dense
with decode attention through XLA's ops instead of ops.decode_attention: that op's ablation);
predictor_q4gu_qkv3 (predictor_q4gu with q, k, v as three linear calls instead of one
ops.linear_many call: that call's ablation); dense_block1 and predictor_q4gu_block1 (one decode
step per executable call instead of RuntimeConfig.decode_block: the decode block's ablation).

  python -m benchmarks.e2e_ab [--dtypes bfloat16 float32] [--threads 2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODES = ("dense", "predictor", "predictor_q4gu", "dense_xla_attention", "predictor_q4gu_qkv3",
         "dense_block1", "predictor_q4gu_block1")
DEFAULT_MODES = ("dense", "predictor", "predictor_q4gu")


def build(name: str, ckpt, mode: str, dtype: str, target: float, max_seq_len: int):
    """The engine of one mode; the two ablations are build options (RuntimeConfig)."""
    from experiments import _common

    label = {"dense_xla_attention": "dense", "predictor_q4gu_qkv3": "predictor_q4gu"}.get(mode,
                                                                                       mode)
    label = label.removesuffix("_block1")
    return _common.build_mode(name, label, dtype=dtype, max_seq_len=max_seq_len, checkpoint=ckpt,
                              target=target,
                              decode_attention="xla" if mode == "dense_xla_attention" else "auto",
                              fuse_qkv=mode != "predictor_q4gu_qkv3",
                              **({"decode_block": 1} if mode.endswith("_block1") else {})).engine


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target-sparsity", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "e2e_ab.jsonl"))
    args = p.parse_args(argv)
    if "dense" not in args.modes:
        raise SystemExit("--modes: expected dense among them (the ratios' reference)")

    from experiments import _common
    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import load_checkpoint

    threads = _cli.configure_threads(args.threads)
    ckpt = load_checkpoint(args.model)
    max_len = args.prompt_tokens + args.new_tokens + 8
    rows = []
    for dtype in args.dtypes:
        engines = {m: build(args.model, ckpt, m, dtype, args.target_sparsity, max_len) for m in args.modes}
        speeds = {m: [] for m in args.modes}
        for _ in range(args.rounds):
            for m, eng in engines.items():
                res = _common.bench_engine(eng, ckpt.tokenizer, prompt_tokens=args.prompt_tokens,
                                           new_tokens=args.new_tokens, repeats=2,
                                           max_seconds=4.0)
                speeds[m].append(res["decode_tok_s"])
        dense = speeds["dense"]
        for m in args.modes:
            ratios = [s / d for s, d in zip(speeds[m], dense)]
            cfg = {"mode": m,
                   "target_sparsity": args.target_sparsity if m.startswith("predictor") else None,
                   "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
                   "new_tokens": args.new_tokens}
            row = {**_common.header("e2e_ab", threads=threads, dtype=dtype, model=args.model,
                                    config=cfg, quick=False),
                   "mode": m, "decode_tok_s_rounds": speeds[m],
                   "decode_tok_s_median": statistics.median(speeds[m]),
                   "ratio_to_dense_rounds": ratios,
                   "ratio_to_dense_median": statistics.median(ratios)}
            rows.append(row)
            print(f"threads={threads} {dtype:9s} {m:15s} decode median "
                  f"{row['decode_tok_s_median']:6.1f} tok/s, x dense (median of rounds) "
                  f"{row['ratio_to_dense_median']:.3f}  rounds {[round(s, 1) for s in speeds[m]]}",
                  flush=True)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
