"""`load_checkpoint`: one entry point for GGUF files, HF directories and registry names."""
from __future__ import annotations

import contextlib
import gc
import os

from powerinfer_jax.checkpoint.base import Checkpoint
from powerinfer_jax.checkpoint.registry import resolve_model


def load_checkpoint(name_or_path: str | os.PathLike, *, keep_quantized: bool = False) -> Checkpoint:
    """Load a `.gguf` file, a Hugging Face directory, or a registry name (e.g. "smollm2-135m",
    downloaded into the cache on first use) into a `Checkpoint` of float32 numpy params.

    keep_quantized (GGUF only): block-quantized matrices stay as `QuantTensor`s, their file's
    blocks kept once (`.dequantize()` gives the float32 param) for the quantized kernels."""
    path = resolve_model(name_or_path)
    with paused_gc():
        if path.is_dir():
            from powerinfer_jax.checkpoint.hf import load_hf

            return load_hf(path)
        from powerinfer_jax.checkpoint.gguf import load_gguf

        ckpt = load_gguf(path, keep_quantized=keep_quantized)
    _return_freed_memory()
    return ckpt


@contextlib.contextmanager
def paused_gc():
    """Python's cycle collector off while a model loads or builds. A load allocates ~100k
    vocabulary strings and merge pairs, a build thousands of module attributes: each allocation
    burst set off full collections over everything jax and flax had allocated, ~50 ms each and
    a third of SmolLM2's load time, that found no cycles to free. Reference counting still frees
    everything as usual; the collector's state is restored on exit (nesting is fine)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _return_freed_memory() -> None:
    """Give the C heap's freed pages back to the OS (glibc's malloc_trim). Reading a GGUF frees
    the reader's temporaries (metadata arrays, per-tensor views and float conversions) in small
    pieces that glibc keeps in its arenas: measured on the default Q4_1 model, resident memory
    after the load was 1.51x the file without this, 1.25x with it (benchmarks/quant_memory.py).
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
