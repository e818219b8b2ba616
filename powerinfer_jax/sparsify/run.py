"""`distill`: one sparsification run from a model name or path to a cached, loadable sparse model.

  load teacher -> data (corpus chunks + cached teacher samples) -> [least-squares refit of the down
  rows] -> distillation steps (resumable) -> export as an HF directory -> sparsity artifacts
  (the project's calibrate pipeline, into <out>/sparsity)

The output directory defaults to <cache>/models/<model>-sparse-<variant>-<target>; a finished run
there with the same model and config is reused, not retrained. Training checkpoints live beside it
in <out>.train/ until the export succeeds.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from powerinfer_jax.errors import check, fail
from powerinfer_jax.sparsify.config import DistillConfig

EVAL_CTX = 512
CALIB_CHUNKS = 2  # corpus chunks of EVAL_CTX tokens the curve's thresholds are calibrated on
HIDDEN_ACT = {"relu": "relu", "drelu": "drelu"}  # threshold: the teacher's activation


def default_out(model_arg: str, cfg: DistillConfig) -> Path:
    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, cache_dir

    name = str(model_arg) if str(model_arg) in KNOWN_MODELS else Path(model_arg).stem
    return cache_dir() / "models" / f"{name}-sparse-{cfg.variant}-{cfg.target_sparsity:.2f}"


def check_teacher(config, source: str) -> None:
    check(config.arch == "llama" and config.gated and not config.bias,
          f"--model {source}: architecture",
          "a llama-family model with a gated FFN (act(gate) * up) and no biases", config.arch,
          "OPT/Falcon-style FFNs are not supported by sparsify")


def _samples(ckpt, fingerprint: dict, cfg: DistillConfig, progress: bool) -> np.ndarray:
    """The teacher's samples, generated once per (model, count, length, seed) and cached."""
    from powerinfer_jax.checkpoint.registry import cache_dir
    from powerinfer_jax.sparsify import samples as smp

    if cfg.samples == 0:
        return np.zeros((0, cfg.seq_len), np.int32)
    path = cache_dir() / "sparsify" / (
        f"samples-{smp.samples_key(fingerprint['id'], cfg.samples, cfg.seq_len, cfg.seed)}.npy")
    if path.is_file():
        return np.load(path)
    from powerinfer_jax.models.transformer import from_params

    model = from_params(ckpt.config, ckpt.params, kernels="xla")
    out = smp.generate_samples(model, ckpt.tokenizer, n=cfg.samples, seq_len=cfg.seq_len,
                               seed=cfg.seed, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return out


def _finished(out: Path, fingerprint: dict, cfg: DistillConfig) -> dict | None:
    rec = out / "sparsify.json"
    if not (out / "config.json").is_file() or not rec.is_file():
        return None
    record = json.loads(rec.read_text())
    if (record.get("fingerprint") == fingerprint and record.get("config") == cfg.to_dict()
            and record.get("steps") == cfg.steps):
        return record
    return None


def _curve_row(cfg: DistillConfig, model_arg: str, res: dict, *, tokens: int, step: int,
               wall_s: float, stage: str, train: dict | None) -> dict:
    from powerinfer_jax import _cli

    return {"experiment": "sparsify_curve", "variant": cfg.variant, "model": str(model_arg),
            "tokens": tokens, "step": step, "stage": stage,
            "ffn_sparsity": res["ffn_sparsity"], "ppl": res["ppl"], "ppl_dense": res["ppl_dense"],
            "ppl_x_dense": res["ppl_x_dense"], "eval_chunks": res["chunks"], "eval_ctx": EVAL_CTX,
            "eval": "in-process oracle at thresholds calibrated on corpus text (float32)",
            "train": train, "wall_s": round(wall_s, 1),
            "threads": len(os.sched_getaffinity(0)), "machine": _cli.machine_info(),
            "commit": _cli.git_commit(), "config": cfg.to_dict()}


def distill(model_arg: str, cfg: DistillConfig, *, out: str | os.PathLike | None = None,
            corpus=None, resume: bool = False, force: bool = False, progress: bool = True,
            calibrate: bool = True, eval_every: int = 0, eval_chunks: int = 4,
            eval_text: str | os.PathLike | None = None, curve: str | os.PathLike | None = None,
            save_every: int = 25, keep_checkpoints: bool = False, stop_after: int | None = None,
            export_partial: bool = False) -> dict:
    """Run (or reuse) one sparsification; returns {"out", "cached", "record"}.

    eval_every: steps between learning-curve points (0: only before and after training, and only
    when `curve` is given); rows are appended to the JSONL file `curve`. stop_after: stop (as if
    interrupted, checkpoint saved) after this many steps in this call: tests and budgeted runs.
    export_partial: when stopped early, still export (and calibrate) the model as it is; its
    sparsify.json says how many of the planned steps it had, and a later run resumes the rest.
    """
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity.artifacts import model_fingerprint
    from powerinfer_jax.sparsify import data, export
    from powerinfer_jax.sparsify import forward as fw
    from powerinfer_jax.sparsify.checkpoints import TrainCheckpoints
    from powerinfer_jax.sparsify.train import Distiller

    t_start = time.perf_counter()
    ckpt = load_checkpoint(model_arg)
    check_teacher(ckpt.config, str(model_arg))
    fingerprint = model_fingerprint(model_arg, ckpt.source, ckpt.config)
    out = default_out(model_arg, cfg) if out is None else Path(out)
    out = out.expanduser().resolve()
    if not force and (done := _finished(out, fingerprint, cfg)) is not None:
        print(f"sparsify: {out} is up to date (same model and config); pass --force to retrain",
              file=sys.stderr)
        return {"out": out, "cached": True, "record": done}
    ids = data.corpus_ids(ckpt.tokenizer, corpus)  # refuses wiki.valid and empty files
    chunks = data.corpus_chunks(ids, cfg.seq_len)
    source = data.BatchSource(chunks, _samples(ckpt, fingerprint, cfg, progress), cfg.batch,
                              cfg.samples_per_batch, cfg.seed)
    teacher = from_params(ckpt.config, ckpt.params, kernels="xla")
    student = from_params(ckpt.config, ckpt.params, kernels="xla")
    record = {"fingerprint": fingerprint, "config": cfg.to_dict(), "wall_s": 0.0}
    ckdir = out.with_name(out.name + ".train")
    if force and not resume:
        shutil.rmtree(ckdir, ignore_errors=True)
    checkpoints = TrainCheckpoints(ckdir)
    start = checkpoints.latest_step() or 0
    if start and not resume:
        fail("--out", f"no unfinished run in {ckdir}", f"a checkpoint at step {start}",
             "pass --resume to continue it, or --force to start over")
    s_spec = fw.student_spec(ckpt.config, cfg.variant, cfg.target_sparsity, mask_by=cfg.mask_by,
                             ste=cfg.ste)
    evaluator = _evaluator(teacher, ckpt.tokenizer, ids, cfg, eval_text, eval_chunks) \
        if curve is not None else None
    window: list[dict] = []
    eval_s = [0.0]  # evaluation time, kept out of the run's wall time

    def point(step: int, stage: str, model=None) -> None:
        if evaluator is None:
            return
        t0 = time.perf_counter()
        res = evaluator(distiller.student() if model is None else model, s_spec)
        eval_s[0] += time.perf_counter() - t0
        train = None if not window else {k: float(np.mean([m[k] for m in window]))
                                         for k in ("loss", "kl", "sparsity", "tok_s")}
        window.clear()
        append_jsonl(curve, _curve_row(cfg, model_arg, res, tokens=step * cfg.batch * cfg.seq_len,
                                       step=step, wall_s=record["wall_s"], stage=stage,
                                       train=train))

    def on_step(step: int, metrics: dict) -> None:
        window.append(metrics)
        record["wall_s"] += cfg.batch * cfg.seq_len / metrics["tok_s"]

    if start == 0:
        point(0, "baseline", student)  # the untrained student: the teacher's weights, sparse
    if start == 0 and cfg.refit:
        from powerinfer_jax.sparsify.refit import refit_down_rows

        n = max(1, cfg.refit_tokens // cfg.seq_len)
        pick = np.random.default_rng([cfg.seed, 3]).permutation(len(chunks))[:n]
        record["refit"] = refit_down_rows(student, teacher, chunks[np.sort(pick)], s_spec,
                                       fw.teacher_spec(ckpt.config), target=cfg.refit_target,
                                       ridge=cfg.refit_ridge, progress=progress)
    distiller = Distiller(student, teacher, cfg)
    if start:
        saved = checkpoints.read_record(start)
        distiller.params, distiller.opt_state = checkpoints.restore(
            start, distiller.params, distiller.opt_state, record)
        record["wall_s"] = float(saved.get("wall_s", 0.0))
        record["refit"] = saved.get("refit")
        print(f"sparsify: resuming {ckdir} at step {start} of {cfg.steps}", file=sys.stderr)
    else:
        # loading, data, samples and refit
        record["wall_s"] = time.perf_counter() - t_start - eval_s[0]
    if start == 0:
        point(0, "start")
    stop = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    run = distiller.run(source, start_step=start, stop_step=stop, checkpoints=checkpoints,
                        record=record, save_every=save_every, progress=progress,
                        on_step=on_step, eval_every=eval_every,
                        on_eval=lambda s: point(s, "train"))
    done = run["steps"]
    if done < cfg.steps and not export_partial:
        checkpoints.close()
        return {"out": out, "cached": False, "stopped_at": done, "record": record}
    if done == cfg.steps:
        point(cfg.steps, "end")
    from powerinfer_jax import _cli

    student = distiller.student()
    hidden_act = HIDDEN_ACT.get(cfg.variant, ckpt.config.activation)
    record.update(model=str(model_arg), teacher_source=str(ckpt.source), steps=done,
                  planned_steps=cfg.steps, tokens_trained=done * cfg.batch * cfg.seq_len,
                  corpus_passes=source.corpus_passes(done),
                  commit=_cli.git_commit(), machine=_cli.machine_info(),
                  threads=len(os.sched_getaffinity(0)))
    export.write_hf_dir(out, _student_config(ckpt.config, hidden_act),
                        export.canonical_params(student), ckpt.tokenizer, hidden_act=hidden_act,
                        record=record)
    checkpoints.close()
    if calibrate:
        build_artifacts(out, cfg.target_sparsity, corpus=corpus, progress=progress)
    if done < cfg.steps:
        return {"out": out, "cached": False, "stopped_at": done, "record": record}
    if not keep_checkpoints:
        shutil.rmtree(ckdir, ignore_errors=True)
    return {"out": out, "cached": False, "record": record}


def _student_config(config, activation: str):
    """The teacher's config with the student's activation; "drelu" where ModelConfig does not
    know it yet keeps the teacher's (the export writes hidden_act itself)."""
    try:
        return config.replace(activation=activation)
    except ValueError:
        return config


def build_artifacts(out: Path, target, *, corpus=None, progress: bool = True, train=None,
                    max_tokens: int | None = None) -> list:
    """The project's sparsity artifacts (profile, thresholds, q4 and low-rank predictors) for the
    exported model, into <out>/sparsity: what `python -m powerinfer_jax.calibrate --model DIR
    --target-sparsity T` writes, for one target or several (one profiling pass for all).
    train: the low-rank predictors' TrainConfig (default: calibrate's)."""
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity import artifacts as arts
    from powerinfer_jax.sparsity import corpus as corpus_mod
    from powerinfer_jax.sparsity import profile as prof
    from powerinfer_jax.sparsity.calibrate import check_target_sparsity
    from powerinfer_jax.sparsity.predictor import TrainConfig

    targets = [check_target_sparsity(t) for t in (target if isinstance(target, (list, tuple))
                                                  else [target])]
    ckpt = load_checkpoint(out)
    model = from_params(ckpt.config, ckpt.params)
    fp = arts.model_fingerprint(str(out), ckpt.source, ckpt.config)
    root = arts.artifacts_root(str(out), ckpt.source)
    files = corpus_mod.default_corpus_files() if corpus is None else list(corpus)
    ids = ckpt.tokenizer.encode(corpus_mod.read_corpus(files), add_bos=False)
    chunks = corpus_mod.corpus_chunks(ids, min(arts.DEFAULT_CTX, model.config.max_seq_len),
                                      max_tokens or arts.DEFAULT_MAX_TOKENS)
    x_lnd = prof.collect_ffn_inputs(model, chunks, progress=progress)
    base = prof.profile_activations(model, x_lnd, progress=progress)
    built = []
    for t in targets:
        a, profile = arts.build_for_target(model, x_lnd, base, t,
                                           train=TrainConfig() if train is None else train,
                                           progress=progress)
        a.meta.update(corpus=[str(f) for f in files], tokens=int(chunks.size),
                      ctx=int(chunks.shape[1]))
        arts.save_artifacts(arts.target_dir(root, t), a, profile, fp)
        built.append(a)
    return built


def _evaluator(teacher, tokenizer, ids, cfg: DistillConfig, eval_text, eval_chunks: int):
    from powerinfer_jax.sparsify.evaluation import CurveEvaluator
    from powerinfer_jax.sparsify import data
    from powerinfer_jax.sparsity import corpus as corpus_mod

    path = Path(eval_text) if eval_text is not None else (
        corpus_mod.SHARED_DATA / corpus_mod.VALIDATION_NAME)
    if not path.is_file():
        fail("--eval-text", "an existing validation text file", str(path))
    valid = tokenizer.encode(path.read_text(encoding="utf-8"), add_bos=False)
    valid_nt = data.corpus_chunks(valid, EVAL_CTX)[:eval_chunks]
    calib_nt = data.corpus_chunks(ids, EVAL_CTX)[:CALIB_CHUNKS]
    return CurveEvaluator(teacher, valid_nt, calib_nt, target=cfg.target_sparsity)


def append_jsonl(path, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
