"""Neuron placement: which FFN rows live on the accelerator ("hot") and which on the host ("cold").

Pure and deterministic, no I/O: inputs are per-layer activation frequencies (from sparsity/profile.py)
and the exact bytes of every tensor (`model_bytes`), output is a frozen, hashable `Placement`.

The objective (PowerInfer's): maximize the expected number of active neurons per token served by the
accelerator, sum over layers l and hot neurons i of freq[l, i], subject to
  dense bytes (attention, norms, embeddings, lm_head, predictors, KV cache)
  + sum_l hot_l * neuron_bytes[l]  <=  budget.

Why the algorithm is optimal:
  * Within a layer every neuron costs the same bytes (its gate, up and down rows, plus its up bias),
    so an optimal hot set is always a prefix of the layer's neurons sorted by decreasing frequency
    (exchange argument: swapping a hot neuron for a more frequent cold one of the same layer costs
    no bytes and never lowers the objective).
  * With equal neuron bytes across layers (the usual case: one dtype for the whole model) the budget
    is a number of neurons K, and the objective is a sum of K item values: taking the K most
    frequent neurons over all layers is exact. PowerInfer states this as an ILP; with equal costs
    its optimum is this sort.
  * With unequal neuron bytes (e.g. per-layer dtypes) the problem is a knapsack whose items, per
    layer, form chains of decreasing value at constant cost, so value per byte also decreases along
    each chain. Greedy by value per byte (then any remaining item that still fits) is optimal for
    the fractional relaxation and loses at most the value of one neuron against the integer optimum.

Per-layer CPU time (`cold_balance`): the objective minimizes the total expected cold work, but the
layers run one after another and each waits for its own cold part, so one layer with a large cold
share would dominate. The cold expected work of a layer is W_l = neuron_bytes[l] * (sum of its cold
neurons' frequencies), the bytes the host reads per token. With cold_balance = b, every layer must
satisfy W_l <= C with C = b * (mean W_l of the unconstrained optimum); if the budget cannot honour
that C, C is raised to the smallest value it can honour (never an error). This fixes a minimum hot
count m_l per layer (the smallest prefix meeting the cap); the remaining budget then goes to the
remaining neurons by the same sort, which is exact for "maximize served activations subject to the
caps" by the argument above. The default b = 2 bounds the slowest layer's host part at twice an
average layer's; it binds only on outlier layers, so when it does not bind the placement is the
unconstrained optimum. None disables the cap.

Budget below the dense parts: a ValueError naming the budget, the bytes needed and the rule (the dense
parts are never offloaded: an explicit error is easier to act on than a silent slowdown).

Mixture-of-experts models (issue 35): the item is an expert instead of a neuron. Every expert of a
layer costs the same bytes (its gate, up and down matrices as a hot expert is held: floats in
models/moe.py `hot_dtype`), its value is its routing frequency (sparsity/expert_profile.py), and
the same algorithm places the most frequently routed experts of every layer; the router, the
shared expert and attention are dense parts. `model_bytes` reports experts in `neuron_bytes` and
`d_ff` (bytes of one expert, experts per layer) for such a model.

`place_layers` is the llama.cpp `-ngl` baseline for FFNs: every dense part on the accelerator as in
hybrid mode, then the whole FFNs of the first k layers, k as large as the same budget allows.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Sequence

import numpy as np

from powerinfer_jax.checkpoint.powerinfer import VRAM_CAPACITY_KEY
from powerinfer_jax.errors import fail
from powerinfer_jax.models.moe import hot_dtype

DEFAULT_COLD_BALANCE = 2.0
PLACEMENT_VERSION = 1  # bump when the algorithm changes: cached placements are then recomputed
_FFN_NEURON = re.compile(r"^layers\.(\d+)\.ffn\.(gate\.weight|up\.weight|up\.bias|down_t\.weight)$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERTS = re.compile(r"^layers\.(\d+)\.ffn\.experts\.")


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """Exact bytes of a model's tensors at their stored dtypes.

    global_dense: tensors outside the layers (embeddings, final norm, lm_head).
    layer_dense[l]: layer l's non-neuron tensors (attention, norms, down bias, predictor) plus its
      KV cache for the run's max_seq_len.
    neuron_bytes[l]: bytes of one FFN neuron of layer l (gate + up + down_t rows, up bias); of
      one expert in a mixture-of-experts model (module docstring).
    d_ff[l]: neurons of layer l; experts, in a mixture-of-experts model.
    """

    global_dense: int
    layer_dense: tuple[int, ...]
    neuron_bytes: tuple[int, ...]
    d_ff: tuple[int, ...]

    @property
    def dense(self) -> int:
        """Every byte that is not an FFN neuron row: always on the accelerator in hybrid mode."""
        return self.global_dense + sum(self.layer_dense)

    @property
    def ffn(self) -> int:
        return sum(b * f for b, f in zip(self.neuron_bytes, self.d_ff))

    @property
    def total(self) -> int:
        return self.dense + self.ffn


def model_bytes(model, *, kv_len: int, kv_dtype=None, batch: int = 1) -> ModelBytes:
    """Bytes of every tensor of a (flax NNX) Transformer, read from shapes and dtypes only.

    kv_len: KV cache slots (the run's max_seq_len); kv_dtype: the cache dtype (default model.dtype).
    A mixture-of-experts model's items are its experts, each charged as a hot expert is held
    (floats in `hot_dtype`) whatever the form they are loaded in (the module docstring).
    """
    from flax import nnx

    c = model.config
    moe = bool(c.n_experts)
    n_layers = c.n_layers
    neuron = [0] * n_layers
    layer = [0] * n_layers
    glob = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value() if hasattr(var, "get_value") else var
        if not hasattr(value, "dtype") or not hasattr(value, "shape"):
            continue
        name = ".".join(str(p) for p in path)
        nbytes = int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize
        if moe and _EXPERTS.match(name):
            continue  # charged below, as the accelerator would hold them
        m = _FFN_NEURON.match(name) if not moe else None
        if m:
            neuron[int(m.group(1))] += nbytes // c.d_ff
            continue
        m = _LAYER.match(name)
        if m:
            layer[int(m.group(1))] += nbytes
        else:
            glob += nbytes
    kv_item = np.dtype(model.dtype if kv_dtype is None else kv_dtype).itemsize
    kv_per_layer = 2 * batch * kv_len * c.n_kv_heads * c.head_dim * kv_item
    units = c.d_ff
    if moe:
        neuron = [3 * c.d_ff * c.d_model * np.dtype(hot_dtype(model.dtype)).itemsize] * n_layers
        units = c.n_experts
    return ModelBytes(global_dense=glob, layer_dense=tuple(b + kv_per_layer for b in layer),
                      neuron_bytes=tuple(neuron), d_ff=(units,) * n_layers)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per layer: the hot count and the permutation putting hot neurons first.

    order[l][j] is the original index of the neuron stored at row j after the permutation; rows
    [0, hot[l]) are hot (accelerator), rows [hot[l], d_ff[l]) cold (host).
    """

    mode: str  # "hybrid" | "layers"
    budget_bytes: int
    hot: tuple[int, ...]
    order: tuple[tuple[int, ...], ...]
    sizes: ModelBytes
    served_fraction: float  # expected active neurons on the accelerator / all expected active
    cold_cap: float | None = None  # the per-layer cold-work cap used (bytes per token), if any

    @property
    def n_layers(self) -> int:
        return len(self.hot)

    @property
    def device_bytes(self) -> int:
        s = self.sizes
        return s.dense + sum(h * b for h, b in zip(self.hot, s.neuron_bytes))

    @property
    def host_bytes(self) -> int:
        return self.sizes.total - self.device_bytes

    def hot_fraction(self) -> tuple[float, ...]:
        return tuple(h / f for h, f in zip(self.hot, self.sizes.d_ff))

    def summary(self) -> dict:
        """JSON-friendly report (bench --json)."""
        return {"mode": self.mode, "budget_bytes": self.budget_bytes,
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
                "hot_fraction": [round(x, 4) for x in self.hot_fraction()],
                "served_fraction": round(self.served_fraction, 4),
                "cold_cap_bytes": self.cold_cap}


def _check_inputs(frequency, sizes: ModelBytes, budget_bytes) -> list[np.ndarray]:
    if not isinstance(budget_bytes, (int, np.integer)) or isinstance(budget_bytes, bool) \
            or budget_bytes < 0:
        raise ValueError(f"placement budget: expected an integer number of bytes >= 0, "
                         f"got {budget_bytes!r}")
    freqs = [np.asarray(f, np.float64) for f in frequency]
    if len(freqs) != len(sizes.d_ff):
        raise ValueError(f"placement frequency: expected {len(sizes.d_ff)} layers, "
                         f"got {len(freqs)}")
    for l, (f, n) in enumerate(zip(freqs, sizes.d_ff)):
        if f.shape != (n,) or not np.all(np.isfinite(f)) or np.any(f < 0):
            raise ValueError(f"placement frequency[{l}]: expected {n} finite values >= 0, got "
                             f"shape {f.shape}")
    return freqs


def _dense_error(budget: int, needed: int, what: str) -> ValueError:
    gib = 1 << 30
    return ValueError(
        f"vram_budget: expected at least {needed} bytes ({needed / gib:.3f} GiB) to hold {what} "
        f"on the accelerator before any FFN neuron, got {budget} bytes ({budget / gib:.3f} GiB) "
        f"(rule: dense parts are never offloaded; raise the budget or lower max_seq_len)")


def place_neurons(frequency: Sequence[np.ndarray], sizes: ModelBytes, budget_bytes: int, *,
                  cold_balance: float | None = DEFAULT_COLD_BALANCE) -> Placement:
    """The hybrid placement (see the module docstring for the algorithm and why it is optimal).

    frequency: per layer [F_l] activation frequencies (any non-negative scores: expected activity).
    """
    freqs = _check_inputs(frequency, sizes, budget_bytes)
    if cold_balance is not None and not cold_balance >= 1.0:
        raise ValueError(f"cold_balance: expected None or a float >= 1, got {cold_balance!r}")
    if budget_bytes < sizes.dense:
        raise _dense_error(int(budget_bytes), sizes.dense,
                           "the dense parts (attention, norms, embeddings, lm_head, predictors, "
                           "KV cache)")
    ffn_budget = int(budget_bytes) - sizes.dense
    nb = np.asarray(sizes.neuron_bytes, np.int64)
    # Stable sort: equal frequencies keep index order, so the result is deterministic.
    orders = [np.argsort(-f, kind="stable") for f in freqs]
    sorted_f = [f[o] for f, o in zip(freqs, orders)]
    cums = [np.concatenate([[0.0], np.cumsum(s)]) for s in sorted_f]  # [F_l + 1] hot mass
    n_layers = len(freqs)

    def greedy(minima: np.ndarray) -> np.ndarray | None:
        """Hot counts: the forced minima, then the best remaining neurons that fit."""
        used = int(np.dot(minima, nb))
        if used > ffn_budget:
            return None
        hot = minima.copy()
        vals, costs, layers, ranks = [], [], [], []
        for l in range(n_layers):
            rest = sorted_f[l][minima[l]:]
            vals.append(rest / max(int(nb[l]), 1))
            costs.append(np.full(rest.size, nb[l]))
            layers.append(np.full(rest.size, l))
            ranks.append(np.arange(minima[l], minima[l] + rest.size))
        vals, costs, layers, ranks = (np.concatenate(a) for a in (vals, costs, layers, ranks))
        pick = np.lexsort((ranks, layers, -vals))  # by value per byte, ties by (layer, rank)
        cum = np.cumsum(costs[pick])
        n_fit = int(np.searchsorted(cum, ffn_budget - used, side="right"))
        np.add.at(hot, layers[pick[:n_fit]], 1)
        left = ffn_budget - used - (int(cum[n_fit - 1]) if n_fit else 0)
        # Unequal neuron bytes only: later items that still fit (each layer stays a prefix, as a
        # layer's items all cost the same and come in rank order).
        if n_fit < pick.size and left >= int(nb.min(initial=left + 1)):
            for j in pick[n_fit:]:
                l = layers[j]
                if costs[j] <= left and ranks[j] == hot[l]:
                    hot[l] += 1
                    left -= int(costs[j])
        return hot

    zeros = np.zeros(n_layers, np.int64)
    hot = greedy(zeros)
    cap = None
    if cold_balance is not None and n_layers > 1:
        hot, cap = _balance_cold(hot, cums, nb, cold_balance, greedy)
    return _make(freqs, orders, hot, sizes, int(budget_bytes), "hybrid", cap)


def _cold_work(cums, nb, hot) -> np.ndarray:
    return np.array([nb[l] * (c[-1] - c[h]) for l, (c, h) in enumerate(zip(cums, hot))])


def _minima(cums, nb, cap: float) -> np.ndarray:
    """Smallest hot prefix per layer whose cold work is <= cap."""
    out = []
    for l, c in enumerate(cums):
        need = c[-1] - cap / max(int(nb[l]), 1)  # hot mass needed
        tol = 1e-12 * max(c[-1], 1.0)
        out.append(0 if need <= tol else min(int(np.searchsorted(c, need - tol, side="left")),
                                             c.size - 1))
    return np.asarray(out, np.int64)


def _balance_cold(hot, cums, nb, balance: float, greedy):
    """Impose W_l <= C (module docstring); raise C to the smallest feasible value if needed."""
    work = _cold_work(cums, nb, hot)
    if work.max() <= 0:
        return hot, None
    cap = balance * float(work.mean())
    if work.max() <= cap:
        return hot, cap  # the unconstrained optimum already honours the cap
    result = greedy(_minima(cums, nb, cap))
    if result is not None:
        return result, cap
    # Candidate caps: every achievable per-layer cold work above `cap`; feasibility is monotone.
    cands = np.unique(np.concatenate([nb[l] * (c[-1] - c) for l, c in enumerate(cums)]))
    cands = cands[cands > cap]
    lo, hi = 0, cands.size - 1  # cands[-1] = the largest W_l(0): minima all zero, feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(_minima(cums, nb, float(cands[mid]))) is None:
            lo = mid + 1
        else:
            hi = mid
    cap = float(cands[lo])
    return greedy(_minima(cums, nb, cap)), cap


def _make(freqs, orders, hot, sizes, budget, mode, cap) -> Placement:
    total = sum(float(f.sum()) for f in freqs)
    served = sum(float(f[o[:h]].sum()) for f, o, h in zip(freqs, orders, hot))
    return Placement(mode=mode, budget_bytes=budget, hot=tuple(int(h) for h in hot),
                     order=tuple(tuple(int(i) for i in o) for o in orders), sizes=sizes,
                     served_fraction=served / total if total > 0 else 0.0, cold_cap=cap)


def place_layers(frequency: Sequence[np.ndarray] | None, sizes: ModelBytes,
                 budget_bytes: int) -> Placement:
    """The `--offload layers` baseline: the FFNs of the first k layers on the accelerator, k maximal.

    Like llama.cpp's -ngl, but only the FFNs move: this engine keeps every layer's attention,
    norms and KV cache on the accelerator (it has no host attention), so those dense parts are
    charged first, as in hybrid mode, and k whole FFNs fill what is left. The two modes then hold
    the same bytes on the device for the same budget, and differ only in which FFN rows: whole
    layers here, the most frequently active neurons of every layer in hybrid mode. Neurons keep
    their order (no permutation).
    """
    if frequency is None:
        frequency = [np.ones(f) for f in sizes.d_ff]
    freqs = _check_inputs(frequency, sizes, budget_bytes)
    if budget_bytes < sizes.dense:
        raise _dense_error(int(budget_bytes), sizes.dense,
                           "the dense parts (attention, norms, embeddings, lm_head, predictors, "
                           "KV cache)")
    left = int(budget_bytes) - sizes.dense
    k = 0
    for l in range(len(sizes.d_ff)):
        ffn = sizes.neuron_bytes[l] * sizes.d_ff[l]
        if ffn > left:
            break
        left -= ffn
        k += 1
    hot = [f if l < k else 0 for l, f in enumerate(sizes.d_ff)]
    orders = [np.arange(f) for f in sizes.d_ff]
    return _make(freqs, orders, hot, sizes, int(budget_bytes), "layers", None)


def place(mode: str, frequency, sizes: ModelBytes, budget_bytes: int, **kwargs) -> Placement:
    if mode == "hybrid":
        return place_neurons(frequency, sizes, budget_bytes, **kwargs)
    if mode == "layers":
        return place_layers(frequency, sizes, budget_bytes)
    raise ValueError(f"offload: expected one of ['hybrid', 'layers'], got {mode!r}")


# ------------------------------------------------------------------------------------------------
# Cache keys and serialization (the placement cache's I/O lives in runtime/vram_budget.py)
# ------------------------------------------------------------------------------------------------

def stats_fingerprint(frequency: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for f in frequency:
        a = np.ascontiguousarray(np.asarray(f, np.float64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def cache_key(*, model_fingerprint, mode: str, budget_bytes: int, sizes: ModelBytes,
              stats: str, cold_balance: float | None) -> str:
    """Everything a placement depends on; any change gives a new key (a stale entry is unused)."""
    blob = json.dumps({"version": PLACEMENT_VERSION, "model": model_fingerprint, "mode": mode,
                       "budget": int(budget_bytes), "sizes": dataclasses.asdict(sizes),
                       "stats": stats, "cold_balance": cold_balance}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def to_json(p: Placement) -> dict:
    d = dataclasses.asdict(p)
    d["order"] = [list(o) for o in p.order]
    return d


def from_json(d: dict) -> Placement:
    s = d["sizes"]
    sizes = ModelBytes(global_dense=int(s["global_dense"]),
                       layer_dense=tuple(int(x) for x in s["layer_dense"]),
                       neuron_bytes=tuple(int(x) for x in s["neuron_bytes"]),
                       d_ff=tuple(int(x) for x in s["d_ff"]))
    return Placement(mode=d["mode"], budget_bytes=int(d["budget_bytes"]),
                     hot=tuple(int(h) for h in d["hot"]),
                     order=tuple(tuple(int(i) for i in o) for o in d["order"]), sizes=sizes,
                     served_fraction=float(d["served_fraction"]), cold_cap=d.get("cold_cap"))


def from_gpu_index(index, sizes: ModelBytes, budget_bytes: int,
                   frequency: Sequence[np.ndarray] | None = None) -> Placement:
    """A PowerInfer `.gpuidx` (checkpoint.powerinfer.GpuIndex) as a Placement: per layer its GPU
    neurons first (in index order), then the others. sizes: `model_bytes(model, ...)` of the
    model it is applied to. A budget the index's own capacity exceeds, or a placement whose bytes
    exceed the budget, is an error (the index was made for another budget)."""
    if tuple(sizes.d_ff) != index.d_ff:
        fail(f"{index.source}: neurons per layer", f"the model's {list(sizes.d_ff)}",
             list(index.d_ff), "the index belongs to another model")
    if index.vram_capacity > budget_bytes:
        fail(f"{index.source}: {VRAM_CAPACITY_KEY}", f"<= the budget ({budget_bytes} bytes)",
             index.vram_capacity, "the index was made for a larger budget: regenerate it")
    orders = []
    for hot, f in zip(index.hot, index.d_ff):
        cold = np.setdiff1d(np.arange(f), hot, assume_unique=True)
        orders.append(tuple(int(i) for i in np.concatenate([hot, cold])))
    freqs = frequency if frequency is not None else [np.ones(f) for f in index.d_ff]
    total = sum(float(np.sum(f)) for f in freqs)
    served = sum(float(np.sum(np.asarray(f)[h])) for f, h in zip(freqs, index.hot))
    p = Placement(mode="hybrid", budget_bytes=int(budget_bytes),
                  hot=tuple(len(h) for h in index.hot), order=tuple(orders), sizes=sizes,
                  served_fraction=served / total if total > 0 else 0.0)
    if p.device_bytes > budget_bytes:
        fail(f"{index.source}: GPU neurons", f"fitting the budget ({budget_bytes} bytes) with "
             f"the model's dense parts ({sizes.dense} bytes)", f"{p.device_bytes} bytes",
             "the index was made for another budget or model: regenerate it")
    return p
