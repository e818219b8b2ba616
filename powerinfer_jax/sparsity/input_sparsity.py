"""Input sparsity: the training-free sparsity of stock SwiGLU/GeGLU models (TEAL, arXiv 2408.14690;
WINA, 2505.19427). Every matrix of a block reads one of four inputs (its "site"):
  attn_in   the normed hidden state q, k and v read        attn_out  the heads' output o reads
  ffn_in    the normed hidden state gate and up read        ffn_mid   the activations down reads
A site's input channel j is zeroed for a token where its score is below the site's threshold, and
a matrix in the columns layout (models/qweights.py) then reads none of that channel's weights:
  magnitude  score |x_j| (TEAL's rule)
  weighted   score |x_j| * ||W[:, j]|| (WINA's rule; W: the site's matrices stacked, one norm
             per input channel), i.e. a per-channel threshold tau / ||W[:, j]||.
Calibration (`calibrate`) runs the dense model over calibration text and keeps each site's inputs;
per site the error of dropping the channels below each candidate threshold is estimated as the
dropped share of the input's energy (sum of score^2), and the sparsity of every site is chosen
greedily for a model-wide target: repeatedly the site whose next step adds the least error per
byte it saves (TEAL's per-layer greedy allocation, on all four sites of every layer at once).
"Model-wide sparsity" is the share of the blocks' matrix bytes skipped (the embedding and the LM
head are read whole). In an MoE layer (models/moe.py) ffn_in is the routed experts' (and a shared
expert's) gate and up input, the router reading it whole; ffn_mid is each routed expert's own
down input, with a threshold per expert and neuron ([E, F]); a site's bytes are what one token
reads (its n_used routed experts of E). Thresholds are saved beside the other sparsity
artifacts, tied to the model file by its fingerprint; a lossy mode runs only with a target the
user gives.
"""
from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import numpy as np

from powerinfer_jax import cache, errors
from powerinfer_jax.sparsity import corpus as corpus_mod

RULES = ("magnitude", "weighted")
SITES = ("attn_in", "attn_out", "ffn_in", "ffn_mid")
GRID = np.round(np.arange(0.0, 0.951, 0.025), 3)  # the sparsities a site may take
FORMAT_VERSION = 1
DEFAULT_SAMPLE_TOKENS = 2048  # calibration tokens kept per site (a site's inputs [N, d])
DEFAULT_CTX = 256
# calibration chunks whose loss steers the allocation; 12 (3x the tokens, 2.3x the time) were
# measured on SmolLM2: 1.003x / 1.125x dense perplexity at 25% / 40% against 1.007x / 1.113x
# (results/input_sparsity_allocation.jsonl): no better where it matters, so 4 stay
LOSS_CHUNKS = 4
# grid steps a unit moves per round (0.05 sparsity); 1 step (0.025) was measured on SmolLM2 at
# 1.008x / 1.172x dense perplexity at 25% / 40% (results/input_sparsity_allocation.jsonl): the
# finer path follows the calibration chunks' noise, so 2 stay
LOSS_STEP = 2
# The loss-guided allocation's groups of consecutive layers, each with its own sparsities: one
# (a sparsity per site kind for every layer). The path's evaluations grow with the square of the
# units (each step tries every unit; the steps to a target grow with them too). Measured on
# SmolLM2 (results/input_sparsity_allocation.jsonl): 3 groups took 6.3x the time of 1 and were
# worse on wiki.valid, 1.036x / 1.225x dense perplexity at 25% / 40% against 1.007x / 1.113x:
# twelve units fitted to LOSS_CHUNKS calibration chunks do not carry to other text.
LAYER_GROUPS = 1


