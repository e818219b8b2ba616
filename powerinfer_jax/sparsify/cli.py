"""Make a dense model sparse by self-distillation:
`python -m powerinfer_jax.sparsify [--model NAME|PATH] [--variant threshold|relu|drelu|fatrelu]
[--recipe prosparse] [--target-sparsity 0.85] [--tokens N] [--seed S] [--out DIR] [--resume]
[--time-budget SECONDS]`.

The student is the model with a sparsity-inducing FFN (see --variant); the teacher is the dense
model. Loss: KL on the logits (plus optional activation L1 and hidden-state MSE). Data: the
corpus (default: the project's wiki.train.txt; never wiki.valid) and the teacher's own samples
from varied prompts. Before training, each layer's down rows are refit by least squares under the
sparse activations. The result is a Hugging Face directory (default:
<cache>/models/<model>-sparse-<variant>-<target>) that every CLI loads with --model DIR, with its
sparsity artifacts in DIR/sparsity; rerunning the same command reuses it. Training runs through
XLA on whatever jax runs on (CPU, GPU, TPU). An interrupted run (Ctrl-C, SIGTERM) saves its last
finished step: rerun with --resume to continue; a resumed run ends with the weights an
uninterrupted one would have (on the CPU bit for bit). A run can also stop on purpose after
--stop-after STEPS or --time-budget SECONDS (a job with a wall-clock limit) and go on with the
same command and --resume (checkpoint and curve rows in the model cache, beside the output).
"""
from __future__ import annotations

import argparse

from powerinfer_jax import _cli
from powerinfer_jax.errors import fail
from powerinfer_jax.sparsify.recipe import (COMPUTE_DTYPES, L1_ON, MASK_BY, RECIPES, REFIT_TARGETS,
                                            TEACHERS, TRAIN_SCOPES, VARIANTS, DistillConfig)
from powerinfer_jax.sparsify.run import distill, fill_teacher_cache


def parse_stages(text: str) -> tuple:
    """"0.1:0,0.3:0.02" -> ((0.1, 0.0), (0.3, 0.02)) (end fraction:coefficient pairs)."""
    try:
        return tuple(tuple(float(v) for v in pair.split(":")) for pair in text.split(",")
                     if pair.strip())
    except ValueError:
        fail("--l1-stages", "comma-separated END:COEF pairs such as 0.1:0,0.3:0.02", text)


