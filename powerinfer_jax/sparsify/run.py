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

from powerinfer_jax import _cli
from powerinfer_jax.errors import check, fail
from powerinfer_jax.sparsify.recipe import DistillConfig

EVAL_CTX = 512
CALIB_CHUNKS = 2  # corpus chunks of EVAL_CTX tokens the curve's thresholds are calibrated on
HIDDEN_ACT = {"relu": "relu", "drelu": "drelu", "fatrelu": "relu"}  # threshold: the teacher's
FATRELU_CHUNKS = 4  # training chunks FATReLU's threshold is calibrated on


def default_out(model_arg: str, cfg: DistillConfig) -> Path:
    # lazy: start-up (sparsify CLI)
    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, cache_dir
    from powerinfer_jax.sparsity import artifacts  # lazy: start-up (sparsify CLI)

    name = str(model_arg) if str(model_arg) in KNOWN_MODELS else Path(model_arg).stem
    target = artifacts.target_label(cfg.target_sparsity)  # 0.90, 0.865
    return cache_dir() / "models" / f"{name}-sparse-{cfg.variant}-{target}"


def check_teacher(config, source: str) -> None:
    check(config.arch == "llama" and config.gated and not config.bias,
          f"--model {source}: architecture",
          "a llama-family model with a gated FFN (act(gate) * up) and no biases", config.arch,
          "OPT/Falcon-style FFNs are not supported by sparsify")


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
               record: dict, stage: str, train: dict | None) -> dict:
    timing = record.get("timing", {})
    steady = record.get("counts", {}).get("steady_steps", 0)
    step_tok_s = steady * cfg.batch * cfg.seq_len / timing["step"] if timing.get("step") else None
    return {"experiment": "sparsify_curve", "variant": cfg.variant, "model": str(model_arg),
            "tokens": tokens, "step": step, "stage": stage,
            "ffn_sparsity": res["ffn_sparsity"], "ppl": res["ppl"], "ppl_dense": res["ppl_dense"],
            "ppl_x_dense": res["ppl_x_dense"], "eval_chunks": res["chunks"], "eval_ctx": EVAL_CTX,
            "eval": ("in-process threshold mode at per-layer gate thresholds calibrated on corpus "
                     "text (float32)" if cfg.variant == "fatrelu" else
                     "in-process oracle at thresholds calibrated on corpus text (float32)")
                    + (", FATReLU gate threshold applied" if res.get("gate_threshold") else ""),
            "gate_threshold": res.get("gate_threshold"),
            "train": train, "wall_s": round(sum(timing.values()), 1),
            "timing": {k: round(v, 1) for k, v in timing.items()},
            "step_tok_s": step_tok_s,
            "e2e_tok_s": tokens / sum(timing.values()) if tokens and timing else None,
            "threads": len(os.sched_getaffinity(0)), "machine": _cli.machine_info(),
            "commit": _cli.git_commit(), "config": cfg.to_dict()}


def curve_path(out: Path) -> Path:
    """Where a run's curve rows are kept beside its output in the model cache (every piece of
    a run appends; they outlive the checkpoints)."""
    return out.with_name(out.name + ".curve.jsonl")