@dataclasses.dataclass(frozen=True)
class InputThresholds:
    """A model's calibrated input sparsity: per layer and site the threshold of every input
    channel (float32 [d]), the site's calibrated sparsity and its matrices' bytes."""

    rule: str
    target: float
    thresholds: tuple[dict, ...]  # per layer {site: float32 [d]}
    sparsity: tuple[dict, ...]  # per layer {site: float}
    site_bytes: tuple[dict, ...]  # per layer {site: int}

    def model_sparsity(self, measured: list[dict] | None = None) -> float:
        """Bytes-weighted sparsity of the blocks' matrices: calibrated, or `measured` per layer
        {site: fraction of channels zeroed}."""
        per = measured if measured is not None else self.sparsity
        total = sum(b for layer in self.site_bytes for b in layer.values())
        skipped = sum(self.site_bytes[l][s] * per[l][s] for l in range(len(per)) for s in per[l])
        return skipped / total if total else 0.0


# ------------------------------------------------------------------------- the model's sites
def _is_moe(layer) -> bool:
    from powerinfer_jax.models.moe import MoE  # lazy: start-up

    return isinstance(layer.ffn, MoE)


def site_matrices(layer) -> dict[str, list]:
    """The modules (models/layers.py Linear, models/ffn.py DownT, models/moe.py Stacked) reading
    each site's input."""
    attn, ffn = layer.attn, layer.ffn
    if _is_moe(layer):
        x = ffn.experts
        shared = [] if ffn.shared is None else [ffn.shared.gate, ffn.shared.up]
        return {"attn_in": [attn.q, attn.k, attn.v], "attn_out": [attn.o],
                "ffn_in": [x.gate, x.up] + shared, "ffn_mid": [x.down_t]}
    return {"attn_in": [attn.q, attn.k, attn.v], "attn_out": [attn.o],
            "ffn_in": [m for m in (ffn.gate, ffn.up) if m is not None], "ffn_mid": [ffn.down_t]}


def check_model(model) -> None:
    """Input sparsity needs dense FFNs or MoE layers whose experts are in memory, unplaced."""
    from powerinfer_jax.models.ffn import FFN  # lazy: start-up
    from powerinfer_jax.models.moe import MoE  # lazy: start-up

    kinds = {isinstance(layer.ffn, MoE) for layer in model.layers}
    if len(kinds) > 1:  # collect_inputs takes the sown down inputs of all layers or none
        errors.fail("input sparsity", "every layer's FFN dense, or every one an MoE layer",
                    "a model mixing the two")
    for i, layer in enumerate(model.layers):
        ffn = layer.ffn
        if isinstance(ffn, MoE):
            if ffn.placed or ffn.on_disk is not None or ffn.expert_axis is not None:
                errors.fail(f"input sparsity, layer {i}", "experts in memory on one device",
                            "placed, offloaded or split experts",
                            "run without --vram-budget / --ram-budget / an expert mesh")
        elif not isinstance(ffn, FFN):
            errors.fail(f"input sparsity, layer {i}", "a dense FFN or an MoE layer",
                        type(ffn).__name__)


def _weight(m):
    return np.asarray(m.weight[...])


def matrix_bytes(m, share: float = 1.0) -> int:
    """A matrix's bytes; `share` of them for stacked experts (n_used / E: what a token reads)."""
    return int(_weight(m).nbytes * share)


def _share(layer, m) -> float:
    """The share of matrix m one token reads: n_used / E of a layer's stacked experts, else 1."""
    from powerinfer_jax.models.moe import Stacked  # lazy: start-up

    return layer.ffn.n_used / layer.ffn.n_experts if isinstance(m, Stacked) else 1.0


WHOLE = "whole"  # site_bytes' key for a block's matrices outside every site (read whole)


def whole_matrices(layer) -> list:
    """A block's matrices every token reads whole, outside the sites: an MoE layer's router and
    a shared expert's gate scalar and down projection (its input has no mask)."""
    if not _is_moe(layer):
        return []
    moe = layer.ffn
    extra = [] if moe.shared is None else [moe.shared_gate, moe.shared.down_t]
    return [moe.router] + extra


