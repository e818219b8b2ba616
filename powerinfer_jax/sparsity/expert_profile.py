"""Expert-level profiling of a mixture-of-experts model (issue 35 item 3, its first half): how
often each layer's router picks each expert over a text, the power law across experts that a
placement of hot experts would read. The router is an exact predictor at expert granularity, so
the counts are those of the model's own routing (models/moe.py sows each call's expert ids under
models.transformer.capture); nothing is estimated.
"""
from __future__ import annotations

from typing import Iterable

import jax.numpy as jnp
import numpy as np

from powerinfer_jax.errors import fail
from powerinfer_jax.models.transformer import capture


def expert_counts(model, token_chunks: Iterable) -> np.ndarray:
    """int64 [L, E]: per layer, how many of the chunks' tokens were routed to each expert (a
    token counts once for each of its k experts, so each row sums to k * tokens). Each chunk is
    int [B, T] token ids run from position 0."""
    c = model.config
    if not c.n_experts:
        fail("expert_counts model", "a mixture-of-experts model (config.n_experts > 0)",
             f"a dense {c.arch} model")
    counts = np.zeros((c.n_layers, c.n_experts), np.int64)
    for chunk in token_chunks:
        _, sown = capture(lambda m, t: m(t), model, jnp.asarray(chunk))
        ids = np.asarray(sown["expert_ids"]).reshape(c.n_layers, -1)  # [L, B * T * k]
        for layer in range(c.n_layers):
            counts[layer] += np.bincount(ids[layer], minlength=c.n_experts)
    return counts


def expert_frequency(model, token_chunks: Iterable) -> np.ndarray:
    """float64 [L, E]: the share of tokens routed to each expert (rows sum to k)."""
    counts = expert_counts(model, token_chunks)
    tokens = counts.sum(axis=1, keepdims=True) / model.config.n_experts_used
    return counts / np.maximum(tokens, 1)
