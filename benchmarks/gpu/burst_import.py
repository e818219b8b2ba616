"""`python -m benchmarks.gpu.burst_import DIR`: a GPU burst's output (benchmarks/gpu/burst_files.py) made
into a model every CLI loads, then evaluated.

The teacher (default: the registry's SmolLM2, checked against the sha256 the burst trained from)
plus the burst's FFN deltas and norms -> a Hugging Face directory (hidden_act relu or drelu, the
FATReLU threshold in config.json) with its sparsity artifacts (thresholds, profile; low-rank
predictors with --predictors) -> the final evaluation (report.py): wiki.valid perplexity 16 x 512
(dense teacher, the model: FATReLU at its thresholds, threshold mode), natural FFN sparsity, power law; rows appended to the
model's curve file in the cache (<out>.curve.jsonl) and to --curve.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from powerinfer_jax import _cli
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, cache_dir
from powerinfer_jax.errors import fail
from powerinfer_jax.sparsify.report import final_rows
from powerinfer_jax.sparsify.run import _student_config, append_jsonl, build_artifacts, curve_path
from powerinfer_jax.sparsity import corpus as corpus_mod


def default_out(model_arg: str, log_path: Path, variant: str) -> Path:
    name = str(model_arg) if str(model_arg) in KNOWN_MODELS else Path(model_arg).stem
    tag = hashlib.sha256(log_path.read_bytes()).hexdigest()[:8]
    return cache_dir() / "models" / f"{name}-burst-{variant}-{tag}"


def teacher_sha256(model_arg: str, source: Path) -> str:
    # lazy: start-up (gguf only for GGUF files)
    from benchmarks.gpu.burst_files import digest

    if str(model_arg) in KNOWN_MODELS:
        return KNOWN_MODELS[str(model_arg)].sha256
    return digest(Path(source))


def import_burst(directory, *, model_arg: str, out=None, target: float = 0.85, corpus=None,
                 predictors: bool = False, progress: bool = True) -> tuple[Path, dict]:
    """Rebuild the burst's student from the teacher and write it (with its artifacts) to `out`;
    returns (out, the burst's log)."""
    # lazy: start-up (gguf only for GGUF files)
    from benchmarks.gpu import burst_files
    from powerinfer_jax.sparsify import export

    directory = Path(directory)
    log_path = directory / burst_files.LOG
    if not log_path.is_file():
        fail("burst_import DIR", f"a burst output folder with {burst_files.LOG}", str(directory),
             "the folder the remote runner returned for $OUT")
    log = json.loads(log_path.read_text())
    ckpt = load_checkpoint(model_arg)
    want = log.get("teacher_sha256")
    got = teacher_sha256(model_arg, ckpt.source)
    if want != got:
        fail(f"--model {model_arg}", f"the teacher the burst trained from (sha256 {want})", got)
    params, log = burst_files.read(directory, ckpt.params, ckpt.config.n_layers)
    variant = log["args"]["variant"]
    gate = log.get("fatrelu_threshold")
    out = default_out(model_arg, log_path, variant) if out is None else Path(out)
    record = {"model": str(model_arg), "teacher_source": str(ckpt.source),
              "config": log.get("config"), "steps": log.get("steps"),
              "planned_steps": log.get("planned_steps"), "tokens_trained": log.get("tokens_trained"),
              "wall_s": log.get("wall_s"), "fatrelu_threshold": gate, "commit": None,
              "burst": {k: log.get(k) for k in ("device", "tok_s", "timing", "eval", "fatrelu",
                                                 "samples", "stopped", "delta_relative_norm",
                                                 "final")},
              "burst_dir": str(directory.resolve())}
    export.write_hf_dir(out, _student_config(ckpt.config, variant), params, ckpt.tokenizer,
                        hidden_act=variant, record=record, fatrelu_threshold=gate)
    build_artifacts(out, target, corpus=corpus, progress=progress, predictors=predictors)
    return out, log


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.burst_import",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the burst's output folder ($OUT of train_burst.sh run)")
    p.add_argument("--model", default=_cli.DEFAULT_MODEL, help="the teacher it was trained from")
    p.add_argument("--out", default=None,
                   help="model directory to write (default: <cache>/models/<model>-burst-...)")
    p.add_argument("--target-sparsity", type=float, default=0.85,
                   help="artifacts folder name of the threshold mode (FATReLU)")
    p.add_argument("--corpus", nargs="+", default=None,
                   help="training text for the artifacts and the activation counts (default: "
                        "the project's wiki.train.txt)")
    p.add_argument("--eval-text", default=None, help="validation text (default: wiki.valid.txt)")
    p.add_argument("--predictors", action=argparse.BooleanOptionalAction, default=False,
                   help="also train the low-rank predictors (~8 minutes on 2 cores)")
    p.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--curve", default=None, help="also append the evaluation rows here (JSONL)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.configure_threads(args.threads)
    corpus = args.corpus or [str(f) for f in corpus_mod.default_corpus_files()]
    valid = args.eval_text or str(corpus_mod.SHARED_DATA / corpus_mod.VALIDATION_NAME)
    if args.eval and not Path(valid).is_file():
        fail("--eval-text", "an existing validation text file", valid)
    out, log = import_burst(args.dir, model_arg=args.model, out=args.out,
                            target=args.target_sparsity, corpus=corpus,
                            predictors=args.predictors, progress=args.progress)
    print(f"wrote {out} ({log['args']['variant']}, FATReLU threshold "
          f"{log.get('fatrelu_threshold')}); run it with --model {out} [--sparsity threshold "
          f"--target-sparsity {args.target_sparsity}]")
    if not args.eval:
        return
    extra = {"source": "gpu burst", "variant": log["args"]["variant"],
             "tokens": log.get("tokens_trained"), "steps": log.get("steps"),
             "burst": {k: log.get(k) for k in ("device", "tok_s", "stopped", "wall_s")},
             "burst_eval": log.get("eval"), "config": log.get("config")}
    rows = final_rows(out, args.model, target=args.target_sparsity, train_text=corpus[0],
                      valid_text=valid, threads=threads, extra=extra)
    for path in [curve_path(out)] + ([Path(args.curve)] if args.curve else []):
        for row in rows:
            append_jsonl(path, row)
