"""Token sampling: greedy, temperature, top-k, top-p; runs inside the jitted decode step so only
the chosen token id crosses to the host."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits_bv, key, params: SamplingParams):
    """Pick one token per row of logits [B, V] -> [B] int32."""
    if params.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv.astype(jnp.float32) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
        before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(before < params.top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
