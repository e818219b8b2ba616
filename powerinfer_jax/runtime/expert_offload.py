"""`--ram-budget` for a mixture-of-experts model whose experts do not fit in memory.

What stays in memory (anonymous memory, never the model file's page cache: under a memory limit
page-cache pages are what the kernel reclaims and reads back, which is how a model mapped with
mmap ends up read from disk every token):
  * everything but the routed experts: attention, norms, embeddings, LM head, each layer's
    router and shared expert (Qwen2-MoE), and the KV cache;
  * the expert store (ops/expert_store.py, cpu_backend/expert_store.h): the pinned experts (the
    ones routed most often, by a routing profile, chosen over all layers at once: every expert
    of a model has the same size, so the most frequent P are the optimum for P slots), a cache
    of `cache_slots` slots with an eviction policy, and its tables;
  * the MoE kernel's scratch for the longest call (every token of a prompt at --max-seq-len).
Every other expert is read when a token routes to it, from the model's expert file
(runtime/expert_file.py: one contiguous extent per expert, O_DIRECT, several reads in flight),
while the call computes the experts it has in memory; and the next layer's likely experts are
read ahead while this layer computes (`lookahead`: the next layer's ffn_norm and router on this
layer's residual: the experts it ranks first, `READ_AHEAD` x k of them per token).

What `--ram-budget` counts: the bytes above (exact: tensor shapes, the KV cache at --max-seq-len
and the batch, the store's slots and tables). Not counted: the process itself (Python, jax,
XLA's runtime and compiled programs, the tokenizer), measured in benchmarks/moe_offload.py as
the difference between its cgroup limit and the budget; an untied token embedding, which stays
the file's pages (runtime/offload.py `make_anonymous`). When the whole model fits, nothing is
offloaded (runtime/offload.py's rule, shared with dense models).

Where the routing profile comes from (it decides the pinned experts and the "frequency"
policy's order):
  1. <artifacts>/experts.npz: the routers' counts on the calibration corpus
     (runtime/vram_budget.py `expert_frequencies`, which --vram-budget's placement writes; or
     `profile_experts` below);
  2. a synthetic model's `frequencies.npz` beside it (powerinfer_jax.synthetic.moe: the
     routing measured on its calibration text), when its synthetic.json names the model file;
  3. neither: none. Nothing is pinned and the whole budget is cache (a note on stderr says so).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from powerinfer_jax.errors import fail
from powerinfer_jax.models.moe import Lookahead, OnDisk
from powerinfer_jax.ops.expert_store import ExpertStore, ExpertStoreSettings
from powerinfer_jax.runtime import expert_file
from powerinfer_jax.runtime.offload import HUGE_MIN, HUGE_PAGE, make_anonymous

# The cache policy and the share of the expert memory (beyond the one layer's worth of cache a
# call may need) left to the cache, the rest pinned by the routing profile. Measured by replaying
# the routing of a 128-token decode and of 256 tokens of held-out text of the SYNTHETIC
# OLMoE-1B-7B shape (Q4_0) through the store's cache (benchmarks/moe_policies.py, rows in
# benchmarks/moe_offload_policies.jsonl): "frequency" (the profile's order) has the best hit rate,
# or within 0.1 point of it, at every memory size and share; "score" (the router's decayed
# probabilities) is within 1.3 points of it, LFU and LRU lower (LRU up to 11 points at 20% of the
# experts in memory, nothing pinned); with "frequency" every share from 0 to 0.25 is within 0.3
# points at 20-60% of the experts in memory (0.6 at 75%), a share of 1 (nothing pinned) loses
# 0.4-3.5. The SYNTHETIC Qwen3-30B-A3B shape's replays (the same file) agree: "frequency" and
# "score" within 1.3 points of each other everywhere, LRU up to 10 points lower, nothing pinned
# 0.7-6.5 points lower. A quarter stays dynamic for text whose routing drifts from the profile
# (real models; the synthetic one routes by a fixed prior), as the neuron
# store's (runtime/offload.py).
DEFAULT_CACHE_SHARE = 0.25
DEFAULT_POLICY = "frequency"
# Experts per token the read-ahead reads for the next layer, in units of its k: the router's k
# first (recall and bytes wasted in the store's statistics)
READ_AHEAD = 1
# bytes per (layer, expert) key and per cache slot of the store's tables (expert_store.h,
# neuron_cache.h): pinned flag and slot, prior, score, the cache's slot index; a slot's key (8),
# last use and uses (16), pins (4), heap flag (1), heap entry (24), free-list entry (4),
# prefetch flag (1), and 4 per read piece
TABLE_BYTES_PER_KEY = 17
TABLE_BYTES_PER_SLOT = 58


@dataclasses.dataclass
class ExpertOffload:
    """An offloaded MoE model's experts: the store every layer reads, and what was decided."""

    store: ExpertStore | None
    summary: dict

    def stats(self) -> dict:
        """The store's counters (ops.expert_store: since it opened or the last reset) and rates:
        hit_rate = (pinned + cache hits) / experts requested (no read waited for: in memory or
        read ahead), over every call; per_token: one-token calls (decode at batch 1; tokens =
        those calls / layers): hit_rate, memory_hit_rate (the requests no read served at all: a
        read ahead's hits left out), experts_read (demand misses), bytes_read (every byte those
        calls read, their own and ahead for the next layer), readahead_recall (the next layer's
        routed experts that the read-ahead had guessed, of those the guesses were for),
        readahead_wasted_bytes (bytes read ahead that no call used before the count was taken:
        read-ahead bytes less the used experts' bytes)."""
        if self.store is None:
            return {}
        s = self.store.stats()
        req = max(s["requested"], 1)
        s["hit_rate"] = (s["pinned_hits"] + s["cache_hits"]) / req
        s["pinned_hit_rate"] = s["pinned_hits"] / req
        s["cache_hit_rate"] = s["cache_hits"] / req
        one = s["one_token"]
        tokens = one["calls"] / self.summary["n_layers"]
        one_req = max(one["requested"], 1)
        slot = self.summary["slot_bytes"]

        def per(v):
            return v / tokens if tokens else 0.0

        s["per_token"] = {
            "tokens": tokens,
            "hit_rate": (one["pinned_hits"] + one["cache_hits"]) / one_req,
            "pinned_hit_rate": one["pinned_hits"] / one_req,
            "memory_hit_rate": (one["pinned_hits"] + one["cache_hits"]
                                - one["prefetch_hits"]) / one_req,
            "experts_requested": per(one["requested"]),
            "experts_read": per(one["misses"]),
            "bytes_read": per(one["demand_bytes"] + one["prefetch_bytes"]),
            "demand_bytes_read": per(one["demand_bytes"]),
            "readahead_bytes": per(one["prefetch_bytes"]),
            "readahead_recall": (one["predicted_hits"] / one["guessed_routed"]
                                 if one["guessed_routed"] else None),
            "readahead_wasted_bytes": per(max(one["prefetch_bytes"]
                                              - one["prefetch_hits"] * slot, 0))}
        return s

    def describe(self) -> dict:
        return {**self.summary, "stats": self.stats()}


