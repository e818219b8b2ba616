"""On-disk placement cache: one JSON file holding the latest placement and the key it was made for.

The key (placement.cache_key) covers the model fingerprint, the budget, the exact tensor bytes,
the frequency statistics and the algorithm version, so a changed budget, model or profile never
reuses a stale placement (PowerInfer reuses stale neuron indexes); a stale file is replaced.
A file that does not parse, or whose placement is not a valid one (a neuron index out of range
or repeated, a hot count past the layer, lengths that disagree) is stale too: recomputed, with a
note, never applied. Writes go through powerinfer_jax.cache (locked, atomic).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from powerinfer_jax import cache
from powerinfer_jax.sparsity import placement as pl


def load_or_place(cache_dir: Path | None, key: str, compute: Callable[[], pl.Placement]
                  ) -> tuple[pl.Placement, bool]:
    """Returns (placement, hit). cache_dir None: always compute, never write."""
    if cache_dir is None:
        return compute(), False
    path = Path(cache_dir) / "placement.json"
    hit = _read(path, key)
    if hit is not None:
        return hit, True
    with cache.lock(path, what="the placement cache"):
        hit = _read(path, key)  # written by another process while we waited
        if hit is not None:
            return hit, True
        p = compute()
        cache.write_text(path, json.dumps({"key": key, "placement": pl.to_json(p)}))
    return p, False


def _read(path: Path, key: str) -> pl.Placement | None:
    """The cached placement for `key`, or None (no file, another key, or a bad entry)."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None  # another model/budget/profile: replaced below, no note needed
        p = pl.from_json(stored["placement"])
        problem = placement_problem(p)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        problem = f"unreadable ({type(e).__name__}: {e})"
    if problem is None:
        return p
    cache.note(f"ignoring the placement cache {path}: {problem}; placing again")
    return None


def placement_problem(p: pl.Placement) -> str | None:
    """Why `p` is not a valid placement, or None: per layer, 0 <= hot <= d_ff and an order that
    is a permutation of range(d_ff); as many layers in hot, order and sizes."""
    s = p.sizes
    n = len(p.hot)
    if p.mode not in ("hybrid", "layers"):
        return f"mode {p.mode!r} is not hybrid or layers"
    if not (len(p.order) == len(s.d_ff) == len(s.neuron_bytes) == len(s.layer_dense) == n):
        return (f"{n} hot counts, {len(p.order)} orders and {len(s.d_ff)} layer sizes "
                "(expected one of each per layer)")
    for layer, (hot, order, d_ff) in enumerate(zip(p.hot, p.order, s.d_ff)):
        if not 0 <= hot <= d_ff:
            return f"layer {layer}: hot count {hot} outside [0, {d_ff}]"
        if len(order) != d_ff or sorted(order) != list(range(d_ff)):
            bad = [i for i in order if not 0 <= i < d_ff][:3]
            return (f"layer {layer}: order is not a permutation of range({d_ff})"
                    + (f" (indices {bad} out of range)" if bad else ""))
    return None
