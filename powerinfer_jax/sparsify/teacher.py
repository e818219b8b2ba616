"""The teacher's side of a run: its samples (generated once, cached; a bfloat16 XLA decode loop)
and its top-k targets (teacher_cache.py), computed by the runtime's quantized CPU kernels where
they exist (the same GGUF blocks the student was dequantized from; prefill ~1.3x the XLA bf16
forward on 2 cores), else by the float model through XLA (a GPU, or a checkout without the
compiled extension).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint.registry import cache_dir
from powerinfer_jax.config import RuntimeConfig
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.runtime.session import build
from powerinfer_jax.sparsify import forward as fw, samples as smp, teacher_cache as tc
from powerinfer_jax.sparsify.recipe import DistillConfig

SAMPLE_BATCH = 64  # rows decoding together while teacher samples are generated


def _has_extension() -> bool:
    try:
        from powerinfer_jax.ops import _ffi  # noqa: F401  # lazy: optional C++ extension
    except ImportError:
        return False
    return True


def fast_runtime() -> bool:
    """Whether the runtime's quantized CPU kernels can serve the teacher's inference (samples,
    top-k targets): on a CPU backend with the compiled extension."""
    import jax

    return jax.default_backend() == "cpu" and _has_extension()


def samples(model_arg, ckpt, fingerprint: dict, cfg: DistillConfig, progress: bool,
            threads: int) -> np.ndarray:
    """The teacher's samples, generated once per (model, count, length, seed, generator) and
    cached: samples.generate_samples on a bfloat16 copy of the teacher, SAMPLE_BATCH rows at a
    time (243 tok/s on 2 cores, against 32 for the runtime's Engine and 51 for the same loop
    before its top-64 nucleus: benchmarks/sparsify_throughput.jsonl, kind "samples")."""
    import jax.numpy as jnp

    if cfg.samples == 0:
        return np.zeros((0, cfg.seq_len), np.int32)
    key = smp.samples_key(fingerprint["id"], cfg.samples, cfg.seq_len, cfg.seed,
                          generator=f"batched-v2-bf16-{SAMPLE_BATCH}")
    path = cache_dir() / "sparsify" / f"samples-{key}.npy"
    if path.is_file():
        return np.load(path)
    model = from_params(ckpt.config, ckpt.params, kernels="xla", dtype=jnp.bfloat16)
    out = smp.generate_samples(model, ckpt.tokenizer, n=cfg.samples, seq_len=cfg.seq_len,
                               seed=cfg.seed, batch=SAMPLE_BATCH, progress=progress)
    _save_npy(path, out)
    return out


def _save_npy(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)




def topk_fn(model_arg, ckpt, cfg: DistillConfig, threads: int):
    """(teacher_fn for TopKCache, tag naming how it runs): tokens [b, T] -> (ids, logp) [b, T, k]
    of the teacher, jitted once per shape with the weights as arguments."""
    import jax
    from flax import nnx

    if fast_runtime():
        model = build(str(model_arg), RuntimeConfig(dtype="bfloat16", threads=threads,
                                                    max_seq_len=cfg.seq_len),
                      progress=False).model
        tag = "runtime-bf16"

        def logits(m, tokens_bt):
            return m(tokens_bt)
    else:
        model = from_params(ckpt.config, ckpt.params, kernels="xla")
        spec = fw.teacher_spec(ckpt.config)
        tag = "xla-bf16"

        def logits(m, tokens_bt):
            return fw.forward(m, tokens_bt, spec, compute_dtype=jax.numpy.bfloat16)[0]

    graphdef, state = nnx.split(model)
    k = cfg.topk

    @jax.jit
    def run(state, tokens_bt):
        return fw.teacher_topk(logits(nnx.merge(graphdef, state), tokens_bt), k)

    def teacher_fn(tokens_bt):
        ids, logp = run(state, jax.numpy.asarray(tokens_bt))
        return np.asarray(ids), np.asarray(logp)

    return teacher_fn, tag


def cached_targets(model_arg, ckpt, fingerprint: dict, cfg: DistillConfig, source, *,
                   threads: int, timer=None):
    """A teacher_cache.CachedTargets over `source` (data.BatchSource), its caches under
    <cache>/sparsify/teacher-<key>/ (one for the corpus chunks, one for the samples)."""
    fn, tag = topk_fn(model_arg, ckpt, cfg, threads)
    root = cache_dir() / "sparsify"
    vocab = ckpt.config.vocab_size

    def cache(pool):
        key = tc.cache_key(fingerprint["id"], pool, cfg.topk, tag)
        return tc.TopKCache(root / f"teacher-{key}", pool, cfg.topk, fn, vocab, timer=timer)

    samples = cache(source.samples) if len(source.samples) else None
    return tc.CachedTargets(source, cache(source.corpus), samples)
