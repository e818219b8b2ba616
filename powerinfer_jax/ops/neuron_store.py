"""A neuron store in Python: the handle of the C++ store (cpu_backend/neuron_store.h) that one
offloaded model's FFN layers read their rows from (ops._ffi.disk_ffn's `store` attribute).

The store holds the static neurons (read when it opens) and `cache_slots` dynamic slots, reads
the other neurons from the bundle file (checkpoint/bundles.py) on demand, and counts what it does
(`stats`). Closed when the object is collected or `close()`d.
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from powerinfer_jax.errors import check_choice, fail

POLICIES = ("lru", "lfu", "frequency")
# Reads in flight: a virtio disk measured here served ~7k reads/s of 7 KiB at one in flight and
# ~50k at 32-64 (benchmarks/offload.py's probe); readers blocked in preadv cost no CPU.
DEFAULT_READERS = 32
MAX_READ_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """How a store reads and evicts (all measured in benchmarks/offload.py)."""

    policy: str = "frequency"
    readers: int = DEFAULT_READERS
    max_gap: int = 0  # unrequested bundles one read may span between two requested ones
    max_read_bytes: int = MAX_READ_BYTES
    direct: bool = True  # O_DIRECT: reads bypass the page cache

    def __post_init__(self):
        check_choice("neuron cache policy", self.policy, POLICIES)
        if not (isinstance(self.readers, int) and 1 <= self.readers <= 1024):
            fail("neuron store readers", "an integer in [1, 1024]", self.readers)
        if not (isinstance(self.max_gap, int) and self.max_gap >= 0):
            fail("neuron store max_gap", "an integer >= 0", self.max_gap)


class NeuronStore:
    """An open store over bundle file `path` with header `spec` and order table `order` [L, F].

    hot: bool [L, F], the static neurons (by neuron id); cache_slots: dynamic slots (at least
    the most non-static neurons of a layer); prior: [L, F] activation frequencies (the
    "frequency" policy); b_up: [L, F] up biases or None."""

    def __init__(self, path, spec, order, hot, cache_slots: int, *, prior=None, b_up=None,
                 settings: StoreSettings = StoreSettings()):
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        L, F = spec.n_layers, spec.n_neurons
        order = np.asarray(order, np.int32).reshape(L, F)
        position = np.empty((L, F), np.int32)
        rows = np.arange(L)[:, None]
        position[rows, order] = np.arange(F, dtype=np.int32)[None, :]
        hot = np.asarray(hot, bool).reshape(L, F)

        def flat(a):
            return None if a is None else np.ascontiguousarray(np.asarray(a, np.float32).ravel())

        self.spec = spec
        self.settings = settings
        self.cache_slots = int(cache_slots)
        self.static_neurons = int(hot.sum())
        self.handle = int(_ffi._pij_ext.neuron_store_open(
            str(path), L, F, spec.dim, spec.gated,
            quants.type_id(spec.gate_qtype) if spec.gated else 0, quants.type_id(spec.up_qtype),
            quants.type_id(spec.down_qtype), spec.slot_bytes, spec.data_offset,
            spec.down_source == "groups", spec.planes_offset, spec.planes_stride,
            np.ascontiguousarray(position.ravel()), np.ascontiguousarray(hot.ravel(), np.uint8),
            flat(prior), flat(b_up), self.cache_slots, settings.policy, settings.readers,
            settings.max_gap, settings.max_read_bytes, settings.direct))
        self._finalizer = weakref.finalize(self, _ffi._pij_ext.neuron_store_release, self.handle)

    def stats(self) -> dict:
        """The C++ counters (requests, hits, misses, bytes read, waits) since open or reset."""
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        return dict(_ffi._pij_ext.neuron_store_stats(self.handle))

    def reset_stats(self) -> None:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        _ffi._pij_ext.neuron_store_reset_stats(self.handle)

    def prefetch(self, layer: int, ids) -> None:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        _ffi._pij_ext.neuron_store_prefetch(self.handle, int(layer),
                                            np.ascontiguousarray(ids, np.int32))

    def trace(self, on: bool = True) -> None:
        """Record every call's keys (layer * F + id) from now on (`take_trace` hands them out)."""
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        _ffi._pij_ext.neuron_store_trace(self.handle, bool(on))

    def take_trace(self) -> list[np.ndarray]:
        """The recorded calls (one key array each), clearing the record."""
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        keys, ends = _ffi._pij_ext.neuron_store_take_trace(self.handle)
        return np.split(np.asarray(keys), np.asarray(ends)[:-1]) if len(ends) else []

    def close(self) -> None:
        self._finalizer()


def simulate_cache(keys_per_call, *, num_keys: int, slots: int, policy: str, prior=None) -> dict:
    """Replay calls (each an array of keys layer * F + id) through the store's cache alone:
    {hits, misses, evictions, uncached}. The eviction policies' experiment."""
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    check_choice("neuron cache policy", policy, POLICIES)
    calls = [np.asarray(k, np.int64).ravel() for k in keys_per_call]
    keys = np.concatenate(calls) if calls else np.zeros(0, np.int64)
    ends = np.cumsum([c.size for c in calls]).astype(np.int64)
    p = None if prior is None else np.ascontiguousarray(np.asarray(prior, np.float32).ravel())
    return dict(_ffi._pij_ext.neuron_cache_simulate(int(num_keys), int(slots), policy, p, keys,
                                                    ends))
