"""Hypothesis: on SmolLM2-135M (SwiGLU), skipping the FFN neurons with the smallest contributions
costs little perplexity (oracle), a CATS-style gate threshold costs more, and a predictor gets close
to the oracle at >= 50% sparsity with recall >= 0.90. Two predictors: trained low-rank MLPs
("lowrank", DejaVu/PowerInfer-style) and 4-bit estimates of |a_i| ("q4"); "q4-gate-up" is the q4
predictor whose estimates also serve as the active neurons' activations (--gate-up q4: only down
rows read at full precision).

Calibrates on wiki.train.txt (profiling --max-tokens tokens), evaluates on wiki.valid.txt
(ctx 512, 16 chunks) for each target sparsity and mode; one JSONL row per (mode, target) appended
to results/quality_vs_sparsity.jsonl. The artifacts of each target are also saved into the model's
cache dir, where `--sparsity threshold|predictor` finds them.

  python experiments/quality_vs_sparsity.py [--targets 0.3 0.5 ...] [--modes oracle q4 ...]
      [--impl reference]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODES = ("oracle", "threshold", "lowrank", "q4", "q4-gate-up")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--targets", type=float, nargs="+", default=[0.3, 0.5, 0.6, 0.7, 0.8, 0.9])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="sparse modes per target; lowrank and q4 are predictor mode's predictors")
    p.add_argument("--impl", default="reference", choices=["ffi", "reference"])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(REPO / "results" / "quality_vs_sparsity.jsonl"))
    p.add_argument("--save-artifacts", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()

    from powerinfer_jax import _cli

    threads = _cli.configure_threads(args.threads)
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.perplexity import perplexity
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.sparsity import artifacts as A
    from powerinfer_jax.sparsity import corpus as C
    from powerinfer_jax.sparsity import modes
    from powerinfer_jax.sparsity import profile as P
    from powerinfer_jax.sparsity.predictor import TrainConfig

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params

    ckpt = load_checkpoint(args.model, keep_quantized=True)
    session = build(args.model, RuntimeConfig(threads=threads), checkpoint=ckpt)  # dense
    model, tok = session.model, session.tokenizer
    dense_layout = modes.ffn_layout(SparsityConfig(), session.config)
    by_layout = {}

    def model_for(cfg):
        """The model loaded with `cfg`'s layouts (one per distinct layout, from the same
        checkpoint: layouts are decided at load), configured with in-memory artifacts."""
        layout = modes.ffn_layout(cfg, session.config)
        if layout == dense_layout:
            return model
        if layout not in by_layout:
            by_layout[layout] = from_params(ckpt.config, ckpt.params, dtype=model.dtype,
                                            kernels=model.kernels, ffn_layout=layout)
        return by_layout[layout]
    fp = A.model_fingerprint(args.model, session.source, session.config)
    train_files = [DATA / "wiki.train.txt"]
    train_ids = tok.encode(C.read_corpus(train_files), add_bos=False)
    valid_ids = tok.encode((DATA / "wiki.valid.txt").read_text(encoding="utf-8"), add_bos=False)
    chunks = C.corpus_chunks(train_ids, args.ctx, args.max_tokens)
    x_lnd = P.collect_ffn_inputs(model, chunks)
    base = P.profile_activations(model, x_lnd)
    common = {"experiment": "quality_vs_sparsity", "run_id": os.environ.get("PIJ_RUN_ID"),
              "model": args.model, "commit": _cli.git_commit(), "machine": _cli.machine_info(),
              "threads": threads, "dtype": "float32", "impl": args.impl, "ctx": args.ctx,
              "eval_chunks": args.chunks, "eval_text": "wiki.valid.txt",
              "calib_text": "wiki.train.txt", "calib_tokens": int(chunks.size)}
    out = open(args.out, "a")

    def emit(row):
        row = {**common, **row}
        print(json.dumps({k: v for k, v in row.items() if k != "machine"}), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    def ppl(mode, arts=None, predictor="q4", gate_up="full", target=None):
        t0 = time.perf_counter()
        cfg = SparsityConfig(mode=mode, impl=args.impl, predictor=predictor, gate_up=gate_up,
                             target_sparsity=target)
        m = model_for(cfg)
        modes.configure(m, cfg, arts)
        r = perplexity(m, valid_ids, ctx=args.ctx, max_chunks=args.chunks,
                       oracle_thresholds=arts.thresholds_contribution if mode == "predictor"
                       else None, progress=True)
        r["eval_s"] = time.perf_counter() - t0
        return r

    dense = ppl("dense")
    emit({"mode": "dense", "target_sparsity": 0.0, **dense, "ppl_ratio": 1.0})
    for target in args.targets:
        train = TrainConfig(rank=args.rank, steps=args.steps) if "lowrank" in args.modes else None
        arts, prof = A.build_for_target(model, x_lnd, base, target, train=train)
        if args.save_artifacts:
            A.save_artifacts(A.target_dir(A.artifacts_root(args.model, session.source), target),
                             arts, prof, fp)
        for label in args.modes:
            mode, predictor, extra = label, "q4", {}
            gate_up = "q4" if label == "q4-gate-up" else "full"
            if label in ("lowrank", "q4", "q4-gate-up"):
                mode, predictor = "predictor", label.removesuffix("-gate-up")
                if predictor == "lowrank":
                    rep = arts.meta["predictor"]
                    extra = {"rank": args.rank, "train_steps": args.steps,
                             "predictor_flops_fraction": rep["cost"]["flops_fraction"]}
                else:
                    rep = arts.meta["q4"]
                    extra = {"predictor_bytes_fraction_bf16": rep["cost"]["bytes_fraction"]}
                extra.update(predictor=predictor, gate_up=gate_up,
                             heldout_recall=rep["mean_recall"],
                             heldout_precision=rep["mean_precision"],
                             heldout_predicted_sparsity=rep["mean_predicted_sparsity"])
            r = ppl(mode, arts, predictor, gate_up, target)
            emit({"mode": mode, "target_sparsity": target, **r,
                  "ppl_ratio": r["ppl"] / dense["ppl"], **extra})
    out.close()


if __name__ == "__main__":
    main()