def routing_frequencies(ckpt, artifacts_root) -> tuple[np.ndarray | None, str]:
    """[L, E] routing frequencies and where they came from (module docstring)."""
    from powerinfer_jax.runtime.vram_budget import EXPERT_PROFILE_NAME  # lazy: start-up (vram_budget
    # pulls in the placement solver)

    c = ckpt.config
    shape = (c.n_layers, c.n_experts)
    if artifacts_root is not None:
        path = Path(artifacts_root) / EXPERT_PROFILE_NAME
        if path.is_file():
            try:
                with np.load(path) as z:
                    freq = np.asarray(z["frequency"], np.float64)
                if freq.shape == shape and np.all(np.isfinite(freq)) and np.all(freq >= 0):
                    return freq, str(path)
            except (OSError, ValueError, KeyError):
                pass
            print(f"powerinfer_jax: ignoring {path}: expected finite frequencies >= 0 of shape "
                  f"{shape}", file=sys.stderr)
    source = Path(ckpt.source)
    record, npz = source.parent / "synthetic.json", source.parent / "frequencies.npz"
    if record.is_file() and npz.is_file():
        try:
            named = Path(json.loads(record.read_text()).get("file", "")).name
            with np.load(npz) as z:  # the routing on the generator's calibration text
                freq = np.asarray(z["calibrated"], np.float64)
        except (OSError, ValueError, KeyError):
            named, freq = "", None
        if freq is not None and freq.shape == shape and np.any(freq) and named == source.name:
            return freq, f"{npz} (calibrated)"
    return None, "none"