def site_bytes(layer) -> dict[str, int]:
    """Per site the matrix bytes one token reads (dense), and under WHOLE those of the block's
    matrices outside every site: part of the model-wide total, never skipped."""
    out = {s: sum(matrix_bytes(m, _share(layer, m)) for m in mats)
           for s, mats in site_matrices(layer).items()}
    out[WHOLE] = sum(matrix_bytes(m) for m in whole_matrices(layer))
    return out


def column_sq_norms(m, d_in: int) -> np.ndarray:
    """Sum over the rows of W[:, j]^2 for each input channel j of one matrix (float64 [d_in])."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.models.ffn import DownT  # lazy: start-up

    w = _weight(m)
    if m.qtype is None:  # floats: Linear [O, I]; DownT stores down transposed [F, D]
        w = w.astype(np.float64)
        return (w * w).sum(axis=1) if isinstance(m, DownT) else (w * w).sum(axis=0)
    name = m.qweight.kernel_qtype
    if quants.columns_base(name) is not None:
        f = quants.columns_to_float(w, name, d_in)
    else:  # the file's rows, or interleaved by 16 (dequantize reads both)
        f = quants.dequantize(w, name)
    f = np.asarray(f, np.float64)
    return (f * f).sum(axis=0)


def site_sq_norms(layer, site: str) -> np.ndarray:
    """Sum over a site's matrices and their rows of W[:, j]^2 per input channel: float64 of the
    site's threshold shape (an MoE layer's experts: gate/up summed over the experts, down per
    expert and neuron [E, F])."""
    if not _is_moe(layer) or site not in ("ffn_in", "ffn_mid"):
        d = _dims(layer)[site]
        return sum(column_sq_norms(m, d) for m in site_matrices(layer)[site])
    moe = layer.ffn
    mid, total = [], 0.0
    for e in range(moe.n_experts):  # one expert's floats at a time: [1, F, D] each
        gate, up, down_t = (w[0].astype(np.float64) ** 2
                            for w in moe.experts.floats(e, e + 1, np.float32))
        if site == "ffn_mid":
            mid.append(down_t.sum(axis=1))  # [F]
        else:
            total = total + gate.sum(axis=0) + up.sum(axis=0)  # [D]
    if site == "ffn_mid":
        return np.stack(mid)  # [E, F]
    if moe.shared is not None:
        total = total + sum(column_sq_norms(m, moe.experts.d_model)
                            for m in (moe.shared.gate, moe.shared.up))
    return total


def _shapes(layer) -> dict[str, tuple]:
    """Each site's threshold shape: [d] of its input, [E, F] for an MoE layer's ffn_mid."""
    attn, ffn = layer.attn, layer.ffn
    if _is_moe(layer):
        x = ffn.experts
        mid = (ffn.n_experts, x.d_ff)
        ffn_in = x.d_model
    else:
        mid = (ffn.down_t.d_ff,)
        ffn_in = ffn.up.d_in
    return {"attn_in": (attn.q.d_in,), "attn_out": (attn.o.d_in,), "ffn_in": (ffn_in,),
            "ffn_mid": mid}


def _dims(layer) -> dict[str, int]:
    """Each site's input channels (per expert for an MoE layer's ffn_mid)."""
    return {s: shape[-1] for s, shape in _shapes(layer).items()}


def expert_mids(layer, x_nd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An MoE layer's down inputs for tokens x [N, D] (its ffn_in, as the experts read it):
    (h [P, F] for every routed (token, expert) pair, the pair's expert [P]), computed from the
    experts' floats (each routed expert dequantized once)."""
    import jax.numpy as jnp

    from powerinfer_jax.ops.reference import gated_activate  # lazy: start-up

    moe = layer.ffn
    ids = np.asarray(moe.routing(jnp.asarray(x_nd[None], jnp.float32))[0])  # [N, k]
    hs, es = [], []
    for e in np.unique(ids):
        tok = np.nonzero((ids == e).any(axis=1))[0]
        gate, up, _ = moe.experts.floats(int(e), int(e) + 1, np.float32)
        xe = x_nd[tok].astype(np.float32)
        hs.append(np.asarray(gated_activate(moe.activation, jnp.asarray(xe @ gate[0].T),
                                            jnp.asarray(xe @ up[0].T))))
        es.append(np.full(len(tok), e, np.int32))
    return np.concatenate(hs), np.concatenate(es)


