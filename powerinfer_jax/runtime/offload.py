"""`--ram-budget`: run a quantized model whose FFN does not fit in memory, as PowerInfer-2 does.

What stays in memory (all anonymous memory, never the model file's page cache: under a memory
limit page-cache pages are what the kernel reclaims and reads back, which is how a model mapped
with mmap ends up read from disk every token):
  * the dense parts: attention, norms, embeddings, LM head, predictors, and the KV cache;
  * the neuron store (ops/neuron_store.py, cpu_backend/neuron_store.h): its static part (the
    neurons that fire most, by profiled frequency, chosen over all layers at once as
    sparsity/placement.py chooses hot neurons: equal bundle sizes make the most frequent K the
    optimum) and its dynamic part (a cache of `cache_slots` neurons with an eviction policy),
    plus its tables, the kernel's scratch and, on llama.cpp's GGUF, the scales of its down
    projection (the down groups' planes: the store sums down rows as the in-memory kernel does).
Every other neuron is read per token, only when the layer's active set (the predictor's) needs
it, from the model's neuron bundle file (checkpoint/bundles.py), overlapped with the compute of
the resident ones (cpu_backend/disk_ffn.h).

What `--ram-budget` counts: the bytes above (exact: tensor shapes, the KV cache at --max-seq-len
and the batch, the store's slots and tables). Not counted: the process itself (Python, jax,
XLA's runtime and compiled programs, the tokenizer), measured in benchmarks/offload.py and given
there as the difference between the cgroup limit and the budget; an untied token embedding,
which stays the file's pages (one row read per token: `make_anonymous`); and load-time peaks
(the loader's copies while it builds the model), which the benchmark's cgroup measures. When the whole model fits
(the file's tensors and the KV cache within the budget) nothing is offloaded: the model loads
as without the flag (the fastest path), and `describe()` says so.

How neuron frequencies are found (they decide the static part and the file's order):
  1. the sparsity artifacts' profile (`python -m powerinfer_jax.calibrate --model M` counts
     every neuron's activations over wiki.train: <artifacts>/target_*/profile.npz);
  2. a synthetic model's own `frequencies.npz` beside it (powerinfer_jax.synthetic: measured on
     held-out text, else prescribed), when its synthetic.json names the model file;
  3. neither: none. The static part then stays empty and the whole neuron budget is cache: the
     dynamic part learns the hot neurons as it runs (a note on stderr says so).
Sparsity modes: dense (every neuron, the whole FFN read each token: the dense twin), oracle
(exact activations at a scalar --threshold: every neuron's rows read too) and powerinfer (the
predictor picks the neurons before any row is read: the mode this is for). Modes whose selector
reads FFN rows itself (threshold, predictor) are refused: their rows are in the store.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint import bundles
from powerinfer_jax.checkpoint.base import QuantTensor, aligned
from powerinfer_jax.errors import fail
from powerinfer_jax.models.ffn import DiskHybrid
from powerinfer_jax.models.qweights import QWeight, ROWS
from powerinfer_jax.ops.neuron_store import NeuronStore, StoreSettings
from powerinfer_jax.sparsity.powerinfer_predictor import PowerInferSelector
from powerinfer_jax.sparsity.profile import ActivationProfile

MODES = ("dense", "oracle", "powerinfer")
# Share of the neuron budget (after the minimum cache) given to the dynamic part; the rest is
# static. Measured by replaying a 128-token decode trace of the synthetic 90% 7B model through the
# cache (benchmarks/offload_policies.py, rows in benchmarks/offload_policies.jsonl): with the
# "frequency" policy every share from 0 to 0.25 gives the same hit rate within 0.3 points (0.57,
# 0.72, 0.80, 0.89 at 10, 20, 30, 50% of the neurons in memory); LRU and LFU lose up to 40
# points at small memories, where a cache smaller than a token's 32 layers of active neurons
# sees a cyclic scan (LRU keeps nothing of it). A quarter stays dynamic for text whose active
# sets drift (real models; the synthetic one fires by a fixed prior).
DEFAULT_CACHE_SHARE = 0.25
# bytes per (layer, neuron) key and per dynamic slot of the store's tables (neuron_store.h,
# neuron_cache.h): position, hot flag, prior, static slot, cache index; a slot's key (8), last
# use and uses (16), pins (4), heap flag (1), heap entry (24), free-list entry (4), read state
# (4) and prefetch flag (1)
TABLE_BYTES_PER_KEY = 17
TABLE_BYTES_PER_SLOT = 62
# the store's static and dynamic arenas, from HUGE_MIN bytes on, are on 2 MiB huge pages: at most
# one more page each (cpu_backend/neuron_store.cc Arena)
HUGE_PAGE, HUGE_MIN = 2 << 20, 32 << 20
_TOKEN_CHUNK = 32  # disk_ffn.cc's kTokenChunk
_PIECES = 16  # qsparse_common.h's kMaxPieces


@dataclasses.dataclass
class Offload:
    """An offloaded model's FFN: the store every layer reads, and what was decided."""

    store: NeuronStore | None
    summary: dict

    def stats(self) -> dict:
        """The store's counters (ops.neuron_store: since it opened or the last reset) and rates:
        hit_rate = (static + cache hits) / neurons requested (no read waited for: the neuron was
        in memory or a read ahead had it in flight), over every call; per_token: the same over
        one-token calls (decode at batch 1; tokens = those calls / layers), with
        memory_hit_rate = the requests no read served at all (a read ahead's hits left out),
        bytes_read = every byte those calls had read, their own and ahead for the next layer
        (demand_bytes_read: their own)."""
        if self.store is None:
            return {}
        s = self.store.stats()
        req = max(s["requested"], 1)
        s["hit_rate"] = (s["static_hits"] + s["cache_hits"]) / req
        s["static_hit_rate"] = s["static_hits"] / req
        s["cache_hit_rate"] = s["cache_hits"] / req
        one = s["one_token"]
        tokens = one["calls"] / self.summary["n_layers"]
        one_req = max(one["requested"], 1)
        s["per_token"] = {
            "tokens": tokens,
            "hit_rate": (one["static_hits"] + one["cache_hits"]) / one_req,
            "static_hit_rate": one["static_hits"] / one_req,
            "neurons_requested": one["requested"] / tokens if tokens else 0.0,
            "memory_hit_rate": (one["static_hits"] + one["cache_hits"]
                                - one["prefetch_hits"]) / one_req,
            "neurons_read": one["misses"] / tokens if tokens else 0.0,
            "bytes_read": (one["demand_bytes"] + one["prefetch_bytes"]) / tokens if tokens
            else 0.0,
            "demand_bytes_read": one["demand_bytes"] / tokens if tokens else 0.0}
        return s

    def describe(self) -> dict:
        return {**self.summary, "stats": self.stats()}