def stub_experts(model, ckpt) -> None:
    """Give every MoE layer's stacked experts zero experts in the file's formats (the store holds
    them): the modules know their formats, hold no bytes (their Params were left shape-only by
    from_params: never read)."""
    for l, layer in enumerate(model.layers):
        x = layer.ffn.experts
        for name, m in zip(expert_file.expert_names(l).values(), (x.gate, x.up, x.down_t)):
            m.weight.set_value(np.zeros((0, 0, 0), np.uint8))
            m.qtype = ckpt.params[name].qtype


def kernel_scratch_bytes(config, *, kv_len: int, batch: int) -> int:
    """The MoE kernel's scratch for the longest call (every token of a batch's prompts at once):
    per routed (token, expert) pair its gate, up and output floats and its quantized inputs."""
    pairs = kv_len * batch * config.n_experts_used
    return pairs * (4 * (2 * config.d_ff + config.d_model) + 2 * (config.d_model + config.d_ff))


def split(freqs, n_layers: int, n_experts: int, slots: int, cache_share: float):
    """(pinned [L, E] bool, cache_slots) for `slots` expert slots: the most frequent experts of
    all layers pinned (stable: ties by layer, then id), the rest cache, at least a layer's
    unpinned experts."""
    pinned = np.zeros(n_layers * n_experts, bool)
    if freqs is not None:
        count = min(int((slots - n_experts) * (1.0 - cache_share)), n_layers * n_experts)
        if count > 0:
            flat = np.asarray(freqs, np.float64).ravel()
            pinned[np.argsort(-flat, kind="stable")[:count]] = True
    pinned = pinned.reshape(n_layers, n_experts)
    most_unpinned = int((n_experts - pinned.sum(axis=1)).max())
    return pinned, int(max(slots - int(pinned.sum()), most_unpinned))


def minimum_bytes(dense: int, spec, tables: int) -> int:
    """The smallest budget: what stays in memory, the store's tables, and a cache that holds one
    layer's experts (a call may route to every one of them)."""
    return dense + tables + spec.n_experts * (spec.slot_bytes + TABLE_BYTES_PER_SLOT)


def set_lookahead(model, ahead: int) -> None:
    """Give each MoE layer but the last the next layer's ffn_norm and router (shared modules)."""
    for layer, nxt in zip(model.layers[:-1], model.layers[1:]):
        layer.ffn.lookahead = Lookahead(nxt.ffn_norm, nxt.ffn.router)
        layer.ffn.on_disk = dataclasses.replace(layer.ffn.on_disk, ahead=ahead)


