"""This machine's side of a build (runtime/session.py): the kernels' thread pool, XLA's
persistent compilation cache, the accelerator if there is one, and moving a model onto it."""
from __future__ import annotations

import contextlib

from powerinfer_jax.config import check_threads


def use_compilation_cache() -> None:
    """Keep XLA's compiled executables in `<cache>/xla` (jax's persistent compilation cache):
    a later run of the same model, mode and shapes skips XLA's compile, ~0.9 s of the 2 s to
    the first token of SmolLM2 on CPU (tracing still runs). A bad entry is jax's to handle: it
    warns and compiles. Off with POWERINFER_JAX_XLA_CACHE=0; a directory the user set through
    jax's own config is left as it is."""
    import os

    import jax

    from powerinfer_jax.cache import cache_dir  # lazy: start-up

    if os.environ.get("POWERINFER_JAX_XLA_CACHE", "1") == "0" or \
            jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir() / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only cache: run without it
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


def size_thread_pool(threads: int | None) -> int:
    """The kernels' pool gets `threads` (default: the CPUs this process may use) in every mode:
    dense decode runs through the custom calls too."""
    import os

    n = len(os.sched_getaffinity(0)) if threads is None else check_threads(threads)
    try:
        from powerinfer_jax import ops  # lazy: start-up

        ops.set_num_threads(n)
    except ImportError:  # an unbuilt checkout runs the jnp references only
        pass
    return n


def accelerator():
    """The first non-CPU device, or None on a CPU-only machine."""
    import jax

    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else dev


def on_host(accel):
    import jax

    return contextlib.nullcontext() if accel is None else jax.default_device(jax.devices("cpu")[0])


def to_accelerator(m, device) -> None:
    """Move every array still in the model (dense parts, hot rows, predictors) to the device; the
    cold rows already live in the host store and are not in the model's state."""
    import jax
    from flax import nnx

    nnx.update(m, jax.device_put(nnx.state(m), device))
