"""Hypothesis: each of PowerInfer's components adds decode speed on the same model and threads.

Steps, in the paper's order (each builds on the one before):
  dense_xla        dense model, XLA matmuls (--kernels xla)
  dense_ffi        dense model, our custom calls on the C++ thread pool (--kernels ffi)
  predictor        + the q4 predictor and the sparse FFN operator (--sparsity predictor)
  gate_up_q4       + the predictor's estimates serve as the active neurons' gate/up dots, so only
                   their down rows are read (--gate-up q4); the hybrid steps keep this
  hybrid_naive     + hybrid hot/cold engine (issue 5) with a naive placement: the first neurons by
                   index fill the notional accelerator budget
  hybrid_policy    + the placement policy: hot neurons chosen by profiled frequency
at each --dtypes and --threads (every thread count in its own child process). The hybrid steps need
sparsity/placement.py and models/hybrid.py; without them they are recorded as "not available".
On a CPU-only machine the "accelerator" of the hybrid engine is the CPU too (hot rows through XLA,
cold rows through the custom call), so those steps measure the routing's cost, not a GPU's gain.

  python -m experiments.ablation [--threads 1 2] [--dtypes float32 bfloat16] [--budget 0.5]
"""
from __future__ import annotations

import argparse

import numpy as np

from experiments import _common

STEPS = ("dense_xla", "dense_ffi", "predictor", "gate_up_q4", "hybrid_naive", "hybrid_policy")
TARGET_SPARSITY = 0.5  # the predictor artifacts' target (issue 4: >= 50% at <= 1.08x perplexity)
PREDICTOR = "q4"  # predictor mode's predictor (sparsity/nibble_predictor.py)


def hybrid_available() -> str | None:
    """None when the hybrid engine can run here, else why not."""
    try:
        from powerinfer_jax.models import hybrid  # noqa: F401
        from powerinfer_jax.models.ffn import FFN
        from powerinfer_jax.sparsity import placement  # noqa: F401
    except ImportError as e:
        return f"hybrid engine not available ({e})"
    if not hasattr(FFN, "split"):
        return "hybrid engine not available (models/ffn.py has no FFN.split)"
    return None


def build_step(step: str, ckpt, *, model: str, dtype: str, max_seq_len: int, budget: float):
    """(engine, extra row fields) for one ablation step."""
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.sparsity import artifacts as A

    kernels = "xla" if step == "dense_xla" else "ffi"
    # every weight at the dtype (on the file's blocks the q4 "predictor" would be the oracle)
    runtime = RuntimeConfig(dtype=dtype, kernels=kernels, max_seq_len=max_seq_len,
                            weights="dtype")
    extra = {"kernels": kernels, "sparsity": "dense"}
    if step in ("dense_xla", "dense_ffi"):
        return build(model, runtime, checkpoint=ckpt, progress=False).engine, extra
    gate_up = "full" if step == "predictor" else "q4"
    sparsity = SparsityConfig(mode="predictor", target_sparsity=TARGET_SPARSITY,
                              predictor=PREDICTOR, gate_up=gate_up)
    s = build(model, runtime, sparsity, checkpoint=ckpt, progress=False)
    extra.update(sparsity="predictor", predictor=PREDICTOR, gate_up=gate_up,
                 target_sparsity=TARGET_SPARSITY,
                 heldout_predicted_sparsity=s.artifacts.meta["q4"]["mean_predicted_sparsity"],
                 heldout_recall=s.artifacts.meta["q4"]["mean_recall"])
    if step.startswith("hybrid"):  # the ablation's own placements (naive: by index)
        from powerinfer_jax.sparsity.profile import ActivationProfile

        directory = A.target_dir(A.artifacts_root(model, ckpt.source), TARGET_SPARSITY)
        counts = ActivationProfile.load(directory / "profile.npz").counts  # placement statistics
        extra["placement"] = place(step, s.model, counts, max_seq_len=max_seq_len, budget=budget)
    return s.engine, extra


