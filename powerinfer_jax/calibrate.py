"""Build sparsity artifacts: `python -m powerinfer_jax.calibrate [--model NAME|PATH] [--corpus FILE...]
[--target-sparsity 0.5] [--sparsity predictor --predictor lowrank] [--out DIR]`.

Profiles the dense model over the corpus (default: the project's wiki training text), calibrates
per-layer thresholds for the target FFN sparsity (oracle, threshold and q4-predictor modes), and
for the mode `--sparsity predictor --predictor lowrank` trains the low-rank predictors too (~6 min
for SmolLM2 on 2 cores; nothing else needs them). Writes the
profile, thresholds, a frequency plot and the predictors (orbax) into --out (default: the model's
directory; for a registry name its cache directory), where generate / evaluate / bench find them
(pass the same directory to them with --artifacts DIR).
"""
from __future__ import annotations

import argparse

from powerinfer_jax import _cli
from powerinfer_jax.api import LLM
from powerinfer_jax.config import DEFAULT_TARGET_SPARSITY
from powerinfer_jax.errors import check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # lazy: start-up (calibrate CLI)
    from powerinfer_jax.sparsity.artifacts import DEFAULT_CTX, DEFAULT_MAX_TOKENS
    from powerinfer_jax.sparsity.predictor import TrainConfig  # lazy: start-up (calibrate CLI)

    t = TrainConfig()
    _cli.add_model_flags(p)
    _cli.add_sparsity_flags(p)
    p.set_defaults(sparsity="predictor", target_sparsity=DEFAULT_TARGET_SPARSITY)
    p.add_argument("--corpus", nargs="+", default=None,
                   help="training text files (default: the project's wiki.train.txt)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="tokens per profiled chunk")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="profile at most this many corpus tokens (default: %(default)s)")
    p.add_argument("--predictor-rank", type=int, default=t.rank, help="R (default: %(default)s)")
    p.add_argument("--predictor-steps", type=int, default=t.steps, help="(default: %(default)s)")
    p.add_argument("--target-recall", type=float, default=t.target_recall,
                   help="held-out recall each layer's decision threshold keeps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--out", default=None,
                   help="artifact root (default: --artifacts, else the model's directory)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


@_cli.speaks_flags(build_parser)
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)
    from powerinfer_jax.sparsity import modes  # lazy: start-up (calibrate CLI)
    from powerinfer_jax.sparsity.artifacts import target_dir  # lazy: start-up (calibrate CLI)
    from powerinfer_jax.sparsity.predictor import TrainConfig  # lazy: start-up (calibrate CLI)
    # lazy: start-up (calibrate CLI)
    from powerinfer_jax.sparsity.thresholds import check_target_sparsity

    target = check_target_sparsity(args.target_sparsity)
    check(args.ctx >= 2, "--ctx", "an integer >= 2", args.ctx)
    check(args.max_tokens >= args.ctx, "--max-tokens", f"at least --ctx = {args.ctx} tokens",
          args.max_tokens)
    _, wanted = _cli.configs_from_args(args)
    lowrank = modes.needs(wanted).lowrank
    train = TrainConfig(rank=args.predictor_rank, steps=args.predictor_steps,
                        target_recall=args.target_recall, seed=args.seed) if lowrank else False
    llm = LLM(_cli.build_from_args(_dense(args), progress=args.progress))
    arts = llm.calibrate(target, corpus_files=args.corpus, lowrank=train,
                         out=args.out or args.artifacts, ctx=args.ctx, max_tokens=args.max_tokens,
                         progress=args.progress)
    directory = target_dir(arts.meta["root"], target)
    rep, q4 = arts.meta.get("predictor", {}), arts.meta["q4"]
    print(f"wrote {directory}: thresholds for target sparsity {target}; q4 predictor: held-out "
          f"recall {q4['mean_recall']:.3f}, precision {q4['mean_precision']:.3f}, predicted "
          f"sparsity {q4['mean_predicted_sparsity']:.3f}"
          + (f"; low-rank predictors R={rep['rank']}: held-out recall {rep['mean_recall']:.3f}, "
             f"precision {rep['mean_precision']:.3f}, predicted sparsity "
             f"{rep['mean_predicted_sparsity']:.3f}, cost {rep['cost']['flops_fraction']:.3f} of "
             "the FFN's FLOPs" if rep else ""))
    if args.json:
        _cli.print_json({"dir": str(directory), "threads": threads, "model": args.model,
                         **arts.meta})


def _dense(args):
    """Calibration profiles the dense model; --sparsity only says which artifacts to build."""
    ns = argparse.Namespace(**vars(args))
    ns.sparsity, ns.threshold, ns.gate_up, ns.target_sparsity = "dense", 0.0, "full", None
    ns.vram_budget = None
    return ns


if __name__ == "__main__":
    _cli.run_main(main)
