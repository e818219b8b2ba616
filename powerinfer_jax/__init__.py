"""powerinfer_jax: fast LLM inference in JAX/XLA exploiting FFN activation sparsity.

`load` a model and call it (api.py); `build` is the lower-level constructor every entry point
shares (runtime/session.py); configs are frozen dataclasses (config.py).
"""
from powerinfer_jax import _interrupt

# Before anything imports jax: Ctrl-C must interrupt even when it lands in jax's gc callback,
# where Python would swallow it (see _interrupt.py). Leaves an application's own handler alone.
_interrupt.install()

from powerinfer_jax.api import LLM, Completion, load  # noqa: E402
from powerinfer_jax.config import (ModelConfig, PlacementConfig, RuntimeConfig,  # noqa: E402
                                   SamplingParams, SparsityConfig)
from powerinfer_jax.errors import UserError  # noqa: E402
from powerinfer_jax.runtime.session import Session, build  # noqa: E402

__all__ = ["LLM", "Completion", "ModelConfig", "PlacementConfig", "RuntimeConfig",
           "SamplingParams", "Session", "SparsityConfig", "UserError", "build", "load"]
