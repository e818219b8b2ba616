"""Jitted prefill and decode over a fixed-size KV cache, and the generation loop.

Shapes are static: the cache holds `max_seq_len` slots, prefill pads the prompt to a power-of-two
bucket, decode always runs one token and attends to a power-of-two prefix of the cache that covers
the current position (so a short sequence does not read the whole cache every step). XLA compiles
once per prefill bucket and once per decode bucket, never per token (`Engine.compile_count`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.models.transformer import Transformer, init_cache
from powerinfer_jax.runtime.sampling import SamplingParams, sample

_MIN_BUCKET = 16
_MIN_KV_BUCKET = 128  # decode compiles at most log2(max_seq_len / 128) + 1 times


def prefill_bucket(n: int, max_len: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest power of two >= n (at least `minimum`), capped at the cache length."""
    return min(max(minimum, 1 << (n - 1).bit_length()), max_len)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (stop token included when one was hit)
    prompt_tokens: int
    prefill_s: float  # wall time of the first token (prefill + sampling), compile excluded
    decode_s: float  # wall time of the remaining tokens, compile excluded
    stop_reason: str  # "eos" | "length"
    compile_s: float = 0.0  # compilation done by this call before timing started

    @property
    def first_token_s(self) -> float:
        """What a user waits for the first token: compilation (when cold) plus prefill."""
        return self.compile_s + self.prefill_s

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class Engine:
    """Owns the jitted step functions of one model, sparsity setting and cache length."""

    def __init__(self, model: Transformer, *, max_seq_len: int,
                 sparsity: SparsityConfig = SparsityConfig(), thresholds: Sequence[float] | None = None):
        c = model.config
        if not 0 < max_seq_len <= c.max_seq_len:
            raise ValueError(f"max_seq_len: expected 1..{c.max_seq_len} (the model's context), "
                             f"got {max_seq_len}")
        self.config = c
        self.max_seq_len = max_seq_len
        self.cache_dtype = model.dtype
        self.sparsity = sparsity
        self.compile_count = 0
        self._executables: dict = {}
        graphdef, state = nnx.split(model)
        # The weights travel as a flat list of arrays: flattening the nnx.State pytree (332
        # Variables for SmolLM2) on every call cost more per decode step than the jit's own
        # argument handling (measured: ~0.4 ms of Python per step).
        self._state, treedef = jax.tree.flatten(state)
        thresholds = None if thresholds is None else tuple(float(t) for t in thresholds)

        def run(leaves, tokens_bt, positions_bt, cache, cache_index, kv_len):
            m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            return m, m.hidden(tokens_bt, positions_bt, cache, cache_index, kv_len,
                               sparsity=sparsity, thresholds=thresholds)

        def prefill(state, tokens_bt, n_valid, cache, key, params: SamplingParams):
            positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
            m, (h, cache, _) = run(state, tokens_bt, positions, cache, 0, tokens_bt.shape[1])
            last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=1)  # [B, 1, D]
            return sample(m.logits(last)[:, 0], jax.random.fold_in(key, 0), params), cache

        def decode(state, token_b, position, cache, key, params: SamplingParams, kv_len: int):
            positions = jnp.full((token_b.shape[0], 1), position, jnp.int32)
            m, (h, cache, _) = run(state, token_b[:, None], positions, cache, position, kv_len)
            return sample(m.logits(h)[:, 0], jax.random.fold_in(key, position), params), cache

        self._prefill = jax.jit(prefill, static_argnames="params", donate_argnames="cache")
        self._decode = jax.jit(decode, static_argnames=("params", "kv_len"),
                               donate_argnames="cache")

    def _executable(self, kind: str, shape_key: int, sampling: SamplingParams):
        """The compiled step for one shape bucket, compiled ahead of time on first need.

        Explicit executables make compilation visible: it happens before timing starts, is counted
        (`compile_count`), and a call with a new shape can never silently recompile.
        """
        k = (kind, shape_key, sampling)
        exe = self._executables.get(k)
        if exe is None:
            cache = jax.eval_shape(lambda: init_cache(self.config, batch=1,
                                                      max_len=self.max_seq_len,
                                                      dtype=self.cache_dtype))
            i32 = jax.ShapeDtypeStruct((), jnp.int32)
            key = jax.eval_shape(lambda: jax.random.key(0))
            if kind == "prefill":
                tokens = jax.ShapeDtypeStruct((1, shape_key), jnp.int32)
                exe = self._prefill.lower(self._state, tokens, i32, cache, key,
                                          params=sampling).compile()
            else:
                token = jax.ShapeDtypeStruct((1,), jnp.int32)
                exe = self._decode.lower(self._state, token, i32, cache, key, params=sampling,
                                         kv_len=shape_key).compile()
            self._executables[k] = exe
            self.compile_count += 1
        return exe

    def kv_bucket(self, position: int) -> int:
        return prefill_bucket(position + 1, self.max_seq_len, _MIN_KV_BUCKET)

    def check_prompt(self, n_prompt: int) -> None:
        if n_prompt == 0:
            raise ValueError("prompt: expected at least one token, got an empty prompt")
        if n_prompt >= self.max_seq_len:
            raise ValueError(f"prompt: expected fewer than {self.max_seq_len} tokens (the context "
                             f"length, --max-seq-len), got {n_prompt}; shorten the prompt")

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None
                 ) -> GenerationResult:
        """Generate up to max_new_tokens (fewer if the context fills up or a stop id is sampled)."""
        n = len(prompt_ids)
        self.check_prompt(n)
        bucket = prefill_bucket(n, self.max_seq_len)
        budget = min(max_new_tokens, self.max_seq_len - n)
        t_compile = time.perf_counter()
        prefill = self._executable("prefill", bucket, sampling)
        decoders = {b: self._executable("decode", b, sampling)
                    for b in sorted({self.kv_bucket(n + s - 1) for s in range(1, budget)})}
        compile_s = time.perf_counter() - t_compile
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = prompt_ids
        cache = init_cache(self.config, batch=1, max_len=self.max_seq_len, dtype=self.cache_dtype)
        key = jax.random.key(seed)
        out: list[int] = []
        stop = set(int(s) for s in stop_ids)
        reason = "length"

        def decode(step, tok, cache):
            pos = n + step - 1
            return decoders[self.kv_bucket(pos)](self._state, tok, np.int32(pos), cache, key)

        t0 = time.perf_counter()
        t_first = t0
        pending = prefill(self._state, tokens, np.int32(n), cache, key)
        for step in range(budget):
            tok, cache = pending
            pending = None
            if 0 < step < budget - 1:
                # Dispatch the next step before reading this one's token: the jitted call's
                # argument handling (~0.5 ms of Python and C++) then overlaps the running step
                # instead of adding to it. The token goes from step to step on the device; a step
                # dispatched past a stop token is discarded.
                pending = decode(step + 1, tok, cache)
            tid = int(np.asarray(tok)[0])  # host sync: streaming and stop checks need the value
            if step == 0:
                t_first = time.perf_counter()
                if budget > 1:
                    pending = decode(1, tok, cache)
            out.append(tid)
            if on_token is not None:
                on_token(tid)
            if tid in stop:
                reason = "eos"
                break
        t1 = time.perf_counter()
        if pending is not None:  # the discarded step: finish it here, not in the next call's timing
            jax.block_until_ready(pending)
        return GenerationResult(tokens=out, prompt_tokens=n, prefill_s=t_first - t0,
                                decode_s=t1 - t_first if out else 0.0, stop_reason=reason,
                                compile_s=compile_s)
