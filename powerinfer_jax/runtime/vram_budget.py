"""What `--vram-budget` / `--offload` do at start-up: the budget, the statistics, the placement
(computed, or read from its cache file) and applying it to the model.

The placement itself is sparsity/placement.py (pure, no I/O); this module does the I/O around it:
reads the profiled activation frequencies from the model's sparsity artifacts (or profiles an MoE
model's routers), sizes the default budget from the device, and keeps the placement cache next to
the artifacts: one JSON file holding the latest placement and the key it was made for. The key
(placement.cache_key) covers the model fingerprint, the budget, the exact tensor bytes, the
frequency statistics and the algorithm version, so a changed budget, model or profile never
reuses a stale placement (PowerInfer reuses stale neuron indexes); a stale file is replaced. A
file that does not parse, or whose placement is not a valid one (a neuron index out of range or
repeated, a hot count past the layer, lengths that disagree) is stale too: recomputed, with a
note, never applied. Writes go through powerinfer_jax.cache (locked, atomic).
"""
from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer_jax import cache
from powerinfer_jax.config import PlacementConfig
from powerinfer_jax.errors import fail
from powerinfer_jax.models.hybrid import apply_placement
from powerinfer_jax.runtime.mesh import round_placement
from powerinfer_jax.sparsity import corpus as corpus_mod
from powerinfer_jax.sparsity import placement as pl
from powerinfer_jax.sparsity.expert_profile import expert_frequency
from powerinfer_jax.sparsity.profile import ActivationProfile

# Headroom left free on a GPU by the default budget: XLA's temporaries (prefill activations,
# attention scores, the custom calls' scratch) and allocator fragmentation are not in the tensor
# byte count. A fraction of the device so it scales with the model sizes a device is used for;
# 10% is a conservative guess, not a measurement.
DEFAULT_GPU_MARGIN = 0.10


def default_budget_bytes() -> int | None:
    """A GPU's free memory minus DEFAULT_GPU_MARGIN of its capacity; None on CPU-only machines."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    stats = dev.memory_stats() or {}
    limit = int(stats.get("bytes_limit", 0))
    free = limit - int(stats.get("bytes_in_use", 0))
    return max(0, free - int(DEFAULT_GPU_MARGIN * limit))


def load_frequencies(artifacts_dir: Path | None, n_layers: int, d_ff: int
                     ) -> tuple[list[np.ndarray], str]:
    """Per-layer activation frequencies from <artifacts_dir>/profile.npz; uniform (with a note on
    stderr) when there are none: the placement is then by index, not by activity."""
    path = None if artifacts_dir is None else Path(artifacts_dir) / "profile.npz"
    if path is not None and path.is_file():
        freq = ActivationProfile.load(path).frequency
        if freq.shape == (n_layers, d_ff):
            return list(freq), str(path)
        print(f"powerinfer_jax: ignoring {path}: expected frequencies of shape "
              f"{(n_layers, d_ff)}, got {freq.shape}", file=sys.stderr)
    print("powerinfer_jax: no activation profile for this model (python -m "
          "powerinfer_jax.calibrate builds one); placing neurons by index", file=sys.stderr)
    return [np.ones(d_ff) for _ in range(n_layers)], "uniform"


# Tokens the router is profiled on when a mixture-of-experts model has no expert profile yet
# (sequences of EXPERT_PROFILE_CTX from the calibration corpus): at k of E experts per token a
# layer sees k * 4096 routings, enough to rank 128 experts by frequency (~100 per expert on
# average at k = 4). Profiled once per model and kept next to its sparsity artifacts.
EXPERT_PROFILE_TOKENS = 4096
EXPERT_PROFILE_CTX = 256
EXPERT_PROFILE_NAME = "experts.npz"


def expert_frequencies(model, artifacts_dir: Path | None,
                       tokenizer=None) -> tuple[list[np.ndarray], str]:
    """Per-layer routing frequencies of an MoE model's experts: <artifacts_dir>/experts.npz, or
    measured now on the calibration corpus with the model's own router (and saved there), or
    uniform with a note when there is neither a tokenizer nor a corpus. artifacts_dir: the
    model's artifacts root (routing does not depend on a target sparsity)."""
    c = model.config
    path = None if artifacts_dir is None else Path(artifacts_dir) / EXPERT_PROFILE_NAME
    if path is not None and path.is_file():
        try:
            with np.load(path) as z:
                freq = np.asarray(z["frequency"], np.float64)
            got = f"shape {freq.shape}"
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # damaged: measured again
            freq, got = None, f"an unreadable file ({type(e).__name__})"
        if freq is not None and freq.shape == (c.n_layers, c.n_experts) \
                and np.all(np.isfinite(freq)) and np.all(freq >= 0):
            return list(freq), str(path)
        print(f"powerinfer_jax: ignoring {path}: expected finite frequencies >= 0 of shape "
              f"{(c.n_layers, c.n_experts)}, got {got}; measuring them again", file=sys.stderr)
    chunks = None
    if tokenizer is not None:
        try:
            text = corpus_mod.read_corpus(corpus_mod.default_corpus_files())
        except Exception as e:  # noqa: BLE001 (no corpus here: uniform, said below)
            print(f"powerinfer_jax: no calibration corpus ({e})", file=sys.stderr)
        else:
            ids = tokenizer.encode(text, add_bos=False)
            chunks = corpus_mod.corpus_chunks(ids, min(EXPERT_PROFILE_CTX, c.max_seq_len),
                                              EXPERT_PROFILE_TOKENS)
    if chunks is None or not len(chunks):
        print("powerinfer_jax: no expert profile for this model; placing experts by index",
              file=sys.stderr)
        return [np.ones(c.n_experts) for _ in range(c.n_layers)], "uniform"
    print(f"powerinfer_jax: profiling the routers on {chunks.size} corpus tokens (once for "
          "this model)", file=sys.stderr)
    freq = expert_frequency(model, [row[None] for row in chunks])
    if path is not None:
        try:
            with cache.atomic_file(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, frequency=freq, tokens=np.int64(chunks.size))
        except OSError as e:  # a read-only cache: used now, measured again next time
            print(f"powerinfer_jax: could not keep the expert profile at {path}: {e}",
                  file=sys.stderr)
    return list(freq), "corpus"


