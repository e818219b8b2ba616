"""An expert store in Python: the handle of the C++ store (cpu_backend/expert_store.h) that one
offloaded mixture-of-experts model's layers read their routed experts from (ops._ffi.expert_ffn's
`store` attribute).

The store holds the pinned experts (read when it opens) and `cache_slots` cache slots, reads the
other experts from the expert file (runtime/expert_file.py) when a token routes to them or when
the read-ahead guesses it will, and counts what it does (`stats`). Closed when the object is
collected or `close()`d.
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from powerinfer_jax.errors import check_choice, fail

POLICIES = ("lru", "lfu", "frequency", "score")
# Reads in flight: each expert is read in pieces of READ_BYTES (an expert of the SYNTHETIC
# Qwen3-30B-A3B shape, Q4_0, is 2.6 MB: 3 pieces), so one expert alone keeps several reads in
# flight; readers blocked in preadv cost no CPU.
DEFAULT_READERS = 16
READ_BYTES = 1 << 20
# The "score" policy's decay (tokens): an expert's router mass counts half after ~11 tokens
SCORE_TAU = 16.0


@dataclasses.dataclass(frozen=True)
class ExpertStoreSettings:
    """How a store reads and evicts."""

    policy: str = "lru"
    readers: int = DEFAULT_READERS
    read_bytes: int = READ_BYTES
    score_tau: float = SCORE_TAU
    direct: bool = True  # O_DIRECT: reads bypass the page cache

    def __post_init__(self):
        check_choice("expert cache policy", self.policy, POLICIES)
        if not (isinstance(self.readers, int) and 1 <= self.readers <= 1024):
            fail("expert store readers", "an integer in [1, 1024]", self.readers)
        if not (isinstance(self.read_bytes, int) and self.read_bytes >= 512
                and self.read_bytes % 512 == 0):
            fail("expert store read_bytes", "a positive multiple of 512", self.read_bytes)
        if not (isinstance(self.score_tau, (int, float)) and np.isfinite(self.score_tau)
                and self.score_tau > 0):
            fail("expert store score_tau", "a finite number of tokens > 0", self.score_tau)


class ExpertStore:
    """An open store over expert file `path` with header `spec` (runtime/expert_file.py).

    pinned: bool [L, E], the experts read now and never evicted; cache_slots: the cache (at
    least the most unpinned experts of a layer); prior: [L, E] routing frequencies (the
    "frequency" policy)."""

    def __init__(self, path, spec, pinned, cache_slots: int, *, prior=None,
                 settings: ExpertStoreSettings = ExpertStoreSettings()):
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        L, E = spec.n_layers, spec.n_experts
        pinned = np.asarray(pinned, bool).reshape(L, E)
        self.spec = spec
        self.settings = settings
        self.cache_slots = int(cache_slots)
        self.pinned_experts = int(pinned.sum())
        p = None if prior is None else np.ascontiguousarray(
            np.asarray(prior, np.float32).reshape(-1))
        self.handle = int(_ffi._pij_ext.expert_store_open(
            str(path), L, E, spec.slot_bytes, spec.data_offset, spec.gate_offset,
            spec.up_offset, spec.down_offset, np.ascontiguousarray(pinned.ravel(), np.uint8), p,
            self.cache_slots, settings.policy, float(settings.score_tau), settings.readers,
            settings.read_bytes, settings.direct))
        self._finalizer = weakref.finalize(self, _ffi._pij_ext.expert_store_release, self.handle)

    def stats(self) -> dict:
        """The C++ counters (requests, hits, misses, bytes read, waits) since open or reset."""
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        return dict(_ffi._pij_ext.expert_store_stats(self.handle))

    def reset_stats(self) -> None:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        _ffi._pij_ext.expert_store_reset_stats(self.handle)

    def close(self) -> None:
        self._finalizer()


def simulate_cache(calls, *, n_layers: int, n_experts: int, slots: int, policy: str,
                   pinned=None, prior=None, probs=None, score_tau: float = SCORE_TAU) -> dict:
    """Replay calls (each (layer, expert ids)) through the store's cache alone, beside the
    `pinned` [L, E] experts: {hits, pinned_hits, misses, evictions, uncached}. probs: [calls, E]
    each call's router probabilities (the "score" policy's credit). The eviction policies'
    experiment."""
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    check_choice("expert cache policy", policy, POLICIES)
    keys = [layer * n_experts + np.asarray(ids, np.int64).ravel() for layer, ids in calls]
    flat = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    ends = np.cumsum([k.size for k in keys]).astype(np.int64)
    pin = np.zeros(n_layers * n_experts, np.uint8) if pinned is None else \
        np.ascontiguousarray(np.asarray(pinned, np.uint8).ravel())
    p = None if prior is None else np.ascontiguousarray(np.asarray(prior, np.float32).ravel())
    pr = None if probs is None else np.ascontiguousarray(np.asarray(probs, np.float32).ravel())
    return dict(_ffi._pij_ext.expert_cache_simulate(n_layers, n_experts, int(slots), policy, pin,
                                                    p, pr, float(score_tau), flat, ends))
