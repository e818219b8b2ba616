"""Build sparsity artifacts: `python -m powerinfer_jax.calibrate [--model NAME|PATH] [--corpus FILE...]
[--target-sparsity 0.5] [--predictor-rank R] [--out DIR]`.

Profiles the dense model over the corpus (default: the project's wiki training text), calibrates
per-layer thresholds for the target FFN sparsity, trains per-layer predictors, and writes stats,
thresholds (oracle, threshold and q4-predictor modes), a frequency plot and
low-rank predictors (orbax) into the model's directory (for a registry
name: its cache dir), where generate/evaluate/bench --sparsity threshold|predictor find them.
"""
from __future__ import annotations

import argparse

from powerinfer_jax import _cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from powerinfer_jax.sparsity.artifacts import DEFAULT_CTX, DEFAULT_MAX_TOKENS
    from powerinfer_jax.sparsity.predictor import TrainConfig

    t = TrainConfig()
    p.add_argument("--model", default=_cli.DEFAULT_MODEL,
                   help="registry name, .gguf file or Hugging Face directory (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--corpus", nargs="+", default=None,
                   help="training text files (default: the project's wiki.train.txt)")
    p.add_argument("--target-sparsity", type=float, default=_cli.DEFAULT_TARGET_SPARSITY,
                   help="fraction of FFN neurons to skip (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="tokens per profiled chunk")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="profile at most this many corpus tokens (default: %(default)s)")
    p.add_argument("--predictor", action=argparse.BooleanOptionalAction, default=True,
                   help="train the low-rank predictors (default: yes; the q4 predictor needs no "
                        "training and is always calibrated)")
    p.add_argument("--predictor-rank", type=int, default=t.rank, help="R (default: %(default)s)")
    p.add_argument("--predictor-steps", type=int, default=t.steps, help="(default: %(default)s)")
    p.add_argument("--target-recall", type=float, default=t.target_recall,
                   help="held-out recall each layer's decision threshold keeps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--out", default=None, help="artifact root (default: the model's directory)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action=argparse.BooleanOptionalAction, default=False)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.configure_threads(args.threads)
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity import artifacts as arts_mod
    from powerinfer_jax.sparsity.calibrate import check_target_sparsity
    from powerinfer_jax.sparsity.predictor import TrainConfig

    target = check_target_sparsity(args.target_sparsity)
    train = TrainConfig(rank=args.predictor_rank, steps=args.predictor_steps,
                        target_recall=args.target_recall, seed=args.seed) if args.predictor else None
    ckpt = load_checkpoint(args.model)
    model = from_params(ckpt.config, ckpt.params)
    fp = arts_mod.model_fingerprint(args.model, ckpt.source, ckpt.config)
    root = arts_mod.artifacts_root(args.model, ckpt.source) if args.out is None else args.out
    arts = arts_mod.build_artifacts(model, ckpt.tokenizer, fingerprint=fp, root=root,
                                    target_sparsity=target, corpus_files=args.corpus,
                                    ctx=args.ctx, max_tokens=args.max_tokens, train=train,
                                    progress=args.progress)
    directory = arts_mod.target_dir(root, target)
    rep, q4 = arts.meta.get("predictor", {}), arts.meta["q4"]
    print(f"wrote {directory}: thresholds for target sparsity {target}; q4 predictor: held-out "
          f"recall {q4['mean_recall']:.3f}, precision {q4['mean_precision']:.3f}, predicted "
          f"sparsity {q4['mean_predicted_sparsity']:.3f}"
          + (f"; low-rank predictors R={rep['rank']}: held-out recall {rep['mean_recall']:.3f}, "
             f"precision {rep['mean_precision']:.3f}, predicted sparsity "
             f"{rep['mean_predicted_sparsity']:.3f}, cost {rep['cost']['flops_fraction']:.3f} of "
             "the FFN's FLOPs" if rep else ""))
    if args.json:
        _cli.print_json({"dir": str(directory), "threads": threads, "model": args.model, **arts.meta})


if __name__ == "__main__":
    _cli.run_main(main)
