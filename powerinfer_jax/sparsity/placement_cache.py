"""On-disk placement cache: one JSON file holding the latest placement and the key it was made for.

The key (placement.cache_key) covers the model fingerprint, the budget, the exact tensor bytes,
the frequency statistics and the algorithm version, so a changed budget, model or profile never
reuses a stale placement (PowerInfer reuses stale neuron indexes); a stale file is replaced.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from powerinfer_jax.sparsity import placement as pl


def load_or_place(cache_dir: Path | None, key: str, compute: Callable[[], pl.Placement]
                  ) -> tuple[pl.Placement, bool]:
    """Returns (placement, hit). cache_dir None: always compute, never write."""
    if cache_dir is None:
        return compute(), False
    path = Path(cache_dir) / "placement.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                return pl.from_json(stored["placement"]), True
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or old format: recompute below
    p = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"key": key, "placement": pl.to_json(p)}))
    tmp.replace(path)
    return p, False