def file_bytes(ckpt) -> int:
    """The bytes of the checkpoint's tensors (as stored in the file)."""
    return sum(t.nbytes if isinstance(t, QuantTensor) else np.asarray(t).nbytes
               for t in ckpt.params.values())


# a GGUF's FFN matrices of a dense layer (llama.cpp's ffn_down [D, F] or PowerInfer's ffn_down_t
# [F, D], gguf_arch.sources) and an MoE layer's routed experts: the only tensors a neuron or
# expert store keeps on disk
_GGUF_FFN = re.compile(r"blk\.\d+\.ffn_(gate|up|down|down_t|gate_exps|up_exps|down_exps)"
                       r"\.weight")


def check_budget_from_header(model, budget: int) -> None:
    """Before anything is loaded: a UserError when `budget` cannot hold the tensors that stay in
    memory whatever the mode (every tensor of a GGUF file but its FFN matrices or, of an MoE
    model, its routed experts: attention, embeddings, output, norms, routers, shared experts),
    read from the file's header. The full minimum (the KV cache, the
    store's tables, one layer's neurons) is checked once the model is built (`attach`); this one
    stops a hopeless budget before the loader's own copies take the memory it does not have.
    Registry names and HF directories are checked after loading only."""
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf import _open  # the loader's: a bad file named, with a fix

    path = Path(str(model))
    if path.suffix != ".gguf" or not path.is_file():
        return
    tensors = _open(path).tensors
    resident = sum(t.n_bytes for t in tensors if not _GGUF_FFN.fullmatch(t.name))
    if budget < resident:
        gib = 1 << 30
        fail("--ram-budget", f"at least {resident / gib:.3f} GiB ({resident} bytes of tensors "
             f"that stay in memory: every tensor of {path.name} but its FFN matrices (routed "
             "experts), from its "
             "header; the KV cache and the neuron store come on top)", f"{budget / gib:.3f} GiB",
             "raise the budget")


