"""The final evaluation of a sparsified model directory, through the runtime: what the issue's
quality targets are stated in.

  perplexity on wiki.valid (16 chunks of 512, every token but the first scored, float32 weights
  dequantized from the teacher's file as the student was trained from) of the dense teacher, the
  model (dense mode: FATReLU at its thresholds where it stores them, which the runtime applies
  in every mode, else plain ReLU), its natural sparsity (oracle mode at threshold 0: exact
  zeros), and, when it stores a FATReLU threshold, threshold mode at the calibrated thresholds
  (sparsify/fatrelu.py) with the sparsity it reaches; the power law: per layer, the smallest
  share of neurons that holds 80% of the activations (counts of a_i != 0 over training text, at
  the model's FATReLU thresholds), median and mean.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax import _cli
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.config import RuntimeConfig, SparsityConfig
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.runtime.perplexity import perplexity
from powerinfer_jax.runtime.session import build
from powerinfer_jax.sparsify import forward as fw

COVERAGE = 0.8  # the power law's share of activations (experiments/power_law.py)
FINAL_CTX, FINAL_CHUNKS = 512, 16
COUNT_CHUNKS = 16  # training chunks of FINAL_CTX the activation counts are taken over


def neurons_for_coverage(counts_lf: np.ndarray, coverage: float = COVERAGE) -> np.ndarray:
    """Per layer, the smallest share of neurons whose activation counts hold `coverage` of the
    layer's activations ([L] in (0, 1]; as experiments/power_law.layer_rows)."""
    srt = -np.sort(-np.asarray(counts_lf, np.float64), axis=1)
    cum = np.cumsum(srt, axis=1)
    total = np.maximum(cum[:, -1:], 1.0)
    return ((cum / total < coverage).sum(axis=1) + 1) / srt.shape[1]


def activation_counts(model, chunks_nt: np.ndarray, activation: str,
                      gate_thresholds=None) -> np.ndarray:
    """[L, F] int64: how many tokens of chunks [n, T] activate each neuron (a_i != 0) in `model`
    (kernels="xla", float32) with `activation` (and FATReLU's per-layer thresholds)."""
    spec = fw.FFNSpec(activation)
    graphdef, state = nnx.split(model)
    gates = [None] * len(model.layers) if gate_thresholds is None else [
        jnp.float32(t) for t in gate_thresholds]

    @jax.jit
    def counts(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        x = m.tok_embed[...][tokens_bt].astype(jnp.float32) * m.config.embed_scale
        out = []
        for layer, gate in zip(m.layers, gates):
            x = layer.attention_residual(x, positions)
            y, a, _, _ = fw.ffn_forward(layer.ffn, layer.ffn_norm(x), spec, gate_threshold=gate)
            if layer.ffn_post_norm is not None:  # Gemma: the FFN's output normed
                y = layer.ffn_post_norm(y)
            out.append(jnp.sum(a != 0, axis=(0, 1), dtype=jnp.int32))
            x = x + y
        return jnp.stack(out)

    total = 0
    for c in chunks_nt:
        total = total + np.asarray(counts(state, jnp.asarray(c[None])), np.int64)
    return total


def _ppl(model_arg, sparsity, ids, threads: int) -> dict:
    s = build(str(model_arg), RuntimeConfig(dtype="float32", threads=threads, weights="dtype"),
              sparsity, progress=False)
    t0 = time.perf_counter()
    res = perplexity(s.model, ids, ctx=FINAL_CTX, max_chunks=FINAL_CHUNKS)
    res["eval_s"] = round(time.perf_counter() - t0, 1)
    return res


def final_rows(out_dir: Path, teacher_arg: str, *, target: float, train_text, valid_text,
               threads: int | None = None, extra: dict | None = None) -> list[dict]:
    """Rows (dicts) of the final evaluation of `out_dir` (its sparsity artifacts for `target`
    must exist when it stores a FATReLU threshold: threshold mode reads them)."""
    threads = threads or len(os.sched_getaffinity(0))
    ckpt = load_checkpoint(out_dir)
    ids = ckpt.tokenizer.encode(Path(valid_text).read_text(encoding="utf-8"), add_bos=False)
    train = ckpt.tokenizer.encode(Path(train_text).read_text(encoding="utf-8"), add_bos=False)
    n = min(COUNT_CHUNKS, len(train) // FINAL_CTX)
    chunks = np.asarray(train[:n * FINAL_CTX], np.int32).reshape(n, FINAL_CTX)
    model = from_params(ckpt.config, ckpt.params, kernels="xla")
    gate = list(ckpt.config.fatrelu_thresholds) or None  # FATReLU's, one per layer
    dense = _ppl(teacher_arg, SparsityConfig(), ids, threads)
    head = {"experiment": "sparsify_curve", "stage": "final", "model": str(out_dir),
            "teacher": str(teacher_arg), "activation": ckpt.config.activation,
            "eval_chunks": FINAL_CHUNKS, "eval_ctx": FINAL_CTX, "ppl_dense": dense["ppl"],
            "fatrelu_threshold": gate, "commit": _cli.git_commit(),
            "machine": _cli.machine_info(), "threads": threads, **(extra or {})}
    # the runtime applies a FATReLU model's thresholds in every mode (ModelConfig
    # .fatrelu_thresholds): its dense and oracle rows are FATReLU's, counted at its thresholds
    runs = [("dense", SparsityConfig(), gate),
            ("natural (oracle at 0)", SparsityConfig(mode="oracle", threshold=0.0), gate)]
    if gate is not None:
        runs.append(("fatrelu (threshold mode)",
                     SparsityConfig(mode="threshold", target_sparsity=target), gate))
    rows = []
    for mode, sparsity, g in runs:
        res = _ppl(out_dir, sparsity, ids, threads)
        cover = neurons_for_coverage(activation_counts(model, chunks, ckpt.config.activation, g))
        rows.append({**head, "mode": mode, "ppl": res["ppl"],
                     "ppl_x_dense": res["ppl"] / dense["ppl"],
                     "ffn_sparsity": res["ffn_sparsity"], "gate_threshold": g,
                     "neurons_for_80pct_median": float(np.median(cover)),
                     "neurons_for_80pct_mean": float(np.mean(cover)),
                     "count_tokens": int(chunks.size), "eval_s": res["eval_s"]})
        print(f"{out_dir.name} {mode}: ppl {res['ppl']:.3f} ({rows[-1]['ppl_x_dense']:.3f}x "
              f"dense {dense['ppl']:.3f}), FFN sparsity {res['ffn_sparsity']:.4f}, 80% of "
              f"activations in {rows[-1]['neurons_for_80pct_median']:.3f} of the neurons "
              f"(median layer)", flush=True)
    return rows
