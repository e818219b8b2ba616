"""The KV cache's arrays: their element type and the zeroed cache of a model.

Apart from the modules (no flax): the engine makes a cache for a model snapshot, which never
builds the model (runtime/snapshot.py). Axes: B batch, S positions, K kv heads, H head dim.
"""
from __future__ import annotations

import jax.numpy as jnp

from powerinfer_jax.config import ModelConfig


def cache_storage_dtype(dtype):
    """KV cache element type for a model dtype. bfloat16 is stored as its raw bits (uint16):
    XLA's CPU backend widens bf16 ops to f32, which turns the in-place cache update into a copy of
    the whole cache every step (measured 111 us vs 8 us for a 3 MB cache); bit patterns keep the
    update in place and the read widens exactly with an integer shift."""
    return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def init_cache(config: ModelConfig, *, batch: int, max_len: int, dtype, zeros=jnp.zeros):
    """A zeroed KV cache for a model of `dtype`: per layer (k, v), each [B, S, K, H], stored as
    `cache_storage_dtype(dtype)` (bfloat16 as raw uint16 bits).
    `zeros(shape, dtype)` makes each array (the engine's: numpy zeros put on the device)."""
    shape = (batch, max_len, config.n_kv_heads, config.head_dim)
    storage = cache_storage_dtype(dtype)
    return [(zeros(shape, storage), zeros(shape, storage)) for _ in range(config.n_layers)]