def kv_bytes(config, *, kv_len: int, batch: int, dtype) -> int:
    return 2 * config.n_layers * batch * kv_len * config.n_kv_heads * config.head_dim * \
        np.dtype(dtype).itemsize


_PREDICTOR = re.compile(r"blk\.\d+\.fc[12]\.weight")


def predictor_bytes(sparsity, ckpt) -> int:
    """The bytes of the PowerInfer predictors a powerinfer-mode model holds (blk.i.fc1 / fc2 of
    --predictors, else of the model's file, from its header), 0 for other modes."""
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf import _open  # the loader's: a bad file named, with a fix

    if sparsity.mode != "powerinfer":
        return 0
    path = Path(str(sparsity.predictor_file or ckpt.source))
    if path.suffix != ".gguf" or not path.is_file():
        return 0
    return sum(t.n_bytes for t in _open(path).tensors if _PREDICTOR.fullmatch(t.name))


def in_memory_bytes(ckpt, *, kv_len: int, batch: int, dtype, extra: int = 0) -> int:
    """The whole model in memory: its tensors as stored, the KV cache and `extra` (predictors)."""
    return file_bytes(ckpt) + kv_bytes(ckpt.config, kv_len=kv_len, batch=batch,
                                       dtype=dtype) + extra


def fits_in_memory(ckpt, budget: int, *, kv_len: int, batch: int, dtype, extra: int = 0) -> bool:
    """The rule: a budget that holds the whole model (`in_memory_bytes`) runs it in memory, as
    without --ram-budget (the fastest path: nothing is read from the disk, every array is the
    in-memory kernel's); a smaller one offloads its FFN to a neuron store."""
    return in_memory_bytes(ckpt, kv_len=kv_len, batch=batch, dtype=dtype, extra=extra) <= budget


def check_mode(sparsity) -> None:
    if sparsity.mode not in MODES or (sparsity.mode == "oracle"
                                      and sparsity.target_sparsity is not None):
        fail("--sparsity with --ram-budget", f"one of {list(MODES)} (oracle with a scalar "
             "--threshold): modes whose active set needs no FFN row outside the neuron store",
             sparsity.mode if sparsity.mode != "oracle" else "oracle --target-sparsity")