# ------------------------------------------------------------------------- masks on the model
def install(model, arts: InputThresholds | None) -> None:
    """Put the thresholds' masks on every layer (None: none, every matrix reads its whole input)."""
    from flax import nnx  # lazy: start-up

    from powerinfer_jax.models.layers import InputMask  # lazy: start-up

    for i, layer in enumerate(model.layers):
        t = None if arts is None else arts.thresholds[i]
        mask = (lambda site: None if t is None else InputMask(t[site], name=site))  # noqa: B023
        layer.attn.in_mask = nnx.data(mask("attn_in"))
        layer.attn.out_mask = nnx.data(mask("attn_out"))
        layer.ffn.in_mask = nnx.data(mask("ffn_in"))
        layer.ffn.mid_mask = nnx.data(mask("ffn_mid"))


def zero_thresholds(model) -> InputThresholds:
    """Thresholds of 0: every channel kept (the dense model through the masks)."""
    shapes = [_shapes(l) for l in model.layers]
    return InputThresholds(
        rule="magnitude", target=0.0,
        thresholds=tuple({s: np.zeros(d[s], np.float32) for s in SITES} for d in shapes),
        sparsity=tuple({s: 0.0 for s in SITES} for _ in shapes),
        site_bytes=tuple(site_bytes(l) for l in model.layers))


# ------------------------------------------------------------------------- calibration
def collect_inputs(model, chunks_nt: np.ndarray, *, sample_tokens: int,
                   progress: bool = False) -> list[dict]:
    """Every layer's site inputs over the token chunks (the dense model): per layer {site: float32
    [N, d]}, N <= sample_tokens tokens spread evenly over the chunks; an MoE layer's ffn_mid
    the routed pairs' down inputs with their experts (expert_mids: ([P, F], [P]))."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.layers import InputSample  # lazy: start-up
    from powerinfer_jax.models.transformer import capture  # lazy: start-up

    check_model(model)  # every FFN dense or every one MoE (no mix)
    n, t = chunks_nt.shape
    keep = max(1, min(t, sample_tokens // max(1, n)))
    idx = np.linspace(1, t - 1, keep).astype(np.int64)  # not the first token (attention sink)
    install(model, zero_thresholds(model))  # every path through the masks: every site sown
    graphdef, state = nnx.split(model)
    moe = _is_moe(model.layers[0])
    # the sown sites: an MoE layer's down inputs are its routed pairs' (expert_mids, below)
    sites = [s for s in SITES if not (moe and s == "ffn_mid")]

    @jax.jit
    def run(state, tokens_bt):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        _, sown = capture(lambda m: m.hidden(tokens_bt, positions), nnx.merge(graphdef, state),
                          kind=InputSample)
        return {s: sown[s][:, 0, idx] for s in sites}  # [L, keep, d]

    parts: dict[str, list] = {s: [] for s in sites}
    for chunk in _bar(chunks_nt, progress, "input sparsity: dense forward"):
        out = run(state, jnp.asarray(chunk[None]))
        for s in sites:
            parts[s].append(np.asarray(out[s], np.float32))
    install(model, None)
    stacked = {s: np.concatenate(parts[s], axis=1) for s in sites}  # [L, N, d]
    per_layer = [{s: stacked[s][l] for s in sites} for l in range(len(model.layers))]
    if moe:
        for layer, got in zip(model.layers, per_layer):
            got["ffn_mid"] = expert_mids(layer, got["ffn_in"])
    return per_layer


def _curve(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(threshold per grid sparsity, dropped energy share per grid sparsity) of a site's scores."""
    flat = np.sort(scores.reshape(-1).astype(np.float64))
    energy = np.cumsum(flat * flat)
    total = energy[-1] if energy[-1] > 0 else 1.0
    k = np.minimum((GRID * flat.size).astype(np.int64), flat.size - 1)
    thr = np.where(GRID > 0, flat[k], 0.0)
    dropped = np.where(k > 0, energy[np.maximum(k - 1, 0)], 0.0) / total
    return thr, dropped


