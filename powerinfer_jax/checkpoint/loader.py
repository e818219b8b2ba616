"""`load_checkpoint`: one entry point for GGUF files, HF directories and registry names."""
from __future__ import annotations

import os

from powerinfer_jax.checkpoint.base import Checkpoint
from powerinfer_jax.checkpoint.registry import resolve_model


def load_checkpoint(name_or_path: str | os.PathLike, *, keep_quantized: bool = False) -> Checkpoint:
    """Load a `.gguf` file, a Hugging Face directory, or a registry name (e.g. "smollm2-135m",
    downloaded into the cache on first use) into a `Checkpoint` of float32 numpy params.

    keep_quantized (GGUF only): block-quantized matrices stay as `QuantTensor`s, their file's
    blocks kept once (`.dequantize()` gives the float32 param) for the quantized kernels."""
    path = resolve_model(name_or_path)
    if path.is_dir():
        from powerinfer_jax.checkpoint.hf import load_hf

        return load_hf(path)
    from powerinfer_jax.checkpoint.gguf import load_gguf

    return load_gguf(path, keep_quantized=keep_quantized)