def stub_ffns(model, ckpt, layout) -> None:
    """Give every FFN zero-row weights in the file's formats (the rows are the store's), in the
    layouts of the build plan (`layout`, a models.qweights.FfnLayout: the mode's selector then
    finds the layouts it reads and nothing is re-arranged; the down rows as ROWS in the file's
    format, which every sparse layout accepts): the modules know their formats, hold no rows, and
    a selector that tried to read them would find none."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    d = model.config.d_model
    for l, layer in enumerate(model.layers):
        ffn = layer.ffn
        names = bundles.ffn_names(model.config, l)
        for key, module in (("gate", ffn.gate), ("up", ffn.up)):
            if module is None:
                continue
            qtype = ckpt.params[names[key]].qtype
            module.load(QWeight(np.zeros((0, quants.row_bytes(qtype, d)), np.uint8), qtype,
                                getattr(layout, key)))
        qtype = ckpt.params[names["down"]].qtype
        down = layout.down if layout.down == "matvec" else ROWS
        ffn.down_t.load(QWeight(np.zeros((0, quants.row_bytes(qtype, d)), np.uint8), qtype,
                                down))
        ffn.n_cold = model.config.d_ff


def make_anonymous(model) -> tuple[int, int]:
    """Copy every model array that is a view of a file mapping (the GGUF's mmap) into memory of
    its own, and drop the file pages from the resident set; except an untied token embedding:
    each token reads one row of it, so it stays the file's pages (a page read again now and then
    under a memory limit costs 4 KiB, holding the table would cost its whole size). Returns
    (bytes copied, bytes left as file views)."""
    import jax
    from flax import nnx

    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.gguf_file import _mappings, mapping_at, release_mapped_pages

    embed = None if model.config.tie_embeddings else model.tok_embed
    maps = _mappings()
    copied, left, views = 0, 0, []
    for _, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable):
            continue
        value = var.get_value()
        if not isinstance(value, jax.Array) or value.size == 0:
            continue
        host = np.asarray(value)
        m = mapping_at(host.__array_interface__["data"][0], maps)
        if m is None or m.inode == 0:
            continue
        views.append(host)
        if var is embed:
            left += host.nbytes
            continue
        own = aligned(host, copy=True)
        own.flags.writeable = False
        var.set_value(jax.device_put(own, may_alias=True))
        copied += host.nbytes
    release_mapped_pages(*views)  # (the embedding's pages too: faulted back in as rows are read)
    return copied, left


def neuron_frequencies(ckpt, artifacts_root) -> tuple[np.ndarray | None, str]:
    """[L, F] activation frequencies and where they came from (module docstring)."""
    c = ckpt.config
    shape = (c.n_layers, c.d_ff)
    if artifacts_root is not None:
        for path in sorted(Path(artifacts_root).glob("target_*/profile.npz")):
            try:
                freq = ActivationProfile.load(path).frequency
            except (OSError, KeyError, ValueError):
                continue
            if freq.shape == shape:
                return np.asarray(freq, np.float64), str(path)
    source = Path(ckpt.source)
    record, npz = source.parent / "synthetic.json", source.parent / "frequencies.npz"
    if record.is_file() and npz.is_file():
        try:
            files = json.loads(record.read_text()).get("files", {})
            with np.load(npz) as z:  # "measured" is all zeros when the generator skipped it
                key = "measured" if "measured" in z and np.any(z["measured"]) else "prescribed"
                freq = np.asarray(z[key], np.float64)
        except (OSError, ValueError, KeyError):
            files, freq = {}, None
        if freq is not None and freq.shape == shape and source.name in {
                Path(p).name for p in files.values()}:
            return freq, f"{npz} ({key})"
    return None, "none"


def set_lookahead(model) -> bool:
    """Give each offloaded FFN the next layer's predictor (a module shared with that layer's
    selector, not a copy): on this layer's residual its output guesses the next layer's active
    set, which the store reads ahead while this layer and the next one's attention compute.
    Only where the selector is a PowerInfer predictor on the residual. Returns whether set."""
    sels = [layer.ffn.selector for layer in model.layers]
    if not all(isinstance(s, PowerInferSelector) for s in sels):
        return False
    for layer, nxt in zip(model.layers[:-1], sels[1:]):
        layer.ffn.lookahead = nxt.predictor
    return True


def minimum_bytes(dense: int, spec, tables: int) -> int:
    """The smallest budget: the dense parts, the store's tables and scratch, and a dynamic part
    that holds one layer's neurons (a call on a layer with nothing static may need them all)."""
    return dense + tables + spec.n_neurons * (spec.slot_bytes + TABLE_BYTES_PER_SLOT)


def split(freqs, spec, neuron_bytes: int, cache_share: float):
    """(hot [L, F] bool, cache_slots): the static neurons (the most frequent over all layers)
    and the dynamic slots for `neuron_bytes` of neuron memory."""
    L, F = spec.n_layers, spec.n_neurons
    total = neuron_bytes // spec.slot_bytes
    if freqs is None:  # nothing to rank by: everything dynamic
        return np.zeros((L, F), bool), int(total)
    static = min(int((total - F) * (1.0 - cache_share)), L * F)
    # the most frequent `static` neurons of all layers (stable: ties by layer, then index)
    flat = np.asarray(freqs, np.float64).ravel()
    hot = np.zeros(L * F, bool)
    if static > 0:
        hot[np.argsort(-flat, kind="stable")[:static]] = True
    hot = hot.reshape(L, F)
    most_cold = int((F - hot.sum(axis=1)).max())
    return hot, int(max(total - static, most_cold))