def attach(model, ckpt, *, budget: int, kv_len: int, batch: int, artifacts_root,
           policy: str = DEFAULT_POLICY, cache_share: float = DEFAULT_CACHE_SHARE,
           lookahead: bool = True, settings: ExpertStoreSettings | None = None,
           progress: bool = True) -> ExpertOffload:
    """Decide what is resident, make sure the expert file exists, open the store and point every
    MoE layer at it. The model's experts must be stubs (`stub_experts`)."""
    from powerinfer_jax.sparsity import placement as pl  # lazy: start-up (the placement solver)

    c = model.config
    copied, file_view = make_anonymous(model)
    dense = pl.model_bytes(model, kv_len=kv_len, batch=batch).dense - file_view
    dense += kernel_scratch_bytes(c, kv_len=kv_len, batch=batch)
    path, spec = expert_file.ensure(ckpt, progress=progress)
    keys = c.n_layers * c.n_experts
    tables = TABLE_BYTES_PER_KEY * keys
    # the arenas' rounding to huge pages (arena.h: one page at most, each arena from HUGE_MIN)
    tables += HUGE_PAGE if c.n_experts * spec.slot_bytes >= HUGE_MIN else 0
    need = minimum_bytes(dense, spec, tables)
    if budget < need:
        gib = 1 << 30
        fail("--ram-budget", f"at least {need / gib:.3f} GiB ({need} bytes: what stays in "
             f"memory {dense} incl. the KV cache at --max-seq-len {kv_len} and the MoE kernel's "
             f"scratch, the expert store's tables {tables} and one layer's {c.n_experts} routed "
             f"experts {c.n_experts * (spec.slot_bytes + TABLE_BYTES_PER_SLOT)})",
             f"{budget / gib:.3f} GiB", "raise the budget or lower --max-seq-len")
    freqs, source = routing_frequencies(ckpt, artifacts_root)
    if freqs is None:
        print("powerinfer_jax: no routing profile for this model (python -m powerinfer_jax."
              "generate --vram-budget ... writes one, as does a run with enough memory): nothing "
              "pinned, the whole expert budget is a cache", file=sys.stderr)
    if policy == "frequency" and freqs is None:
        policy = "lru"  # no order to keep: recency (said in the summary)
    if budget - dense - tables >= 2 * HUGE_MIN:  # both arenas may be on huge pages
        tables += HUGE_PAGE
    slots = (budget - dense - tables) // (spec.slot_bytes + TABLE_BYTES_PER_SLOT)
    pinned, cache_slots = split(freqs, c.n_layers, c.n_experts, int(slots), cache_share)
    settings = dataclasses.replace(settings or ExpertStoreSettings(), policy=policy)
    store = ExpertStore(path, spec, pinned, cache_slots, prior=freqs, settings=settings)
    for l, layer in enumerate(model.layers):
        layer.ffn.on_disk = OnDisk(store=store.handle, layer=l, d_ff=c.d_ff,
                                   **spec.layer_formats(l), credit=policy == "score")
    ahead = READ_AHEAD * c.n_experts_used if lookahead and c.n_layers > 1 else 0
    if ahead:
        set_lookahead(model, min(ahead, c.n_experts))
    served = None
    if freqs is not None:
        served = float((freqs * pinned).sum() / max(float(freqs.sum()), 1e-30))
    n_pinned = int(pinned.sum())
    resident = dense + tables + (n_pinned + cache_slots) * spec.slot_bytes + \
        TABLE_BYTES_PER_SLOT * cache_slots
    summary = {"mode": "disk", "kind": "experts", "budget_bytes": budget,
               "resident_bytes": resident, "n_layers": c.n_layers, "dense_bytes": dense,
               "table_bytes": tables + TABLE_BYTES_PER_SLOT * cache_slots,
               "pinned_experts": n_pinned, "cache_slots": cache_slots, "experts": keys,
               "slot_bytes": spec.slot_bytes, "expert_bytes": spec.expert_bytes,
               "expert_file": str(path),
               "formats": sorted({"/".join(f) for f in spec.formats}),
               "frequencies": source, "pinned_served_fraction": served, "policy": policy,
               "lookahead": bool(ahead), "readahead_experts_per_token": ahead,
               "copied_from_file_bytes": copied, "file_view_bytes": file_view}
    return ExpertOffload(store=store, summary=summary)