def build_parser() -> argparse.ArgumentParser:
    d = DistillConfig()
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.sparsify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_cli.DEFAULT_MODEL,
                   help="teacher: registry name, .gguf file or HF directory (default: %(default)s)")
    p.add_argument("--variant", default=d.variant, choices=VARIANTS,
                   help="student FFN: threshold (keep the activation, zero |a_i| under the layer's "
                        "threshold for --target-sparsity, straight-through gradient), relu "
                        "(relu(gate) * up), drelu (relu(gate) * relu(up)) or fatrelu (relu(gate) "
                        "* up where relu(gate) is above the layer's threshold for "
                        "--target-sparsity) (default: %(default)s)")
    p.add_argument("--recipe", default=None, choices=tuple(RECIPES),
                   help="preset of the loss and schedule flags (explicit flags win): prosparse "
                        "= L1 on relu(gate) in sine-ramped stages, FATReLU at the end")
    p.add_argument("--target-sparsity", type=float, default=d.target_sparsity,
                   help="fraction of FFN neurons skipped (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens,
                   help="training tokens (steps x batch x seq-len) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--out", default=None,
                   help="output directory (default: <cache>/models/<model>-sparse-<variant>-<target>)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="continue an interrupted run of the same model and config from its "
                        "last checkpoint (in <out>.train)")
    p.add_argument("--force", action=argparse.BooleanOptionalAction, default=False,
                   help="retrain even if <out> holds a finished run; discard a stale checkpoint")
    p.add_argument("--corpus", nargs="+", default=None,
                   help="training text files (default: the project's wiki.train.txt)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--fill-teacher-cache", action="store_true",
                   help="only compute the teacher's top-k targets this run would read (its "
                        "corpus chunks and samples) into the cache, then stop")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="train at most this long in this call (setup included), then stop "
                        "saved; the same command with --resume continues")
    g = p.add_argument_group("loss and student")
    g.add_argument("--mask-by", default=d.mask_by, choices=MASK_BY,
                   help="threshold variant: one threshold per layer (the batch's quantile, as "
                        "calibration does) or per-token top-k; fatrelu: layer only "
                        "(default: %(default)s)")
    g.add_argument("--ste", action=argparse.BooleanOptionalAction, default=d.ste,
                   help="straight-through gradient through the mask (default: on)")
    g.add_argument("--l1", type=float, default=d.l1, help="activation penalty on mean |a|")
    g.add_argument("--l1-warmup", type=float, default=d.l1_warmup,
                   help="fraction of the steps over which --l1 ramps up from 0")
    g.add_argument("--l1-stages", type=parse_stages, default=d.l1_stages, metavar="E:C,...",
                   help="ProSparse stages: end fraction:coefficient pairs; the coefficient rises "
                        "along a sine to each (replaces --l1/--l1-warmup)")
    g.add_argument("--l1-target-sparsity", type=float, default=d.l1_target_sparsity,
                   help="steer the L1 coefficient (a multiplier on the schedule) toward this "
                        "FFN sparsity (0: off)")
    g.add_argument("--l1-on", default=d.l1_on, choices=L1_ON,
                   help="penalize mean |a| (act) or the gate activation relu(gate) (gate)")
    g.add_argument("--fatrelu-kl-rise", type=float, default=d.fatrelu_kl_rise,
                   help="FATReLU: the largest gate threshold within this relative KL rise "
                        "(0: none)")
    g.add_argument("--fatrelu-at", type=float, default=d.fatrelu_at,
                   help="fraction of the steps after which the threshold is set and trained with "
                        "(1: after the last step)")
    g.add_argument("--teacher", default=d.teacher, choices=TEACHERS,
                   help="online: the teacher's forward in every step; cached: its top-k "
                        "log-probabilities, computed once per sequence and kept on disk")
    g.add_argument("--topk", type=int, default=d.topk, help="top-k of a cached teacher")
    g.add_argument("--hidden-mse", type=float, default=d.hidden_mse,
                   help="weight of the per-layer hidden-state MSE to the teacher")
    g.add_argument("--train", default=d.train, choices=TRAIN_SCOPES,
                   help="which weights learn (default: %(default)s)")
    g.add_argument("--compute-dtype", default=d.compute_dtype, choices=COMPUTE_DTYPES,
                   help="matmul inputs of the training forward; weights stay float32 "
                        "(default: %(default)s)")
    g.add_argument("--remat", action=argparse.BooleanOptionalAction, default=d.remat,
                   help="gradient checkpointing per block (less memory, ~35%% slower here)")
    g.add_argument("--refit", action=argparse.BooleanOptionalAction, default=d.refit,
                   help="least-squares refit of the down rows before training (default: on)")
    g.add_argument("--refit-target", default=d.refit_target, choices=REFIT_TARGETS)
    g.add_argument("--refit-tokens", type=int, default=d.refit_tokens)
    g.add_argument("--samples", type=int, default=d.samples,
                   help="teacher-sample sequences (generated once, cached) (default: %(default)s)")
    g.add_argument("--sample-fraction", type=float, default=d.sample_fraction,
                   help="share of each batch taken from the teacher samples")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    r = p.add_argument_group("reporting")
    r.add_argument("--curve", default=None,
                   help="append learning-curve rows (JSONL) here: perplexity and sparsity on "
                        "--eval-chunks validation chunks before, during and after training")
    r.add_argument("--eval-every", type=int, default=0, help="steps between curve points")
    r.add_argument("--eval-chunks", type=int, default=4, help="validation chunks of 512 tokens")
    r.add_argument("--eval-text", default=None,
                   help="validation text (default: the project's wiki.valid.txt)")
    r.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="build the sparsity artifacts of the result (default: yes)")
    r.add_argument("--save-every", type=int, default=25, help="steps between checkpoints")
    r.add_argument("--keep-checkpoints", action=argparse.BooleanOptionalAction, default=False)
    r.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                   help="stop after this many steps in this call (checkpoint saved; --resume "
                        "continues): a run in budgeted pieces")
    r.add_argument("--export-partial", action=argparse.BooleanOptionalAction, default=False,
                   help="when stopped early (--stop-after), still export and calibrate the "
                        "model as it is")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--json", action=argparse.BooleanOptionalAction, default=False)
    return p


