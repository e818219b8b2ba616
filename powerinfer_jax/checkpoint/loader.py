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
        from powerinfer_jax.checkpoint.hf import load_hf  # lazy: start-up (HF directories only)

        return load_hf(path)
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf import load_gguf

    ckpt = load_gguf(path, keep_quantized=keep_quantized)
    return_freed_memory()
    return ckpt


def return_freed_memory() -> None:
    """Give the C heap's freed pages back to the OS (glibc's malloc_trim). Reading a GGUF frees
    the reader's temporaries (metadata arrays, per-tensor views and float conversions) in small
    pieces that glibc keeps in its arenas: measured on the default Q4_1 model, resident memory
    after the load was 1.51x the file without this, 1.25x with it (benchmarks/quant_memory.py).
    Building the model from the checkpoint frees as much again (the session calls this once
    more when it is built: 86 MiB on the SYNTHETIC 7B, before the first step could reuse it).
    Elsewhere (musl, macOS) nothing is done."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:  # no gc.collect() first: the reader's temporaries hold no cycles
        trim(0)