def place_model(model, cfg: PlacementConfig, *, kv_len: int, model_fingerprint,
                artifacts_dir: Path | None, cache_dir: Path | None,
                default_budget: int | None = None, shards: int = 1,
                tokenizer=None) -> pl.Placement | None:
    """Decide (or reuse from the cache) and apply the placement; None when none applies.
    default_budget: the budget without --vram-budget (read before the model was loaded, as the
    session does); None: default_budget_bytes() now. shards: the mesh's devices (--devices):
    hot counts are rounded down to multiples of it (runtime/mesh.py `round_placement`).
    An MoE model places experts by routing frequency (`expert_frequencies`: the tokenizer
    profiles the routers when no profile is kept)."""
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else (
        default_budget if default_budget is not None else default_budget_bytes())
    if budget is None:
        return None
    c = model.config
    if c.n_experts and shards > 1:
        fail("--vram-budget with --devices", "a dense model (an MoE model is placed on one "
             "device)", f"{c.n_experts} experts over {shards} devices", "drop one of the two")
    if cfg.offload != "hybrid":
        freqs, source = None, "none"
    elif c.n_experts:
        freqs, source = expert_frequencies(model, cache_dir, tokenizer)
    else:
        freqs, source = load_frequencies(artifacts_dir, c.n_layers, c.d_ff)
    sizes = pl.model_bytes(model, kv_len=kv_len)
    key = pl.cache_key(model_fingerprint=model_fingerprint, mode=cfg.offload,
                       budget_bytes=budget, sizes=sizes,
                       stats=pl.stats_fingerprint(freqs) if freqs is not None else "none",
                       cold_balance=pl.DEFAULT_COLD_BALANCE)
    p, _ = load_or_place(cache_dir, key, lambda: pl.place(cfg.offload, freqs, sizes, budget))
    if shards > 1:
        p = round_placement(p, shards, freqs)
    apply_placement(model, p)
    return p


# ------------------------------------------------------------------- the placement cache file
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