def config_from_args(args) -> DistillConfig:
    return DistillConfig(
        variant=args.variant, target_sparsity=args.target_sparsity, tokens=args.tokens,
        batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
        mask_by=args.mask_by, ste=args.ste, l1=args.l1, l1_warmup=args.l1_warmup,
        hidden_mse=args.hidden_mse, train=args.train, compute_dtype=args.compute_dtype,
        remat=args.remat, refit=args.refit, refit_target=args.refit_target,
        refit_tokens=args.refit_tokens, samples=args.samples,
        sample_fraction=args.sample_fraction, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, l1_stages=args.l1_stages, l1_on=args.l1_on,
        fatrelu_kl_rise=args.fatrelu_kl_rise, fatrelu_at=args.fatrelu_at, teacher=args.teacher,
        topk=args.topk, l1_target_sparsity=args.l1_target_sparsity)


def parse_args(argv=None):
    """Flags with a --recipe's preset as their defaults (explicit flags win)."""
    p = build_parser()
    known, _ = p.parse_known_args(argv)
    if known.recipe is not None:
        p.set_defaults(**RECIPES[known.recipe])
    return p.parse_args(argv)


def main(argv=None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cfg = config_from_args(args)  # validate flags before anything heavy starts
    threads = _cli.configure_threads(args.threads)
    if args.eval_every < 0 or args.eval_chunks < 1 or args.save_every < 1 or (
            args.stop_after is not None and args.stop_after < 0):
        raise ValueError(f"--eval-every/--eval-chunks/--save-every/--stop-after: expected >= 0 / "
                         f">= 1 / >= 1 / >= 0, got {args.eval_every}/{args.eval_chunks}/"
                         f"{args.save_every}/{args.stop_after}")
    if args.time_budget is not None and not args.time_budget > 0:
        fail("--time-budget", "a number of seconds > 0", args.time_budget)

    if args.fill_teacher_cache:
        res = fill_teacher_cache(args.model, cfg.replace(teacher="cached"), corpus=args.corpus,
                                 threads=threads, progress=args.progress)
        print(f"filled {res['rows_filled']} sequences ({res['tokens_filled']} tokens) in "
              f"{res['seconds']:.0f} s into {', '.join(res['directories'])}")
        if args.json:
            _cli.print_json(res)
        return
    res = distill(args.model, cfg, out=args.out, corpus=args.corpus, resume=args.resume,
                  force=args.force, progress=args.progress, calibrate=args.calibrate,
                  eval_every=args.eval_every, eval_chunks=args.eval_chunks,
                  eval_text=args.eval_text, curve=args.curve, save_every=args.save_every,
                  keep_checkpoints=args.keep_checkpoints, stop_after=args.stop_after,
                  export_partial=args.export_partial, time_budget=args.time_budget,
                  threads=threads)
    out = res["out"]
    if "stopped_at" in res:
        print(f"stopped at step {res['stopped_at']} of {cfg.steps} ({res['stopped']}); continue "
              "with the same command and --resume"
              + (f" (exported as it is to {out})" if args.export_partial else ""))
        return
    state = "reused" if res["cached"] else "wrote"
    mode = "threshold" if cfg.variant == "fatrelu" else "oracle"  # FATReLU: the gate thresholds
    print(f"{state} {out} ({cfg.variant}, target sparsity {cfg.target_sparsity}); run it with "
          f"--model {out} --sparsity {mode} --target-sparsity {cfg.target_sparsity}")
    if args.json:
        _cli.print_json({"out": str(out), "cached": res["cached"], "threads": threads,
                         "config": cfg.to_dict()})