def allocate(curves: list[dict], site_bytes: list[dict], target: float,
             how: str = "greedy") -> list[dict]:
    """Per layer {site: grid index}: greedily the step that adds the least error per byte saved,
    until the bytes-weighted sparsity reaches `target` ("uniform": every site the grid step
    nearest the target)."""
    import heapq

    if how == "uniform":
        i = int(np.argmin(np.abs(GRID - target)))
        return [{s: i for s in layer} for layer in curves]

    total = sum(b for layer in site_bytes for b in layer.values())
    level = [{s: 0 for s in layer} for layer in curves]
    reached = 0.0
    heap = []

    def push(l, s):
        i = level[l][s]
        if i + 1 < len(GRID):
            cost = (curves[l][s][i + 1] - curves[l][s][i]) / (
                site_bytes[l][s] * (GRID[i + 1] - GRID[i]) + 1e-30)
            heapq.heappush(heap, (float(cost), l, s))

    for l, layer in enumerate(curves):
        for s in layer:
            push(l, s)
    while reached < target * total - 1e-9 and heap:
        _, l, s = heapq.heappop(heap)
        i = level[l][s]
        reached += site_bytes[l][s] * (GRID[i + 1] - GRID[i])
        level[l][s] = i + 1
        push(l, s)
    return level


def _channel_thresholds(tau: float, norms: np.ndarray) -> np.ndarray:
    """A site's per-channel thresholds for score threshold tau: tau / ||W[:, j]|| (the weighted
    rule; a zero column's channel always dropped: it adds nothing), tau (magnitude: norms 1)."""
    if tau <= 0:
        return np.zeros(norms.shape, np.float32)
    with np.errstate(divide="ignore"):
        return np.where(norms > 0, tau / norms, np.inf).astype(np.float32)


def _group(layer: int, n_layers: int) -> int:
    """Which of LAYER_GROUPS consecutive groups of layers `layer` is in."""
    return layer * LAYER_GROUPS // n_layers