def distill(model_arg: str, cfg: DistillConfig, *, out: str | os.PathLike | None = None,
            corpus=None, resume: bool = False, force: bool = False, progress: bool = True,
            calibrate: bool = True, eval_every: int = 0, eval_chunks: int = 4,
            eval_text: str | os.PathLike | None = None, curve: str | os.PathLike | None = None,
            save_every: int = 25, keep_checkpoints: bool = False, stop_after: int | None = None,
            export_partial: bool = False, time_budget: float | None = None,
            threads: int | None = None) -> dict:
    """Run (or reuse) one sparsification; returns {"out", "cached", "record"} (and "stopped_at"
    when it stopped before the last step).

    eval_every: steps between learning-curve points (0: only before and after training, and
    where a budgeted piece stops); points are appended to <out>.curve.jsonl in the model cache
    and, when given, to the JSONL file `curve`. stop_after: stop (as if interrupted, checkpoint
    saved) after this many steps in this call. time_budget: seconds this call may train (from
    its start, setup included): it stops, saved, before a step that would end past it; rerun
    with resume=True to continue (a long run in pieces). export_partial: when stopped early,
    still export (and calibrate) the model as it is; its sparsify.json says how many of the
    planned steps it had, and a later run resumes the rest.
    record["timing"]: seconds per part of the run, summed over its pieces (load, samples,
    refit, setup (the step's state, the teacher's runtime model, a checkpoint's restore), teacher
    (top-k targets), data, first_step (compiling), step, checkpoint, eval, fatrelu, export).
    """
    from powerinfer_jax.checkpoint import load_checkpoint  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.models.transformer import from_params  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity.artifacts import model_fingerprint  # lazy: start-up (sparsify CLI)
    # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify import data, export, teacher as tch
    from powerinfer_jax.sparsify import forward as fw  # lazy: start-up (sparsify CLI)
    # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify.checkpoints import TrainCheckpoints
    from powerinfer_jax.sparsify.schedule import L1Controller  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify.train import Distiller, Timer  # lazy: start-up (sparsify CLI)

    t_start = time.monotonic()
    deadline = None if time_budget is None else t_start + time_budget
    threads = threads or len(os.sched_getaffinity(0))
    timer = Timer()
    with timer.section("load"):
        ckpt = load_checkpoint(model_arg)
        check_teacher(ckpt.config, str(model_arg))
        fingerprint = model_fingerprint(model_arg, ckpt.source, ckpt.config)
    out = default_out(model_arg, cfg) if out is None else Path(out)
    out = out.expanduser().resolve()
    if not force and (done := _finished(out, fingerprint, cfg)) is not None:
        print(f"sparsify: {out} is up to date (same model and config); pass --force to retrain",
              file=sys.stderr)
        return {"out": out, "cached": True, "record": done}
    ckdir = out.with_name(out.name + ".train")
    if force and not resume:
        shutil.rmtree(ckdir, ignore_errors=True)
    checkpoints = TrainCheckpoints(ckdir)
    start = checkpoints.latest_step() or 0
    if start and not resume:
        checkpoints.close()
        fail("--out", f"no unfinished run in {ckdir}", f"a checkpoint at step {start}",
             "pass --resume to continue it, or --force to start over")
    record = {"fingerprint": fingerprint, "config": cfg.to_dict()}
    saved = checkpoints.read_record(start) if start else {}
    for part, seconds in saved.get("timing", {}).items():  # the earlier pieces of this run
        timer.add(part, seconds)
    timer.counts.update(saved.get("counts", {}))
    record["timing"], record["counts"] = timer.parts, timer.counts
    with timer.section("load"):
        ids = data.corpus_ids(ckpt.tokenizer, corpus)  # refuses wiki.valid and empty files
        chunks = data.corpus_chunks(ids, cfg.seq_len)
    with timer.section("samples"):
        samples = tch.samples(model_arg, ckpt, fingerprint, cfg, progress, threads)
    source = data.BatchSource(chunks, samples, cfg.batch, cfg.samples_per_batch, cfg.seed)
    with timer.section("load"):
        teacher = from_params(ckpt.config, ckpt.params, kernels="xla")
        student = from_params(ckpt.config, ckpt.params, kernels="xla")
    s_spec = fw.student_spec(ckpt.config, cfg.variant, cfg.target_sparsity, mask_by=cfg.mask_by,
                             ste=cfg.ste)
    curves = [curve_path(out)] + ([Path(curve)] if curve is not None else [])
    evaluator = None
    if curve is not None or eval_every:
        with timer.section("eval"):
            evaluator = _evaluator(teacher, ckpt.tokenizer, ids, cfg, eval_text, eval_chunks,
                                   saved.get("eval_dense"))
        record["eval_dense"] = evaluator.dense  # a later piece of the run reuses it
    window: list[dict] = []
    distiller = None

    def point(step: int, stage: str, model=None) -> None:
        if evaluator is None:
            return
        with timer.section("eval"):
            gate = None if distiller is None or not distiller.gate_threshold \
                else distiller.gate_threshold
            res = evaluator(distiller.student() if model is None else model, s_spec, gate)
        train = None if not window else {k: float(np.mean([m[k] for m in window]))
                                         for k in ("loss", "kl", "sparsity", "tok_s", "l1_coef")}
        window.clear()
        row = _curve_row(cfg, model_arg, res, tokens=step * cfg.batch * cfg.seq_len, step=step,
                         record=record, stage=stage, train=train)
        for path in curves:
            append_jsonl(path, row)

    if start == 0:
        point(0, "baseline", student)  # the untrained student: the teacher's weights, sparse
    if start == 0 and cfg.refit:
        from powerinfer_jax.sparsify.refit import refit_down_rows  # lazy: start-up (sparsify CLI)

        with timer.section("refit"):
            n = max(1, cfg.refit_tokens // cfg.seq_len)
            pick = np.random.default_rng([cfg.seed, 3]).permutation(len(chunks))[:n]
            record["refit"] = refit_down_rows(student, teacher, chunks[np.sort(pick)], s_spec,
                                              fw.teacher_spec(ckpt.config),
                                              target=cfg.refit_target, ridge=cfg.refit_ridge,
                                              progress=progress)
    with timer.section("setup"):
        distiller = Distiller(student, teacher if cfg.teacher == "online" else None, cfg)
        distiller.timer = timer
        batches = source if cfg.teacher == "online" else tch.cached_targets(
            model_arg, ckpt, fingerprint, cfg, source, threads=threads, timer=timer)
        if start:
            distiller.params, distiller.opt_state = checkpoints.restore(
                start, distiller.params, distiller.opt_state, record)
    if start:
        for key in ("refit", "fatrelu"):
            if key in saved:
                record[key] = saved[key]
        distiller.l1 = L1Controller(cfg, saved.get("l1_controller"))
        if start > (cfg.fatrelu_step if cfg.fatrelu_step is not None else cfg.steps):
            distiller.gate_threshold = float(record["fatrelu"]["threshold"])
        print(f"sparsify: resuming {ckdir} at step {start} of {cfg.steps}", file=sys.stderr)
    else:
        point(0, "start")

    def before_step(step: int) -> None:
        if step == cfg.fatrelu_step:
            calibrate_fatrelu(step)

    def calibrate_fatrelu(step: int) -> None:
        # lazy: start-up (sparsify CLI)
        from powerinfer_jax.sparsify.fatrelu import calibrate_threshold

        pick = np.random.default_rng([cfg.seed, 4]).permutation(len(chunks))[:FATRELU_CHUNKS]
        res = calibrate_threshold(distiller.student(), teacher, s_spec, chunks[np.sort(pick)],
                                  cfg.fatrelu_kl_rise)
        record["fatrelu"] = {**res, "step": step}
        distiller.gate_threshold = res["threshold"]

    def on_step(step: int, metrics: dict) -> None:
        window.append(metrics)

    stop = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    try:
        run = distiller.run(batches, start_step=start, stop_step=stop, checkpoints=checkpoints,
                            record=record, save_every=save_every, progress=progress,
                            on_step=on_step, eval_every=eval_every, before_step=before_step,
                            on_eval=lambda s: point(s, "train"), deadline=deadline,
                            on_pause=lambda s: point(s, "pause"))
    except BaseException:
        checkpoints.close()
        raise
    done = run["steps"]
    if done == cfg.steps and cfg.fatrelu_step == cfg.steps and "fatrelu" not in record:
        with timer.section("fatrelu"):
            calibrate_fatrelu(done)  # after the last step: the threshold is applied, not trained
    if done < cfg.steps:
        if not export_partial:
            checkpoints.close()
            return {"out": out, "cached": False, "stopped_at": done, "record": record,
                    "stopped": run["stopped"] or "stop_after"}
    else:
        point(cfg.steps, "end")

    with timer.section("export"):
        student = distiller.student()
        hidden_act = HIDDEN_ACT.get(cfg.variant, ckpt.config.activation)
        gate = distiller.gate_threshold or None
        if cfg.variant == "fatrelu":
            # its per-layer gate thresholds: the quantile of relu(gate) over ~CALIB_CHUNKS x
            # EVAL_CTX training tokens in the unmasked forward, as the curve calibrates them
            # (training used each batch's own quantile in the masked forward)
            # lazy: start-up (sparsify CLI)
            from powerinfer_jax.sparsify.evaluation import calibrate as calibrate_layers

            calib = chunks[:max(1, CALIB_CHUNKS * EVAL_CTX // cfg.seq_len)]
            gate = [float(t) for t in calibrate_layers(student, s_spec, cfg.target_sparsity,
                                                       calib)]
        record.update(model=str(model_arg), teacher_source=str(ckpt.source), steps=done,
                      planned_steps=cfg.steps, tokens_trained=done * cfg.batch * cfg.seq_len,
                      corpus_passes=source.corpus_passes(done), fatrelu_threshold=gate,
                      wall_s=timer.total(), l1_controller=distiller.l1.state(),
                      commit=_cli.git_commit(),
                      machine=_cli.machine_info(), threads=threads)
        export.write_hf_dir(out, _student_config(ckpt.config, hidden_act),
                            export.canonical_params(student), ckpt.tokenizer,
                            hidden_act=hidden_act, record=record, fatrelu_threshold=gate)
    checkpoints.close()
    if calibrate:
        build_artifacts(out, cfg.target_sparsity, corpus=corpus, progress=progress)
    if done < cfg.steps:
        return {"out": out, "cached": False, "stopped_at": done, "record": record,
                "stopped": run["stopped"] or "stop_after"}
    if not keep_checkpoints:
        shutil.rmtree(ckdir, ignore_errors=True)
    return {"out": out, "cached": False, "record": record}


def fill_teacher_cache(model_arg: str, cfg: DistillConfig, *, corpus=None, threads=None,
                       progress: bool = True) -> dict:
    """Compute every top-k target a run of `cfg` (teacher "cached") will read: the corpus chunks'
    and the samples' (generating the samples first if they are not cached). A run fills them on
    demand anyway; filled ahead (one ~15-minute piece for wiki.train on 2 cores), every run on
    the same text and teacher starts at the cached step's speed. Returns the rows and seconds."""
    from powerinfer_jax.checkpoint import load_checkpoint  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity.artifacts import model_fingerprint  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify import data, teacher as tch  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify.train import Timer  # lazy: start-up (sparsify CLI)

    threads = threads or len(os.sched_getaffinity(0))
    timer = Timer()
    ckpt = load_checkpoint(model_arg)
    check_teacher(ckpt.config, str(model_arg))
    fingerprint = model_fingerprint(model_arg, ckpt.source, ckpt.config)
    chunks = data.corpus_chunks(data.corpus_ids(ckpt.tokenizer, corpus), cfg.seq_len)
    with timer.section("samples"):
        samples = tch.samples(model_arg, ckpt, fingerprint, cfg, progress, threads)
    source = data.BatchSource(chunks, samples, cfg.batch, cfg.samples_per_batch, cfg.seed)
    targets = tch.cached_targets(model_arg, ckpt, fingerprint, cfg, source, threads=threads,
                                 timer=timer)
    caches = [c for c in (targets.corpus_cache, targets.sample_cache) if c is not None]
    before = sum(c.filled for c in caches)
    for c in caches:
        c.fill(range(len(c.pool)), progress=progress)
    rows = sum(c.filled for c in caches) - before
    return {"rows_filled": rows, "tokens_filled": rows * cfg.seq_len,
            "seconds": timer.parts.get("teacher", 0.0), "timing": timer.parts,
            "directories": [str(c.directory) for c in caches]}


def _student_config(config, activation: str):
    """The teacher's config with the student's activation; "drelu" where ModelConfig does not
    know it yet keeps the teacher's (the export writes hidden_act itself)."""
    try:
        return config.replace(activation=activation)
    except ValueError:
        return config


def build_artifacts(out: Path, target, *, corpus=None, progress: bool = True, train=None,
                    max_tokens: int | None = None, predictors: bool = True) -> list:
    """The project's sparsity artifacts (profile, thresholds, q4 and low-rank predictors) for the
    exported model, into <out>/sparsity: what `python -m powerinfer_jax.calibrate --model DIR
    --target-sparsity T` writes, for one target or several (one profiling pass for all).
    train: the low-rank predictors' TrainConfig (default: calibrate's); predictors=False builds
    the thresholds and profile only (minutes less). A model with a FATReLU threshold gets it as
    every layer's gate threshold (threshold mode runs FATReLU), and its profile and predictors
    describe FATReLU's active set (relu(gate) above the threshold)."""
    from powerinfer_jax.checkpoint import load_checkpoint  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.models.transformer import from_params  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity import artifacts as arts  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity import corpus as corpus_mod  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity import profile as prof  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity.predictor import TrainConfig  # lazy: start-up (sparsify CLI)
    # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity.thresholds import check_target_sparsity

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
    gate_layers = ckpt.config.fatrelu_thresholds or None
    for t in targets:
        a, profile = arts.build_for_target(
            model, x_lnd, base, t, train=None if not predictors else (
                TrainConfig() if train is None else train), progress=progress,
            gate_active=gate_layers)
        a.meta.update(corpus=[str(f) for f in files], tokens=int(chunks.size),
                      ctx=int(chunks.shape[1]))
        arts.save_artifacts(arts.target_dir(root, t), a, profile, fp)
        built.append(a)
    return built


def _evaluator(teacher, tokenizer, ids, cfg: DistillConfig, eval_text, eval_chunks: int,
               dense: dict | None = None):
    from powerinfer_jax.sparsify.evaluation import CurveEvaluator  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsify import data  # lazy: start-up (sparsify CLI)
    from powerinfer_jax.sparsity import corpus as corpus_mod  # lazy: start-up (sparsify CLI)

    path = Path(eval_text) if eval_text is not None else (
        corpus_mod.SHARED_DATA / corpus_mod.VALIDATION_NAME)
    if not path.is_file():
        fail("--eval-text", "an existing validation text file", str(path))
    valid = tokenizer.encode(path.read_text(encoding="utf-8"), add_bos=False)
    valid_nt = data.corpus_chunks(valid, EVAL_CTX)[:eval_chunks]
    calib_nt = data.corpus_chunks(ids, EVAL_CTX)[:CALIB_CHUNKS]
    if dense is not None and dense.get("chunks") != len(valid_nt):
        dense = None  # evaluated on other chunks: not this run's figure
    return CurveEvaluator(teacher, valid_nt, calib_nt, target=cfg.target_sparsity, dense=dense)


def append_jsonl(path, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
