"""`bench --op sparse_ffn`: the sparse FFN custom call alone, against dense formulations.

Validates first (max_abs_err vs the jnp reference on the same inputs), then times, then does the
napkin math: bytes of the active rows read per call / time, next to the machine's read bandwidth
measured in the same run (all pool threads streaming a 256 MiB buffer).
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax import ops

_BANDWIDTH_BYTES = 256 << 20
# Timed calls cycle through copies of the weights totalling at least this much, several times the
# last-level cache (32 MiB here): in a model, each layer's rows come from DRAM, not from a cache
# that the previous repeat of the same call left warm.
_COLD_WORKING_SET = 256 << 20


def median_seconds(fn, *args, repeats: int, arg_sets=None, carry: int | None = None) -> float:
    """The one timing helper of the benchmarks: median wall seconds of fn over `repeats` calls
    after a warm-up call (compilation), each blocking on the result.

    arg_sets: cycle through these argument tuples instead of `args` (cold weights: each call reads
    its rows from DRAM, as a model's layers do). carry: index of an argument fn donates and
    returns as its second output (a KV cache), threaded from call to call."""
    sets = [list(a) for a in arg_sets] if arg_sets is not None else [list(args)]

    def call(i):
        a = sets[i % len(sets)]
        out = fn(*a)
        if carry is not None:
            a[carry] = out[1]
        jax.block_until_ready(out)

    call(0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_us(fn, arg_sets, *, repeats: int) -> float:
    return median_seconds(fn, repeats=repeats, arg_sets=arg_sets) * 1e6


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one untimed call (pages touched)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth_gbs(repeats: int = 5, nbytes: int = _BANDWIDTH_BYTES) -> float:
    """The machine's read bandwidth (GB/s) over `nbytes` with the kernel thread pool's current
    thread count."""
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    data = np.ones(nbytes // 4, np.float32)
    return data.nbytes / _best_seconds(lambda: _ffi._pij_ext.stream_sum(data), repeats) / 1e9


def runs_bandwidth_gbs(run_bytes: int, stride_bytes: int, keep: float, *, repeats: int = 5,
                       nbytes: int = _BANDWIDTH_BYTES, seed: int = 0) -> tuple[float, int]:
    """The bandwidth (GB/s of the bytes read) of input sparsity's read pattern: runs of
    `run_bytes` every `stride_bytes` (a columns matrix's channels), a random `keep` of them read,
    each whole, over `nbytes`, with the kernel thread pool's current thread count. Returns
    (GB/s, bytes read)."""
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep: expected a fraction in (0, 1], got {keep}")
    stride = stride_bytes // 4
    data = np.ones(nbytes // 4 // stride * stride, np.float32)
    flags = (np.random.default_rng(seed).random(data.size // stride) < keep).astype(np.uint8)
    best = _best_seconds(lambda: _ffi._pij_ext.runs_sum(data, run_bytes // 4, stride, flags),
                         repeats)
    read = int(flags.sum()) * run_bytes
    return read / best / 1e9, read


def bench_sparse_ffn(*, d: int, f: int, t: int, active: float, dtype: str, gated: bool,
                     repeats: int) -> dict:
    if not 0.0 < active <= 1.0:
        raise ValueError(f"--active: expected a fraction in (0, 1], got {active}")
    for name, v in (("--d", d), ("--f", f), ("--t", t)):
        if v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v}")
    wdt = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    w = lambda: jnp.asarray(rng.standard_normal((f, d), np.float32) / np.sqrt(d), wdt)
    rows_per_neuron = 3 if gated else 2
    ffn_bytes = rows_per_neuron * f * d * wdt.itemsize
    n_copies = max(1, -(-_COLD_WORKING_SET // ffn_bytes))
    copies = [(w(), w(), w() if gated else None) for _ in range(n_copies)]
    w_up, w_down_t, w_gate = copies[0]
    x = jnp.asarray(rng.standard_normal((t, d), np.float32))
    # The same neurons active for every token (a decode step's set; for T > 1 the union is the same).
    n_active = max(1, round(active * f))
    mask = np.zeros((t, f), np.float32)
    mask[:, rng.permutation(f)[:n_active]] = 1.0
    scores = jnp.asarray(mask)

    def sparse(x, w_up, w_down_t, w_gate, scores):
        return ops.sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, scores=scores, threshold=0.5,
                              activation="silu")[0]

    def dense_all(x, w_up, w_down_t, w_gate):  # our kernel, every neuron
        return ops.sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, threshold=0.0,
                              activation="silu", criterion="oracle")[0]

    def xla_native(x, w_up, w_down_t, w_gate):  # XLA dots in the weight dtype, f32 accumulation
        mm = lambda a, b, s: jnp.einsum(s, a.astype(b.dtype), b, preferred_element_type=jnp.float32)
        up = mm(x, w_up, "td,fd->tf")
        a = up if w_gate is None else jax.nn.silu(mm(x, w_gate, "td,fd->tf")) * up
        a = a if w_gate is not None else jax.nn.silu(a)
        return mm(a, w_down_t, "tf,fd->td")

    def xla_upcast(x, w_up, w_down_t, w_gate):  # weights widened to f32, then XLA's f32 GEMM
        f32 = lambda a: a.astype(jnp.float32)
        up = x @ f32(w_up).T
        a = up if w_gate is None else jax.nn.silu(x @ f32(w_gate).T) * up
        a = a if w_gate is not None else jax.nn.silu(a)
        return a @ f32(w_down_t)

    got = jax.jit(sparse)(x, w_up, w_down_t, w_gate, scores)
    want = ops.sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, scores=scores, threshold=0.5,
                          activation="silu", impl="reference")[0]
    max_abs_err = float(jnp.max(jnp.abs(got - want)))
    with_x = [(x, u, dn, g) for u, dn, g in copies]
    sparse_us = _median_us(jax.jit(sparse), [a + (scores,) for a in with_x], repeats=repeats)
    dense_ffi_us = _median_us(jax.jit(dense_all), with_x, repeats=repeats)
    dense_variants = {"xla_native": xla_native}
    if wdt != jnp.float32:
        dense_variants["xla_upcast"] = xla_upcast
    xla_us = {k: _median_us(jax.jit(fn), with_x, repeats=max(3, repeats // 4))
              for k, fn in dense_variants.items()}
    best = min(xla_us, key=xla_us.get)
    active_bytes = n_active * rows_per_neuron * d * wdt.itemsize
    bw = read_bandwidth_gbs()
    gbps = active_bytes / (sparse_us * 1e-6) / 1e9
    return {
        "d": d, "f": f, "t": t, "active": active, "n_active": n_active, "weight_dtype": dtype,
        "gated": gated, "sparse_us": sparse_us, "dense_us": xla_us[best], "dense_formulation": best,
        "dense_xla_us": xla_us, "dense_ffi_us": dense_ffi_us,
        "speedup": xla_us[best] / sparse_us, "speedup_vs_dense_ffi": dense_ffi_us / sparse_us,
        "max_abs_err": max_abs_err, "gbps": gbps, "read_bandwidth_gbs": bw,
        "bandwidth_fraction": gbps / bw, "repeats": repeats, "weight_copies": n_copies,
    }
