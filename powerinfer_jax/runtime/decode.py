"""Jitted prefill and batched decode over a fixed-size KV cache (the Engine); the generation
loop's requests and scheduler are in runtime/scheduler.py, compiled steps kept across processes
in runtime/executables.py.

The engine owns a KV cache of `max_batch` slots (rows) x `max_seq_len` positions. Each sequence
gets a slot: its prompt is prefilled into that row alone (padded to a power-of-two bucket), then
every decode step advances all live slots at once, each at its own position, with its own sampling
parameters and seed (continuous batching: sequences join and leave between steps). Shapes are
static: a decode step runs the first `b` slots, b a power-of-two bucket covering the live ones,
and attends to a power-of-two prefix of the cache covering the furthest position, so XLA compiles
once per (prefill bucket), (batch bucket, cache bucket) and sampling kind, never per step
(`Engine.compile_count`).

A decode call runs a block of `decode_block` steps in one executable (each step's tokens feed the
next on the device): the call's own cost on the host thread, about 0.9 ms for SmolLM2 (its ~340
argument arrays and XLA's launch, measured with perf) whatever the step computes, is paid once per
block, not per token, and on a 2-core machine that thread takes a core from the kernels less
often. Every step keeps its own position and PRNG key, so a block gives the tokens single steps
give. Tokens a block
computes past a sequence's end (a stop token or string, or max_new_tokens reached mid-block) are
discarded; near the end of the cache, where a block's positions would pass it, steps run one at a
time. The Scheduler's `block` chooses (Engine.run and the API's stream: decode_block; the server:
1, so that a new request joins after one step, not a block).

While the host reads block k's tokens, block k+1 is already dispatched on the device with k's last
tokens (they never leave the device for that): the jitted call's argument handling overlaps the
running block. A block dispatched past a sequence's end is discarded for that sequence.
"""
from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.config import MAX_SEED, RuntimeConfig, SamplingParams, check_decode_block
from powerinfer_jax.errors import check, fail
from powerinfer_jax.models.kv_cache import init_cache
from powerinfer_jax.runtime import executables
from powerinfer_jax.runtime import sampling as smp
# Requests and the scheduler are runtime/scheduler.py's; importers of this module (the server, the
# API, experiments) find them here too
from powerinfer_jax.runtime.scheduler import (GenerationResult, Request,  # noqa: F401
                                              Scheduler)

# The smallest prefill bucket. A short prompt pays for the whole bucket: a 2-token prompt on the
# synthetic Llama-2-7B Q4_0 (2 threads, AMX Xeon) took 0.51 s to its first token at a minimum of
# 16, 0.21 s at 4, 0.18 s at 2 (3 runs each); 4 keeps that gain for two more compiled shapes.
_MIN_BUCKET = 4
_MIN_KV_BUCKET = 128  # decode compiles at most log2(max_seq_len / 128) + 1 cache buckets
# Decode steps per executable call (Engine.run; RuntimeConfig.decode_block). 4 and 8 decoded
# SmolLM2 alike (+5-6% tok/s over single steps at 1 and 2 threads, Cascade Lake, a scratch loop
# of the jitted steps); 4 wastes fewer steps past a stop token.
DECODE_BLOCK = RuntimeConfig.decode_block


def _renamed(fn, name: str):
    """`fn` under another name (jit names its module, and jax keys its caches, after it)."""
    @functools.wraps(fn)
    def renamed(*args, **kwargs):
        return fn(*args, **kwargs)

    renamed.__name__ = renamed.__qualname__ = name
    return renamed


def describe_step(key: tuple) -> str:
    """('decode', 2, 256, 'sample', 4) -> 'the decode step (2 sequences, cache 256, sample, 4
    steps a call)'."""
    if key[0] == "prefill":
        return f"the prefill step ({key[1]} tokens, {key[2]})"
    _, b, kv_len, kind, steps = key
    return (f"the decode step ({b} sequence{'s' if b > 1 else ''}, cache {kv_len}, {kind}"
            f"{f', {steps} steps a call' if steps > 1 else ''})")


