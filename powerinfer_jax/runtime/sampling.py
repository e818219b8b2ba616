"""Token sampling inside the jitted step, so only the chosen ids cross to the host.

Every sequence of a batch has its own parameters (`SamplingParams`, passed as per-row arrays) and
its own PRNG key: key(seed) folded with the token's position, so a sequence draws the same tokens
whatever else shares its batch. Static kinds keep greedy batches free of the sort that top-k /
top-p need: "greedy" (argmax only) and "sample" (rows with temperature 0 still take the argmax);
"any" decides at run time (a branch XLA takes or skips): the sample path where a row samples,
the argmax alone where none does, the tokens of the other two kinds either way. The server
compiles "any" only: one step per shape instead of two (half its warm-up).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.config import SamplingParams  # noqa: F401  (re-exported)


def sampling_kind(params) -> str:
    """"greedy" when every sequence is greedy, else "sample" (the static variant to compile)."""
    return "greedy" if all(p.greedy for p in params) else "sample"


def rows(params) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row (temperature f32, top_k i32, top_p f32) arrays for a batch's SamplingParams."""
    return (np.asarray([p.temperature for p in params], np.float32),
            np.asarray([p.top_k for p in params], np.int32),
            np.asarray([p.top_p for p in params], np.float32))


def sample(logits_bv, key, params: SamplingParams):
    """One token per row of logits [B, V] -> [B] int32, every row with the same parameters
    (rows draw from keys split off `key`)."""
    b = logits_bv.shape[0]
    temp, top_k, top_p = (jnp.asarray(a) for a in rows([params] * b))
    return sample_rows(logits_bv, jax.random.split(key, b), temp, top_k, top_p,
                       sampling_kind([params]))


def row_keys(seeds_b, positions_b):
    """Per-row PRNG keys: key(seed) folded with the token's position."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds_b, positions_b)


def sample_rows(logits_bv, keys_b, temperature_b, top_k_b, top_p_b, kind: str):
    """One token per row of logits [B, V] -> [B] int32, with per-row keys and parameters."""
    best = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    if kind == "greedy":
        return best
    if kind == "any":
        return jax.lax.cond(jnp.any(temperature_b > 0),
                            lambda: _sampled(logits_bv, keys_b, temperature_b, top_k_b, top_p_b,
                                             best), lambda: best)
    return _sampled(logits_bv, keys_b, temperature_b, top_k_b, top_p_b, best)


def _sampled(logits_bv, keys_b, temperature_b, top_k_b, top_p_b, best):
    """The "sample" kind's tokens: drawn where a row's temperature is above 0, else `best`."""
    v = logits_bv.shape[-1]
    t = jnp.where(temperature_b > 0, temperature_b, 1.0)
    logits = logits_bv.astype(jnp.float32) / t[:, None]
    srt = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    idx = jnp.arange(v)[None, :]
    k = jnp.where((top_k_b > 0) & (top_k_b < v), top_k_b, v)[:, None]
    srt = jnp.where(idx < k, srt, -jnp.inf)  # top-k
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p (always at least the best token): the cut
    # is the smallest kept logit.
    kept = (before < top_p_b[:, None]) | (idx == 0)
    cut = jnp.min(jnp.where(kept, srt, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cut, logits, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys_b, logits).astype(jnp.int32)
    return jnp.where(temperature_b > 0, drawn, best)