def attach(model, ckpt, *, budget: int, kv_len: int, batch: int, artifacts_root,
           policy: str = "frequency", cache_share: float = DEFAULT_CACHE_SHARE,
           lookahead: bool = True, settings: StoreSettings | None = None,
           progress: bool = True) -> Offload:
    """Decide what is resident, make sure the bundle file exists, open the store and point every
    FFN at it (models.ffn.DiskHybrid). The model's FFNs must be stubs (`stub_ffns`)."""
    from powerinfer_jax.sparsity import placement as pl  # lazy: start-up (gguf only for GGUF files)

    c = model.config
    copied, file_view = make_anonymous(model)
    dense = pl.model_bytes(model, kv_len=kv_len, batch=batch).dense - file_view
    freqs, source = neuron_frequencies(ckpt, artifacts_root)
    path, spec, order = bundles.ensure(ckpt, freqs, progress=progress)
    keys = c.n_layers * c.d_ff
    scratch = 4 * (_PIECES * _TOKEN_CHUNK * c.d_model + keys // c.n_layers * _TOKEN_CHUNK)
    # the down groups' scale planes (bundles "groups"), in memory while the store is open
    planes = spec.n_layers * spec.planes_stride
    slack = (2 * HUGE_PAGE if spec.n_neurons * spec.slot_bytes >= HUGE_MIN else 0) + \
        (HUGE_PAGE if planes >= HUGE_MIN else 0)
    tables = TABLE_BYTES_PER_KEY * keys + scratch + slack + planes
    need = minimum_bytes(dense, spec, tables)
    if budget < need:
        gib = 1 << 30
        fail("--ram-budget", f"at least {need / gib:.3f} GiB ({need} bytes: the dense parts "
             f"{dense} incl. the KV cache at --max-seq-len {kv_len}, the neuron store's tables "
             f"and down-group scales {tables} and one layer's neurons "
             f"{spec.n_neurons * (spec.slot_bytes + TABLE_BYTES_PER_SLOT)})",
             f"{budget / gib:.3f} GiB", "raise the budget or lower --max-seq-len")
    # slots cost their bytes and their table entries
    neuron_bytes = (budget - dense - tables) * spec.slot_bytes // (spec.slot_bytes
                                                                   + TABLE_BYTES_PER_SLOT)
    hot, slots = split(freqs, spec, neuron_bytes, cache_share)
    if freqs is None:
        print("powerinfer_jax: no neuron activation frequencies for this model (python -m "
              "powerinfer_jax.calibrate builds a profile): the whole neuron budget is a cache",
              file=sys.stderr)
    b_up = None
    if c.bias:
        b_up = np.stack([np.asarray(ckpt.params[f"layers.{l}.ffn.up.bias"], np.float32)
                         for l in range(c.n_layers)])
    settings = settings or StoreSettings(policy=policy)
    store = NeuronStore(path, spec, order, hot, slots, prior=freqs, b_up=b_up, settings=settings)
    for l, layer in enumerate(model.layers):
        layer.ffn.backend = DiskHybrid(store=store.handle, layer=l)
    ahead = lookahead and set_lookahead(model)
    served = None
    if freqs is not None:
        served = float((np.asarray(freqs) * hot).sum() / max(float(np.sum(freqs)), 1e-30))
    resident = dense + tables + (int(hot.sum()) + slots) * spec.slot_bytes + \
        TABLE_BYTES_PER_SLOT * slots
    summary = {"mode": "disk", "budget_bytes": budget, "resident_bytes": resident,
               "n_layers": c.n_layers,
               "dense_bytes": dense, "table_bytes": tables + TABLE_BYTES_PER_SLOT * slots,
               "static_neurons": int(hot.sum()), "cache_slots": slots,
               "neurons": keys, "slot_bytes": spec.slot_bytes, "planes_bytes": planes,
               "bundle_file": str(path),
               "down_qtype": spec.down_qtype, "down_source": spec.down_source,
               "down_error": spec.down_error, "frequencies": source,
               "static_served_fraction": served, "policy": settings.policy,
               "lookahead": ahead,
               "copied_from_file_bytes": copied, "file_view_bytes": file_view}
    return Offload(store=store, summary=summary)