def place(step: str, model, counts, *, max_seq_len: int, budget: float) -> dict:
    """Split the model's FFNs hot/cold under `budget` x FFN bytes (plus every dense byte)."""
    from powerinfer_jax.models.hybrid import apply_placement
    from powerinfer_jax.sparsity import placement as pl

    sizes = pl.model_bytes(model, kv_len=max_seq_len)
    budget_bytes = sizes.dense + int(budget * sizes.ffn)
    counts = np.asarray(counts, np.float64)
    if step == "hybrid_naive":  # equal scores: the stable sort keeps index order, no balancing
        p = pl.place_neurons([np.ones_like(c) for c in counts], sizes, budget_bytes,
                             cold_balance=None)
    else:
        p = pl.place_neurons(list(counts), sizes, budget_bytes)
    apply_placement(model, p)
    # served_fraction of the naive placement under the *profiled* frequencies, for comparability
    hot_mass = sum(float(c[list(o[:h])].sum()) for c, o, h in zip(counts, p.order, p.hot))
    return {"budget_fraction_of_ffn": budget, "budget_bytes": budget_bytes,
            "device_bytes": p.device_bytes, "host_bytes": p.host_bytes,
            "hot_fraction_mean": float(np.mean(p.hot_fraction())),
            "served_fraction": hot_mass / max(float(counts.sum()), 1.0)}


def child(args) -> None:
    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import load_checkpoint

    threads = _cli.configure_threads(args.child_threads)
    ckpt = load_checkpoint(args.model)
    max_seq_len = args.prompt_tokens + args.new_tokens
    missing = hybrid_available()
    for dtype in args.dtypes:
        for step in args.steps:
            config = {"step": step, "step_index": STEPS.index(step),
                      "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                      "repeats": args.repeats}
            head = _common.header("ablation", threads=threads, dtype=dtype, model=args.model,
                                  config=config, quick=args.quick)
            if step.startswith("hybrid") and missing:
                _common.emit({**head, "status": "not available", "reason": missing})
                continue
            try:
                eng, extra = build_step(step, ckpt, model=args.model, dtype=dtype,
                                        max_seq_len=max_seq_len, budget=args.budget)
                res = _common.bench_engine(eng, ckpt.tokenizer, prompt_tokens=args.prompt_tokens,
                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                           max_seconds=args.max_seconds)
            except Exception as e:  # one step failing must not lose the others' rows
                _common.emit({**head, "status": "failed", "reason": f"{type(e).__name__}: {e}"})
                continue
            _common.emit({**head, "status": "ok", **extra, **res})
            print(f"threads={threads} {dtype:9s} {step:14s} decode {res['decode_tok_s']:7.1f} "
                  f"tok/s  prefill {res['prefill_tok_s']:7.1f} tok/s", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="timed runs' wall-time budget per configuration (default 6, quick: 3)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="hybrid steps: notional accelerator budget, fraction of FFN bytes")
    p.add_argument("--out", default=str(_common.RESULTS / "ablation.jsonl"))
    args = p.parse_args(argv)
    q = args.quick
    args.prompt_tokens = args.prompt_tokens or (16 if q else 64)
    args.new_tokens = args.new_tokens or (16 if q else 128)
    args.repeats = args.repeats or (1 if q else 3)
    args.max_seconds = args.max_seconds or (3.0 if q else 6.0)
    if not 0.0 <= args.budget <= 1.0:
        raise SystemExit(f"--budget: expected a fraction in [0, 1], got {args.budget}")
    if args.child_threads is not None:
        return child(args)
    threads = args.threads or ([max(_common.available_threads())] if q
                               else _common.available_threads())
    child_args = ["--model", args.model, "--dtypes", *args.dtypes, "--steps", *args.steps,
                  "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
                  str(args.new_tokens), "--repeats", str(args.repeats), "--max-seconds",
                  str(args.max_seconds), "--budget", str(args.budget)] + (["--quick"] if q else [])
    rows = _common.run_children("experiments.ablation", threads, child_args)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