def loss_path(model, chunks_nt: np.ndarray, thr_grid: list[dict], norms: list[dict],
              site_bytes: list[dict], target: float, step: int = 2) -> list[tuple[float, dict]]:
    """The greedy path of one sparsity per site kind and group of layers (LAYER_GROUPS groups of
    consecutive layers), chosen on the model's own loss: from all-dense, each round tries one
    more `step` of each unit's sparsity (the per-layer quantiles of its inputs) and keeps the one
    whose next-token loss on the calibration chunks grows least per byte it saves, until the
    bytes-weighted sparsity reaches `target`. Returns [(model-wide sparsity, {(site, group):
    grid index})] from dense on; every target up to `target` takes its allocation from the one
    path. The masks' thresholds are state of one compiled forward: no recompile."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    n_layers = len(model.layers)
    install(model, zero_thresholds(model))
    graphdef, _ = nnx.split(model)

    @jax.jit
    def nll(state, tokens_bt):
        logits = nnx.merge(graphdef, state)(tokens_bt)
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, tokens_bt[:, 1:, None], axis=-1).mean()

    tokens = jnp.asarray(chunks_nt)

    def loss(levels: dict) -> float:
        for l, layer in enumerate(model.layers):
            g = _group(l, n_layers)
            for s, mask in (("attn_in", layer.attn.in_mask), ("attn_out", layer.attn.out_mask),
                            ("ffn_in", layer.ffn.in_mask), ("ffn_mid", layer.ffn.mid_mask)):
                mask.threshold.set_value(jnp.asarray(_channel_thresholds(
                    float(thr_grid[l][s][levels[(s, g)]]), norms[l][s])))
        return float(nll(nnx.state(model), tokens))

    units = sorted({(s, _group(l, n_layers)) for l in range(n_layers) for s in SITES})
    unit_bytes = {u: sum(site_bytes[l][u[0]] for l in range(n_layers)
                         if _group(l, n_layers) == u[1]) for u in units}
    total = sum(unit_bytes.values()) + sum(b.get(WHOLE, 0) for b in site_bytes)
    levels = {u: 0 for u in units}
    reached = lambda lv: sum(unit_bytes[u] * GRID[lv[u]] for u in units) / total  # noqa: E731
    path = [(0.0, dict(levels))]
    current = loss(levels)
    while reached(levels) < target - 1e-9:
        best = None
        for u in units:
            if levels[u] + step >= len(GRID):
                continue
            trial = {**levels, u: levels[u] + step}
            got = loss(trial)
            per_byte = (got - current) / (unit_bytes[u] * (GRID[trial[u]] - GRID[levels[u]]))
            if best is None or per_byte < best[0]:
                best = (per_byte, u, got)
        if best is None:
            break
        levels[best[1]] += step
        current = best[2]
        path.append((reached(levels), dict(levels)))
    install(model, None)
    return path


def _from_path(path: list[tuple[float, dict]], target: float, n_layers: int) -> list[dict]:
    """Per layer {site: grid index}: the first allocation on the path that reaches the target
    (the last one if none does)."""
    levels = next((lv for reached, lv in path if reached >= target - 1e-9), path[-1][1])
    return [{s: levels[(s, _group(l, n_layers))] for s in SITES} for l in range(n_layers)]


def _scores(x, norms: np.ndarray) -> np.ndarray:
    """A site's scores |x_j| * norm_j: x [N, d] with norms [d], or an MoE layer's down inputs
    (h [P, F], experts [P]) with norms [E, F] (each pair its expert's)."""
    if isinstance(x, tuple):
        h, experts = x
        return np.abs(h) * norms[experts]
    return np.abs(x) * norms[None, :]


def _site_curves(model, inputs: list[dict], rule: str):
    """Per layer: the sites' matrix bytes, dropped-energy curves and score thresholds over GRID,
    and the per-channel norms of the rule's score (ones for magnitude)."""
    site_bytes_, curves, thr_grid, norms = [], [], [], []
    for layer, x in zip(model.layers, inputs):
        shapes = _shapes(layer)
        site_bytes_.append(site_bytes(layer))
        n = {s: (np.sqrt(site_sq_norms(layer, s)) if rule == "weighted" else np.ones(shapes[s]))
             for s in SITES}
        norms.append(n)
        per_thr, per_curve = {}, {}
        for s in SITES:
            per_thr[s], per_curve[s] = _curve(_scores(x[s], n[s]))
        thr_grid.append(per_thr)
        curves.append(per_curve)
    return site_bytes_, curves, thr_grid, norms


def allocation_path(model, chunks_nt: np.ndarray, *, rule: str, target: float,
                    inputs: list[dict]) -> list:
    """The loss-guided allocation path (`loss_path`) of `rule` up to `target`, for `calibrate`'s
    `path` when several targets share one calibration."""
    site_bytes, _, thr_grid, norms = _site_curves(model, inputs, rule)
    return loss_path(model, chunks_nt[:LOSS_CHUNKS], thr_grid, norms, site_bytes, target,
                     LOSS_STEP)


def calibrate(model, chunks_nt: np.ndarray, *, rule: str, target: float,
              sample_tokens: int = DEFAULT_SAMPLE_TOKENS, progress: bool = False,
              inputs: list[dict] | None = None, how: str = "loss",
              loss_chunks: np.ndarray | None = None, path: list | None = None
              ) -> InputThresholds:
    """Thresholds for `rule` at model-wide sparsity `target` from the dense model's inputs over
    the calibration chunks (or `inputs`, collect_inputs' result, to calibrate several targets).
    how: "loss" (loss_path: one sparsity per site kind, chosen on the model's loss over
    `loss_chunks`, default the first LOSS_CHUNKS calibration chunks; `path` a loss_path computed
    before, for several targets), "greedy" (every site on its own, the least dropped input
    energy per byte: measured worse than uniform on SmolLM2), "uniform" (every site at the
    target)."""
    errors.check_choice("allocation", how, ("loss", "greedy", "uniform"))
    errors.check_choice("input sparsity rule", rule, RULES)
    errors.check(isinstance(target, float) and 0.0 <= target < 1.0, "target_sparsity",
                 "a float in [0, 1)", target)
    check_model(model)
    if inputs is None:
        inputs = collect_inputs(model, chunks_nt, sample_tokens=sample_tokens, progress=progress)
    site_bytes, curves, thr_grid, norms = _site_curves(model, inputs, rule)
    if how == "loss":
        if path is None:
            chunks = loss_chunks if loss_chunks is not None else chunks_nt[:LOSS_CHUNKS]
            path = loss_path(model, chunks, thr_grid, norms, site_bytes, target, LOSS_STEP)
        level = _from_path(path, target, len(inputs))
    else:
        level = allocate(curves, site_bytes, target, how)
    thresholds, sparsity = [], []
    for l in range(len(inputs)):
        t, sp = {}, {}
        for s in SITES:
            sp[s] = float(GRID[level[l][s]])
            t[s] = _channel_thresholds(float(thr_grid[l][s][level[l][s]]), norms[l][s])
        thresholds.append(t)
        sparsity.append(sp)
    return InputThresholds(rule, float(target), tuple(thresholds), tuple(sparsity),
                           tuple(site_bytes))


def measure(model, arts: InputThresholds, chunks_nt: np.ndarray) -> list[dict]:
    """Per layer {site: fraction of input channels zeroed} with `arts` installed (and left
    installed), over the token chunks (the masks' own counts)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.transformer import capture  # lazy: start-up

    install(model, arts)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens_bt):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        _, sown = capture(lambda m: m.hidden(tokens_bt, positions), nnx.merge(graphdef, state))
        return {s: sown[f"{s}_active"].astype(jnp.float32).mean(axis=(1, 2)) for s in SITES}

    got = [np.asarray(run(state, jnp.asarray(c[None]))[s]) for c in chunks_nt for s in SITES]
    per = np.asarray(got).reshape(len(chunks_nt), len(SITES), -1).mean(axis=0)  # [site, L]
    dims = [_dims(l) for l in model.layers]
    return [{s: float(1.0 - per[i, l] / dims[l][s]) for i, s in enumerate(SITES)}
            for l in range(len(model.layers))]


def bytes_per_token(model, measured: list[dict] | None) -> int:
    """Weight bytes one decode token reads in the columns layout: each block matrix's scale
    planes and the codes of its input's nonzero channels (`measured` per layer {site: zeroed
    fraction}; None: dense), a matrix with no columns layout and those outside every site
    (WHOLE) whole, n_used of an MoE layer's experts, plus the LM head and one embedding row.
    The same figure whether `model` was built dense or in the columns layout (relu experts in
    down groups are counted whole)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    total = 0
    for l, layer in enumerate(model.layers):
        dims = _dims(layer)
        total += site_bytes(layer)[WHOLE]
        for s, mats in site_matrices(layer).items():
            zeroed = 0.0 if measured is None else measured[l][s]
            for m in mats:
                w = _weight(m)
                share = _share(layer, m)  # stacked experts: n_used of them read, each whole
                rows = w.shape[-2]
                base = None if m.qtype is None else quants.arrangement(m.qtype)[0]
                if base is None or not quants.can_columns(base, rows, dims[s]) or \
                        (w.ndim == 3 and m.layout == "groups"):
                    total += int(w.nbytes * share)
                    continue
                block, _, head, wide = quants._COLUMNS_FORMATS[base]
                codes = block * (rows if wide else rows // 2)
                one = dims[s] // block * (head * rows + codes * (1.0 - zeroed))
                total += int(one * (share * w.shape[0] if w.ndim == 3 else 1))
    head = model.lm_head.weight[...] if model.lm_head is not None else model.tok_embed[...]
    embed = model.tok_embed[...]
    return int(total + np.asarray(head).nbytes + np.asarray(embed).nbytes // embed.shape[0])


# ------------------------------------------------------------------------- files
def artifact_path(root: Path, rule: str, target: float) -> Path:
    return Path(root) / "input_sparsity" / f"{rule}_{target:.3f}.npz"


def save(path: Path, arts: InputThresholds, fingerprint: dict) -> None:
    """Write the thresholds with their model's fingerprint (an atomic write)."""
    meta = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "rule": arts.rule,
            "target": arts.target, "sparsity": list(arts.sparsity),
            "site_bytes": list(arts.site_bytes)}
    arrays = {f"{l}.{s}": t[s] for l, t in enumerate(arts.thresholds) for s in SITES}
    path.parent.mkdir(parents=True, exist_ok=True)
    with cache.atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def load(path: Path, fingerprint: dict, model) -> InputThresholds:
    """The thresholds at `path`, checked against the model: a file of another model, another
    shape, or a truncated or corrupt file is a one-line UserError naming it."""
    def bad(rule: str, got) -> None:
        errors.fail(f"input sparsity thresholds {path}", rule, got,
                    "delete the file to calibrate again")

    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k: np.asarray(z[k]) for k in z.files if k != "meta"}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        bad("a readable thresholds file", f"{type(e).__name__}: {e}")
    if meta.get("format") != FORMAT_VERSION:
        bad(f"format {FORMAT_VERSION}", meta.get("format"))
    if meta.get("fingerprint") != fingerprint:
        bad("thresholds calibrated for this model file (its fingerprint)",
            "another model's or another file's")
    shapes = [_shapes(l) for l in model.layers]
    thresholds = []
    for l, d in enumerate(shapes):
        t = {}
        for s in SITES:
            a = arrays.get(f"{l}.{s}")
            if a is None or a.shape != d[s] or a.dtype != np.float32 or np.isnan(a).any() \
                    or (a < 0).any():
                bad(f"layer {l} {s}: float32 {list(d[s])} >= 0", None if a is None else
                    f"{a.dtype} {a.shape}")
            t[s] = a
        thresholds.append(t)
    return InputThresholds(meta["rule"], float(meta["target"]), tuple(thresholds),
                           tuple(meta["sparsity"]), tuple(meta["site_bytes"]))


