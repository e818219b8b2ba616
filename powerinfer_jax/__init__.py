"""powerinfer_jax: fast LLM inference in JAX/XLA exploiting FFN activation sparsity.

`load` a model and call it (api.py); `build` is the lower-level constructor every entry point
shares (runtime/session.py); configs are frozen dataclasses (config.py).
"""
from powerinfer_jax.api import LLM, Completion, load
from powerinfer_jax.config import (ModelConfig, PlacementConfig, RuntimeConfig, SamplingParams,
                                   SparsityConfig)
from powerinfer_jax.errors import UserError
from powerinfer_jax.runtime.session import Session, build

__all__ = ["LLM", "Completion", "ModelConfig", "PlacementConfig", "RuntimeConfig",
           "SamplingParams", "Session", "SparsityConfig", "UserError", "build", "load"]