def prefill_bucket(n: int, max_len: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest power of two >= n (at least `minimum`), capped at the cache length."""
    return min(max(minimum, 1 << (n - 1).bit_length()), max_len)


class Engine:
    """The jitted steps of one built model over a cache of `max_batch` slots.

    `model`: a models.transformer.Transformer, or a model snapshot (runtime/snapshot.py: its
    weights as the flat list the steps take, its digest, and `thaw()`, which builds the model).
    A snapshot's steps come from the store; the model is built only if one must be compiled."""

    def __init__(self, model, *, max_seq_len: int, max_batch: int = 1,
                 decode_block: int = DECODE_BLOCK, store=None, progress: bool = False):
        c = model.config
        check(isinstance(max_seq_len, int) and 0 < max_seq_len <= c.max_seq_len, "max_seq_len",
              f"1..{c.max_seq_len} (the model's context)", max_seq_len)
        check(isinstance(max_batch, int) and 0 < max_batch <= 256, "max_batch",
              "an integer in [1, 256]", max_batch)
        check_decode_block("decode_block", decode_block)
        self.config = c
        self.decode_block = decode_block
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.cache_dtype = model.dtype
        self._cache_sharding = model.cache_sharding()  # None unless sharded (runtime/mesh.py)
        self.compile_count = 0  # steps compiled by this engine
        self.loaded_count = 0  # steps loaded compiled from the store (runtime/executables.py)
        self.compile_s = 0.0  # time spent getting steps ready: compiling or loading them
        # one executable per shape for every batch (sampling kind "any": runtime/sampling.py)
        # instead of a greedy and a sampled one: the server's choice (half the steps to warm)
        self.one_kind = False
        self._executables: dict = {}
        # A step may be readied by two threads at once (the server warms steps in the background
        # while its engine thread runs): the second waits for the first's compile.
        self._lock = threading.Lock()
        self._readying: dict = {}  # key -> threading.Event set when its step is ready (or not)
        self._cache = None
        # Compiled steps kept across processes (a Store of runtime/executables.py, or None):
        # loaded when this model's structure is the one they were compiled for.
        self.store = store
        self.progress = progress  # a line on stderr before each compile (seconds each)
        self._snapshot = model if hasattr(model, "thaw") else None
        self._steps = None  # the jitted steps, made from the model when first compiled
        if self._snapshot is None:
            self._bind(model)
        else:
            self._state = list(model.leaves)
            self._set_structure(model.digest)

    def _set_structure(self, model_digest: str | None) -> None:
        """What the store's steps must have been compiled for (None: no store)."""
        self._structure = None if model_digest is None else executables.structure_digest(
            model_digest, (self.max_seq_len, self.max_batch, str(self.cache_dtype)))

    def _bind(self, model) -> None:
        """Take the weights and the jitted steps from a built model."""
        from flax import nnx  # lazy: start-up (a snapshot's steps need no model)

        graphdef, state = nnx.split(model)
        # The weights travel as a flat list of arrays: flattening the nnx.State pytree (332
        # Variables for SmolLM2) on every call cost more per decode step than the jit's own
        # argument handling (measured: ~0.4 ms of Python per step).
        self._state, treedef = jax.tree.flatten(state)
        self._set_structure(None if self.store is None else
                            executables.model_digest(graphdef, self._state))

        def merged(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, tokens_1t, n_valid, slot, cache, seed, temp, top_k, top_p, *, kind):
            m = merged(leaves)
            t = tokens_1t.shape[1]
            row = [tuple(jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0) for a in kv)
                   for kv in cache]
            h, row = m.hidden(tokens_1t, jnp.arange(t)[None], row, 0, t)
            cache = [tuple(jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=0)
                           for a, r in zip(kv, rkv)) for kv, rkv in zip(cache, row)]
            last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=1)  # [1, 1, D]
            keys = smp.row_keys(seed[None], jnp.zeros((1,), jnp.int32))
            tok = smp.sample_rows(m.logits(last)[:, 0], keys, temp[None], top_k[None],
                                  top_p[None], kind)
            return tok[0], cache

        def decode(leaves, tokens_b, positions_b, cache, seeds_b, temp_b, top_k_b, top_p_b, *,
                   kv_len, kind, steps):
            m = merged(leaves)

            def step(i, toks, cache):
                pos = positions_b + i
                h, cache = m.hidden(toks[:, None], pos[:, None], cache, pos, kv_len)
                return smp.sample_rows(m.logits(h)[:, 0], smp.row_keys(seeds_b, pos), temp_b,
                                       top_k_b, top_p_b, kind), cache

            if steps == 1 or m.tok_embed[...].dtype in (jnp.bfloat16, jnp.float16):
                # Unrolled: XLA's CPU backend gathers from a 16-bit float table in f32 (a
                # convert of the table fused with the slice); in a loop it hoisted that convert
                # out of the body and wrote SmolLM2's whole bf16 table out as 113 MB of f32 on
                # every call (decode 58 -> 39 tok/s). Unrolling costs compile time (SmolLM2:
                # 1.3 s -> 5.2 s for 4 steps), so quantized and f32 tables take the loop.
                out = []
                for i in range(steps):
                    tokens_b, cache = step(i, tokens_b, cache)
                    out.append(tokens_b)
                return jnp.stack(out), tokens_b, cache

            def body(i, carry):
                toks, cache, out = carry
                toks, cache = step(i, toks, cache)
                return toks, cache, out.at[i].set(toks)

            out = jnp.zeros((steps,) + tokens_b.shape, jnp.int32)
            last, cache, out = jax.lax.fori_loop(0, steps, body, (tokens_b, cache, out))
            return out, last, cache

        self._steps = {"prefill": (prefill, dict(static_argnames="kind", donate_argnames="cache")),
                       "decode": (decode, dict(static_argnames=("kv_len", "kind", "steps"),
                                               donate_argnames="cache"))}
        self._prefill = jax.jit(prefill, **self._steps["prefill"][1])
        self._decode = jax.jit(decode, **self._steps["decode"][1])

    def _thaw(self) -> None:
        """A snapshot's engine about to compile: build the model and take its weights and steps.
        Steps loaded for the snapshot's digest stay only if the built model has the same one."""
        before = self._structure
        self._bind(self._snapshot.thaw())
        self._snapshot = None
        if self._structure != before:
            self._executables.clear()

    # ------------------------------------------------------------------ compilation
    def _abstract_cache(self):
        abstract = jax.eval_shape(lambda: init_cache(self.config, batch=self.max_batch,
                                                     max_len=self.max_seq_len,
                                                     dtype=self.cache_dtype))
        if self._cache_sharding is None:
            return abstract
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=self._cache_sharding),
                            abstract)

    def _executable(self, key: tuple):
        """The compiled step for one shape bucket: loaded from the store, else compiled ahead of
        time on first need (and stored).

        Explicit executables make compilation visible: it happens outside the timed region, is
        counted (`compile_count`, `loaded_count`, `compile_s`), and a new shape can never silently
        recompile."""
        while True:
            with self._lock:
                exe = self._executables.get(key)
                if exe is not None:
                    return exe
                busy = self._readying.get(key)
                if busy is None:
                    self._readying[key] = threading.Event()
                    break
            busy.wait()  # another thread compiles or loads it; if that failed, try here
        try:
            return self._make_executable(key)
        finally:
            with self._lock:
                self._readying.pop(key).set()

    def stored(self, key: tuple) -> bool:
        """Whether the step of `key` is ready or can be loaded from the store (not compiled)."""
        return self.is_ready(key) or (self.store is not None
                                      and self.store.has((*key, self.max_seq_len)))

    def make_compilable(self) -> None:
        """Build the model now if this engine runs a snapshot's weights (a step to compile needs
        it): the server does it before its engine thread runs while other steps still compile,
        so that the weights never change under a running step."""
        with self._lock:
            if self._snapshot is not None:
                self._thaw()

    def _make_executable(self, key: tuple):
        """_executable's work, in the one thread readying `key`."""
        t0 = time.perf_counter()
        stored = (*key, self.max_seq_len)  # one identity's engines may size their caches apart
        exe = None if self.store is None else self.store.take(stored, self._structure)
        if exe is None:
            self.make_compilable()
            if self.progress:
                print(f"powerinfer_jax: compiling {describe_step(key)} (once for this model, "
                      "mode and shape; later runs load it compiled)", file=sys.stderr, flush=True)
            if self.store is None:
                exe = self._compile(key)
            else:  # compiled, never found in jax's caches: only such a step serializes whole
                with executables.compiling_for_store():
                    exe = self._compile(key, executables.fresh_name(key[0]))
                self.store.save(stored, exe, self._structure)
            with self._lock:
                self.compile_count += 1
        else:
            with self._lock:
                self.loaded_count += 1
        with self._lock:
            self._executables[key] = exe
            self.compile_s += time.perf_counter() - t0
        return exe

    def _jit(self, step: str, name: str | None = None):
        """The engine's jitted `step`, or a new jit of it under `name`."""
        if name is None:
            return self._prefill if step == "prefill" else self._decode
        fn, options = self._steps[step]
        return jax.jit(_renamed(fn, name), **options)

    def _compile(self, key: tuple, name: str | None = None):
        """Lower and compile one step; under `name` (a fresh jit of the same function) when
        given, else through the engine's jitted functions."""
        i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32

        def arr(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype)

        cache = self._abstract_cache()
        if key[0] == "prefill":
            _, t, kind = key
            lowered = self._jit("prefill", name).lower(
                self._state, arr((1, t), i32), arr((), i32), arr((), i32), cache, arr((), u32),
                arr((), f32), arr((), i32), arr((), f32), kind=kind)
        else:
            _, b, kv_len, kind, steps = key
            lowered = self._jit("decode", name).lower(
                self._state, arr((b,), i32), arr((b,), i32), cache, arr((b,), u32),
                arr((b,), f32), arr((b,), i32), arr((b,), f32), kv_len=kv_len, kind=kind,
                steps=steps)
        return lowered.compile()

    def prepare(self, key: tuple) -> None:
        """Have the step of `key` ready (loaded or compiled) before a request needs it: a
        ("prefill", bucket, kind) or ("decode", batch bucket, cache bucket, kind, steps) key."""
        self._executable(key)

    def is_ready(self, key: tuple) -> bool:
        return key in self._executables

    def kind_of(self, params) -> str:
        """The sampling kind a step for these SamplingParams is compiled for."""
        return "any" if self.one_kind else smp.sampling_kind(params)

    @property
    def ready_steps(self) -> int:
        """Steps compiled or loaded so far."""
        return len(self._executables)

    def buckets(self) -> dict[str, list[int]]:
        """Every shape bucket this engine can meet: prompt lengths, cache lengths, batch sizes."""
        n = self.max_seq_len
        return {"prefill": sorted({prefill_bucket(t, n) for t in range(1, n)}),
                "kv": sorted({self.kv_bucket(p) for p in range(n)}),
                "batch": sorted({self.batch_bucket(b) for b in range(1, self.max_batch + 1)})}

    def kv_bucket(self, position: int) -> int:
        return prefill_bucket(position + 1, self.max_seq_len, _MIN_KV_BUCKET)

    def block_at(self, position: int, block: int) -> int:
        """Steps of the next decode call from `position` (the furthest live one): `block`, or 1
        where the block's positions would pass the cache's end."""
        return block if position + block <= self.max_seq_len else 1

    def batch_bucket(self, live_slots: int) -> int:
        return min(1 << max(live_slots - 1, 0).bit_length(), self.max_batch)

    # ------------------------------------------------------------------ validation
    def check_prompt(self, n_prompt: int, max_new_tokens: int = 0) -> None:
        if n_prompt == 0:
            fail("prompt", "at least one token", "an empty prompt")
        if n_prompt >= self.max_seq_len:
            fail("prompt", f"fewer than {self.max_seq_len} tokens (the context length, "
                 "max_seq_len)", n_prompt, "shorten the prompt")
        if n_prompt + max(max_new_tokens, 1) > self.max_seq_len:
            fail("prompt", f"prompt tokens + new tokens <= {self.max_seq_len} (the context "
                 "length, max_seq_len)", f"{n_prompt} + {max_new_tokens}",
                 "shorten the prompt, ask for fewer new tokens or raise max_seq_len")

    def _check_request(self, r: Request) -> None:
        check(isinstance(r.max_new_tokens, int) and r.max_new_tokens >= 1, "max_new_tokens",
              "an integer >= 1", r.max_new_tokens)
        check(isinstance(r.seed, (int, np.integer)) and 0 <= int(r.seed) <= MAX_SEED, "seed",
              f"an integer in [0, {MAX_SEED}]", r.seed)
        v = self.config.vocab_size
        ids = np.asarray(r.prompt_ids)
        if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)
                         or ids.min() < 0 or ids.max() >= v):
            fail("prompt token ids", f"integers in [0, {v})", f"{ids.dtype} ids in "
                 f"[{ids.min()}, {ids.max()}]" if ids.ndim == 1 else ids.shape)
        self.check_prompt(len(r.prompt_ids), r.max_new_tokens)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None
                 ) -> GenerationResult:
        """Generate up to max_new_tokens for one prompt (fewer if a stop id is sampled)."""
        def tokens_cb(t):
            if on_token is not None:
                on_token(t)
        return self.run([Request(prompt_ids, max_new_tokens, sampling, seed, stop_ids,
                                 tokens_cb)])[0]

    def run(self, requests: Sequence[Request]) -> list[GenerationResult]:
        """Generate every request, up to max_batch at a time sharing decode steps; a request
        takes the first free slot as soon as one frees up. Results in request order."""
        requests = list(requests)
        for r in requests:
            self._check_request(r)
        results: list[GenerationResult | None] = [None] * len(requests)
        scheduler = Scheduler(self, block=self.decode_block)
        queue = list(enumerate(requests))
        self._warm(requests)
        while queue or scheduler.live:
            while queue and scheduler.free_slots():
                i, r = queue.pop(0)
                scheduler.add(r, tag=i)
            for tag, res in scheduler.step():
                results[tag] = res
        return results  # type: ignore[return-value]

    def _warm(self, requests: Sequence[Request]) -> None:
        """Compile what a single request will need before its timing starts (a batch compiles
        its buckets as they come: which ones depends on how sequences overlap). A step the store
        is still loading in the background is left to it: the prefill runs meanwhile, and the
        first call that needs the step waits for it (the Scheduler keeps that wait out of the
        decode time)."""
        if len(requests) != 1:
            return
        r = requests[0]
        n = len(r.prompt_ids)
        kind = self.kind_of([r.sampling])
        self._executable(("prefill", prefill_bucket(n, self.max_seq_len), kind))
        position, made = n, 1  # the Scheduler's calls when no stop token comes first
        while made < r.max_new_tokens:
            steps = self.block_at(position, self.decode_block)
            key = ("decode", 1, self.kv_bucket(position + steps - 1), kind, steps)
            if not self._loading(key):
                self._executable(key)
            position += steps
            made += steps

    def _loading(self, key: tuple) -> bool:
        """Whether the store is loading the step of `key` in the background right now."""
        return (self.store is not None and key not in self._executables
                and self.store.is_loading((*key, self.max_seq_len)))

    # ------------------------------------------------------------------ low-level steps
    def cache(self):
        """The engine's KV cache (made on first use; every step donates and replaces it)."""
        if self._cache is None:
            if self._cache_sharding is not None:
                self._cache = jax.device_put(
                    init_cache(self.config, batch=self.max_batch, max_len=self.max_seq_len,
                               dtype=self.cache_dtype), self._cache_sharding)
            else:  # zeros from numpy: jnp.zeros compiled a fill first (60 ms of a CLI's 1st
                # token), and no shapes traced first (jax.eval_shape: 5-9 ms on the main thread)
                self._cache = init_cache(
                    self.config, batch=self.max_batch, max_len=self.max_seq_len,
                    dtype=self.cache_dtype, zeros=lambda s, d: jax.device_put(np.zeros(s, d)))
        return self._cache

    def reset_cache(self) -> None:
        """Drop the KV cache (made afresh on next use). After a failed step, which may have
        consumed the donated cache, every slot starts over (the server's recovery path)."""
        self._cache = None

    def prefill_slot(self, slot: int, r: Request):
        """Prefill `r`'s prompt into cache row `slot`; returns its first token (a device scalar)."""
        n = len(r.prompt_ids)
        bucket = prefill_bucket(n, self.max_seq_len)
        kind = self.kind_of([r.sampling])
        exe = self._executable(("prefill", bucket, kind))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = r.prompt_ids
        temp, top_k, top_p = (a[0] for a in smp.rows([r.sampling]))
        tok, self._cache = exe(self._state, tokens, np.int32(n), np.int32(slot), self.cache(),
                               np.uint32(r.seed), temp, top_k, top_p)
        return tok

    def decode_step(self, tokens_b, positions_b: np.ndarray, seeds_b: np.ndarray, params,
                    steps: int = 1):
        """`steps` decode steps over slots [0, b): tokens_b [b] (device or host), positions [b]
        (of each slot's first step); returns the next tokens [steps, b] and their last row [b]
        (both on the device). The last row is the step's own output, so a call dispatched on it
        before the host reads the tokens indexes nothing eagerly: `toks[-1]` was a dynamic_slice
        and a squeeze, each traced, lowered and looked up in jax's cache on the main thread
        (~50-60 ms of a short CLI run, most of it the first lowering's imports)."""
        b = positions_b.shape[0]
        kind = self.kind_of(params)
        kv_len = self.kv_bucket(int(positions_b.max()) + steps - 1)
        exe = self._executable(("decode", b, kv_len, kind, steps))
        temp, top_k, top_p = smp.rows(params)
        toks, last, self._cache = exe(self._state, tokens_b, positions_b.astype(np.int32),
                                      self.cache(), seeds_b.astype(np.uint32), temp, top_k, top_p)
        return toks, last