def ensure(model, tokenizer, *, rule: str, target: float, root: Path, fingerprint: dict,
           corpus_files=None, ctx: int | None = None, sample_tokens: int | None = None,
           progress: bool = False) -> InputThresholds:
    """The calibrated thresholds for (rule, target): loaded when saved for this model, else
    calibrated on the corpus (default: the calibration text, never the validation text) and
    saved."""
    path = artifact_path(root, rule, target)
    with cache.lock(path, what="input sparsity thresholds"):
        if path.is_file():
            try:
                return load(path, fingerprint, model)
            except errors.UserError as e:
                cache.note(f"{e}; calibrating again")
        ctx = DEFAULT_CTX if ctx is None else ctx
        sample_tokens = DEFAULT_SAMPLE_TOKENS if sample_tokens is None else sample_tokens
        text = corpus_mod.read_corpus(corpus_files or corpus_mod.default_corpus_files())
        ids = tokenizer.encode(text[:(sample_tokens * 4 + ctx) * 16])  # ~4 characters a token
        chunks = corpus_mod.corpus_chunks(ids, ctx, max_tokens=max(sample_tokens * 4, ctx))
        arts = calibrate(model, chunks, rule=rule, target=target, sample_tokens=sample_tokens,
                         progress=progress)
        save(path, arts, fingerprint)
        return arts


def _bar(it, progress: bool, desc: str):
    if not progress:
        return it
    from tqdm import tqdm  # lazy: start-up

    return tqdm(it, desc=desc, unit="chunk", leave=False)
