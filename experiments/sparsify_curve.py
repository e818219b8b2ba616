"""Hypothesis: a few hundred thousand tokens of self-distillation on 2 CPU cores make SmolLM2-135M
sparse enough for the engine: >= 85% FFN sparsity at <= 1.10x dense perplexity, with activation
locality (fraction of neurons covering 80% of activations <= 0.35) and predictors that find the
active set (recall >= 0.95 at <= 10% of the FFN's bytes, end to end <= 1.12x dense).

Two kinds of rows in results/sparsify_curve.jsonl (`stage`):
  baseline/start/train/end: the learning curve, written by the training run itself
    (powerinfer_jax.sparsify --curve): perplexity x dense and measured FFN sparsity on a few
    validation chunks, in-process, at thresholds calibrated on training text;
  final: the finished model through the project's own pipeline: artifacts from
    sparsity/artifacts.build_artifacts, perplexity from powerinfer_jax.runtime.perplexity.perplexity on 16
    chunks of 512 (oracle, q4 predictor, low-rank predictor, and the dense teacher in the same
    run), locality from the profile's activation counts, predictor recall/precision/cost from the
    artifacts' held-out reports.

  python -m experiments.sparsify_curve --train threshold:0.85 --tokens 307200 [distill flags]
  python -m experiments.sparsify_curve --final DIR [DIR ...]     # final rows for finished models
  python -m experiments.sparsify_curve --step-speed 3           # step tok/s: f32/bf16/remat
  python -m experiments.sparsify_curve --recipe-sweep 0.87 --tokens 49152   # the controller
  python -m experiments.sparsify_curve --plot                    # results/sparsify_curve.png
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from experiments import _common

OUT = _common.RESULTS / "sparsify_curve.jsonl"
PNG = _common.RESULTS / "sparsify_curve.png"
DATA = {"valid": _common.DATA / "wiki.valid.txt", "train": _common.DATA / "wiki.train.txt"}
FINAL_CTX, FINAL_CHUNKS = 512, 16
_DENSE_CACHE: dict = {}


def _ppl(model_arg, sparsity, ids, threads):
    from powerinfer_jax.runtime import perplexity as evaluate
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build

    # weights="dtype": the teacher's Q4_1 blocks dequantized, as the student was trained from
    s = build(str(model_arg), RuntimeConfig(dtype="float32", threads=threads, weights="dtype"),
              sparsity, progress=False)
    t0 = time.perf_counter()
    res = evaluate.perplexity(s.model, ids, ctx=FINAL_CTX, max_chunks=FINAL_CHUNKS,
                              oracle_thresholds=s.oracle_thresholds)
    res["eval_s"] = round(time.perf_counter() - t0, 1)
    return res


FINAL_MODES = ("dense", "threshold", "oracle", "predictor (q4)", "predictor (lowrank)")


def final_rows(out_dir: Path, *, targets=None, threads: int, modes=FINAL_MODES) -> list[dict]:
    """The 'final' rows of one finished sparsify output directory, at its trained target
    sparsity and any other calibration `targets` (artifacts built where missing); `modes`: which
    of FINAL_MODES (threshold: relu, drelu and fatrelu only)."""
    from experiments.power_law import layer_rows
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.sparsify import build_artifacts
    from powerinfer_jax.sparsity.artifacts import target_dir
    from powerinfer_jax.sparsity.profile import ActivationProfile

    record = json.loads((out_dir / "sparsify.json").read_text())
    cfg = record["config"]
    targets = sorted({float(cfg["target_sparsity"]), *(targets or [])})
    missing = [t for t in targets
               if not (target_dir(out_dir / "sparsity", t) / "meta.json").is_file()]
    if missing:
        build_artifacts(out_dir, missing, corpus=[DATA["train"]])
    ckpt = load_checkpoint(out_dir)
    ids = ckpt.tokenizer.encode(DATA["valid"].read_text(encoding="utf-8"), add_bos=False)
    teacher = record["model"]
    if teacher not in _DENSE_CACHE:
        _DENSE_CACHE[teacher] = _ppl(teacher, SparsityConfig(), ids, threads)
    dense = _DENSE_CACHE[teacher]
    head = _common.header("sparsify_curve", threads=threads, dtype="float32", model=str(out_dir),
                          config=cfg, quick=False)
    common = {**head, "stage": "final", "variant": cfg["variant"], "teacher": teacher,
              "tokens": record["tokens_trained"], "steps": record["steps"],
              "planned_steps": record.get("planned_steps", record["steps"]),
              "wall_s": round(record["wall_s"], 1), "train_commit": record.get("commit"),
              "eval_chunks": FINAL_CHUNKS, "eval_ctx": FINAL_CTX, "ppl_dense": dense["ppl"]}
    rows = ([_final_row(common, "dense", None, _ppl(out_dir, SparsityConfig(), ids, threads),
                        dense, {})] if "dense" in modes else [])
    for t in targets:
        art_dir = target_dir(out_dir / "sparsity", t)
        meta = json.loads((art_dir / "meta.json").read_text())
        prof = ActivationProfile.load(art_dir / "profile.npz")
        cover = [r["neurons_for_80pct"] for r in layer_rows(prof.counts, prof.n_tokens)]
        at_t = {**common, "neurons_for_80pct_median": float(np.median(cover)),
                "neurons_for_80pct_mean": float(np.mean(cover)),
                "profiled_sparsity": float(np.mean(prof.sparsity))}
        # relu/drelu/fatrelu: the model's own zeros (FATReLU's gate thresholds) skipped exactly
        exact = ([("threshold", SparsityConfig(mode="threshold", target_sparsity=t), {})]
                 if cfg["variant"] in ("relu", "drelu", "fatrelu") else [])
        for label, sparsity, rep in (
                *exact,
                ("oracle", SparsityConfig(mode="oracle", target_sparsity=t), {}),
                ("predictor (q4)", SparsityConfig(mode="predictor", predictor="q4",
                                                  target_sparsity=t), meta.get("q4", {})),
                ("predictor (lowrank)", SparsityConfig(mode="predictor", predictor="lowrank",
                                                       target_sparsity=t),
                 meta.get("predictor", {}))):
            if label not in modes:
                continue
            rows.append(_final_row(at_t, label, t, _ppl(out_dir, sparsity, ids, threads), dense,
                                   rep))
    return rows


def _final_row(common: dict, mode: str, target, res: dict, dense: dict, report: dict) -> dict:
    row = {**common, "mode": mode, "target_sparsity": target, "ppl": res["ppl"],
           "ppl_x_dense": res["ppl"] / dense["ppl"], "ffn_sparsity": res["ffn_sparsity"],
           "eval_s": res["eval_s"]}
    if "predictor_recall" in res:
        row["predictor_recall"] = res["predictor_recall"]
    if report:
        row.update(heldout_recall=report.get("mean_recall"),
                   heldout_precision=report.get("mean_precision"),
                   predicted_sparsity=report.get("mean_predicted_sparsity"),
                   predictor_cost=report.get("cost"))
    print(f"{common['model']} {mode} {target}: ppl {res['ppl']:.3f} "
          f"({row['ppl_x_dense']:.3f}x dense {dense['ppl']:.3f}), FFN sparsity "
          f"{res['ffn_sparsity']:.3f}", flush=True)
    return row


def step_speed_rows(model_arg: str, *, rounds: int, threads: int) -> list[dict]:
    """Training tokens/s of one distillation step (teacher forward, student forward and backward,
    AdamW) for float32 vs bfloat16 matmuls and with/without remat, timed in interleaved rounds on
    the same batch (this VM drifts 20-30% within minutes, so only same-round ratios compare)."""
    import statistics

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsify import DistillConfig
    from powerinfer_jax.sparsify.train import Distiller

    ckpt = load_checkpoint(model_arg)
    teacher = from_params(ckpt.config, ckpt.params, kernels="xla")
    variants = {"float32": dict(compute_dtype="float32"), "bfloat16": {},
                "bfloat16+remat": dict(remat=True)}
    base = DistillConfig(refit=False, samples=0, sample_fraction=0.0)
    tokens = np.random.default_rng(0).integers(0, ckpt.config.vocab_size,
                                               (base.batch, base.seq_len)).astype(np.int32)
    runs = {}
    for name, kw in variants.items():
        d = Distiller(from_params(ckpt.config, ckpt.params, kernels="xla"), teacher,
                      base.replace(**kw))
        t0 = time.perf_counter()
        d.step(tokens, 0)  # compiles
        runs[name] = {"d": d, "compile_s": time.perf_counter() - t0, "tok_s": []}
    for r in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run["d"].step(tokens, r + 1)
            run["tok_s"].append(tokens.size / (time.perf_counter() - t0))
    ref = runs["float32"]["tok_s"]
    rows = []
    for name, run in runs.items():
        head = _common.header("sparsify_curve", threads=threads,
                              dtype=variants[name].get("compute_dtype", "bfloat16"),
                              model=model_arg, config=base.replace(**variants[name]).to_dict(),
                              quick=False)
        rows.append({**head, "stage": "step_speed", "variant": base.variant, "setting": name,
                     "tok_s_median": statistics.median(run["tok_s"]), "tok_s_rounds": run["tok_s"],
                     "x_float32_median": statistics.median(a / b for a, b in zip(run["tok_s"], ref)),
                     "compile_s": run["compile_s"], "rounds": rounds,
                     "tokens_per_step": int(tokens.size),
                     "load_avg_1min": os.getloadavg()[0]})
        print(f"step speed {name}: {rows[-1]['tok_s_median']:.1f} tok/s "
              f"({rows[-1]['x_float32_median']:.2f}x float32)", flush=True)
    return rows


def plot_curve(rows: list[dict], path: Path) -> None:
    """Two panels: perplexity x dense and measured FFN sparsity against training tokens, one line
    per run (variant, target, lr, run id); final 16-chunk oracle points as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs: dict = {}
    for r in rows:
        if r.get("stage") in ("baseline", "start", "train", "end"):
            c = r["config"]
            key = (c["variant"], c["target_sparsity"], c["lr"], c.get("refit"), r.get("commit"),
                   r.get("run"))
            runs.setdefault(key, []).append(r)
    for (variant, target, lr, refit, _, _), pts in runs.items():
        pts = sorted(pts, key=lambda r: (r["tokens"], r["stage"] != "baseline"))
        label = f"{variant} {target:.2f} lr {lr:g}{'' if refit else ' no refit'}"
        x = [max(r["tokens"], 1) for r in pts]
        line, = ax1.plot(x, [r["ppl_x_dense"] for r in pts], marker="o", ms=3, label=label)
        ax2.plot(x, [r["ffn_sparsity"] for r in pts], marker="o", ms=3, color=line.get_color())
    for r in rows:
        if r.get("stage") == "final" and r.get("mode") == "oracle":
            ax1.plot(max(r["tokens"], 1), r["ppl_x_dense"], marker="*", ms=12, color="k")
            ax2.plot(max(r["tokens"], 1), r["ffn_sparsity"], marker="*", ms=12, color="k")
    ax1.axhline(1.10, color="gray", ls=":", lw=1, label="target 1.10x")
    ax1.set_yscale("log")
    ax1.set_ylabel("perplexity / dense (wiki.valid, ctx 512)")
    ax2.axhline(0.85, color="gray", ls=":", lw=1, label="target 0.85")
    ax2.set_ylabel("measured FFN sparsity")
    for ax in (ax1, ax2):
        ax.set_xscale("symlog", linthresh=1024)
        ax.set_xlabel("training tokens (0 = before training)")
        ax.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=7)
    ax1.set_title("learning curve (dots: few chunks in-process; stars: 16 chunks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="*", default=[], metavar="VARIANT:TARGET",
                   help="runs to train (e.g. threshold:0.85 relu:0.85), then evaluate")
    p.add_argument("--tokens", type=int, default=307_200)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--l1", type=float, default=0.0)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--final", nargs="*", default=[], metavar="DIR",
                   help="finished sparsify output directories to evaluate")
    p.add_argument("--final-modes", nargs="+", default=list(FINAL_MODES), choices=FINAL_MODES,
                   metavar="MODE", help=f"which final rows (default: all of {FINAL_MODES})")
    p.add_argument("--targets", type=float, nargs="*", default=[],
                   help="also evaluate at these calibration targets (artifacts built if missing)")
    p.add_argument("--plot", action="store_true", help="only redraw the plot")
    p.add_argument("--step-speed", type=int, default=0, metavar="ROUNDS",
                   help="time one training step per setting (float32, bfloat16, remat) over "
                        "ROUNDS interleaved rounds")
    p.add_argument("--recipe-sweep", type=float, nargs="*", default=[], metavar="SPARSITY",
                   help="short relu runs of the prosparse recipe (cached teacher, --tokens), one "
                        "per L1 target sparsity (0: the stages' coefficients unsteered): how the "
                        "controller moves sparsity and perplexity at small scale")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--train-text", default=str(DATA["train"]), help="training/calibration text")
    p.add_argument("--valid-text", default=str(DATA["valid"]), help="validation text")
    args = p.parse_args(argv)
    DATA.update(train=Path(args.train_text), valid=Path(args.valid_text))
    from powerinfer_jax import _cli

    threads = _cli.configure_threads(args.threads)
    dirs = [Path(d) for d in args.final]
    if args.step_speed:
        _common.append_rows(args.out, step_speed_rows(_common.DEFAULT_MODEL,
                                                      rounds=args.step_speed, threads=threads))
    for target in args.recipe_sweep:
        import tempfile

        from powerinfer_jax.sparsify import distill
        from powerinfer_jax.sparsify.recipe import recipe

        cfg = recipe("prosparse", variant="relu", teacher="cached", tokens=args.tokens,
                     lr=args.lr, l1_target_sparsity=target)
        steps = cfg.steps
        with tempfile.TemporaryDirectory(prefix="pij-sweep-") as tmp:
            distill(_common.DEFAULT_MODEL, cfg, out=Path(tmp) / "m", corpus=[DATA["train"]],
                    eval_text=DATA["valid"], curve=args.out, eval_every=max(steps // 3, 1),
                    calibrate=False, save_every=10 ** 6)
    if args.train:
        from powerinfer_jax.sparsify import DistillConfig, distill

        for spec in args.train:
            variant, target = spec.split(":")
            cfg = DistillConfig(variant=variant, target_sparsity=float(target), lr=args.lr,
                                tokens=args.tokens, l1=args.l1, samples=args.samples)
            res = distill(_common.DEFAULT_MODEL, cfg, corpus=[DATA["train"]],
                          eval_text=DATA["valid"],
                          curve=args.out, eval_every=args.eval_every, keep_checkpoints=False,
                          calibrate=False)  # final_rows builds the artifacts it evaluates
            dirs.append(Path(res["out"]))
    for d in dirs:
        _common.append_rows(args.out, final_rows(d, targets=args.targets, threads=threads,
                                                   modes=args.final_modes))
    plot_curve(_common.read_rows(args.out), PNG if args.out == str(OUT) else
               Path(args.out).with_suffix(".png"))
    print(f"rows in {args.out}; plot {PNG}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
