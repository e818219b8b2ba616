"""The mixture-of-experts FFN: a router picks `n_used` of `n_experts` gated FFNs per token.

  p = softmax(router . x)                         [N, E]  (float32, as transformers computes)
  top-k experts by p, weights w = p[top]          [N, k]  (/ sum w with norm_topk_prob)
  y = sum_j w_j * ffn_{e_j}(x)  (+ sigmoid(shared_gate . x) * shared(x): Qwen2-MoE)
  ffn_e(x) = down_t[e]^T (act(gate[e] . x) * (up[e] . x))

Experts are stacked per layer: `experts.gate.weight`, `experts.up.weight`,
`experts.down_t.weight`, each [E, F, D] (down transposed: neuron-major as the dense FFN). The
router is an exact predictor at expert granularity: the routed execution reads only the
routed experts' rows.

Executions (`MoE.execution`, chosen at build, never by a string test per call):
  * "routed" (default): each token's k experts' rows are gathered ([N, k, F, D]: only those
    bytes are read) and computed, up to _MAX_GATHER gathered weights per call; past it (long
    prefills of float experts) every expert runs on every token, each expert read once: XLA
    has no grouped execution on CPU (jax.lax.ragged_dot computes every group against every
    row there: measured by tests/test_moe.py's poisoned experts). Quantized experts run in one
    custom call that groups the tokens by expert (ops.moe_ffn; SiLU experts).
  * "dense": every expert on every token, unrouted ones weighted 0: the reference the routed
    execution is checked against (tests/test_moe.py).
Placement (--vram-budget, runtime/vram_budget.py; issue 35): `permute` reorders the experts hot-first
(their stacked rows and the router's rows: the output is unchanged), `split(n_hot)` keeps experts
[0, n_hot) as floats (`hot`: the accelerator's, computed with XLA; in `hot_dtype`) and leaves the
others in `experts` as they were loaded (a quantized file's blocks: the host pool's custom call,
ops.moe_ffn). Each token's routed experts are split between the two by id, the two partial sums
added; CPU-only the same code runs both parts on the CPU. On an accelerator the cold experts'
blocks leave the model's state for a host-side store (`ColdExperts`, by handle) and each layer's
cold part runs there through one host callback per call (the same custom call, on the CPU, with
the host pool), its partial sum returned to the device.
Input sparsity (sparsity/input_sparsity.py, `in_mask` / `mid_mask`): the experts' (and a shared
expert's) input is masked, the router reading it whole; each expert's down input is zeroed below
its own thresholds ([E, F]) on every path, in the custom call with the experts in the columns
layout (only nonzero input channels read); the kept channels are sown as `ffn_mid_active`.
The router and a shared expert's gate read x whole, its down projection its whole input.
Axis letters: N tokens (B * T flattened), E experts, k routed per token, F expert neurons,
D model.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax import ops
from powerinfer_jax.errors import fail
from powerinfer_jax.models.ffn import FFN, require_residual
from powerinfer_jax.models.layers import (F32, Linear, Module, _param, apply_mask, op_impl,
                                          sow)
from powerinfer_jax.models.qweights import columns, host_blocks, interleaved, kernel_type
from powerinfer_jax.ops.reference import gated_activate

EXECUTIONS = ("routed", "dense")
# Gathered expert weights per call, at most (elements: N * k * F * D); beyond it, XLA runs
# every expert on every token (each expert's rows read once)
_MAX_GATHER = 1 << 24
# (token, expert) pairs a CPU computes one at a time (MoE._pairs), at most: decode steps
_MAX_PAIRS = 32


# How a stacked matrix's blocks are kept (Stacked.layout): "matvec" each expert's rows
# interleaved by 16 where the format allows; "rows" the file's rows (a relu expert's up: only the
# neurons whose gate fires read theirs); "groups" the down projection's down groups (a relu
# expert's down: read per group of 32 neurons with one that fires; quants.down_groups); "columns"
# each expert input-channel-major (qweights.columns: input sparsity reads only the nonzero
# channels of its input), where the format and row count allow, else matvec.
LAYOUTS = ("matvec", "rows", "groups", "columns")


class Stacked(Module):
    """One stacked expert matrix: weight [E, F, D] in floats, or a GGUF file's blocks
    (`qtype` set) in `layout`: gate/up uint8 [E, F, row_bytes(D)], down uint8
    [E, D, row_bytes(F)] or, as groups, [E, F / 32, D * block bytes]."""

    def __init__(self, n_experts: int, d_ff: int, d_model: int, *, dtype, rngs, scale: float,
                 layout: str = "matvec"):
        if layout not in LAYOUTS:
            fail("Stacked layout", f"one of {list(LAYOUTS)}", layout)
        self.weight = _param((n_experts, d_ff, d_model), dtype, rngs, scale=scale)
        self.qtype = None
        self.layout = layout

    def load(self, t, load=None, layout: str | None = None) -> None:
        """Keep a stacked QuantTensor's blocks (checkpoint.base.QuantTensor, 3-D) in this
        matrix's layout, or in `layout` (the build plan's: "columns" under input sparsity;
        `arrange_stacked`; load: the model's qweights.batched_load, if any)."""
        if layout is not None:
            if layout not in LAYOUTS:
                fail("Stacked layout", f"one of {list(LAYOUTS)}", layout)
            self.layout = layout
        blocks, qtype, self.layout = arrange_stacked(t.blocks, t.qtype, self.layout,
                                                     t.stored_shape, t.transposed, load)
        self.weight.set_value(host_blocks(blocks))
        self.qtype = qtype

    @property
    def kernel_qtype(self) -> str | None:
        """The type name the custom calls take: `qtype` ("Q4_0x16" where interleaved), with
        the down groups' or the columns' suffix ("Q4_0g32", "Q4_0c64"; qweights.kernel_type,
        the one map)."""
        return None if self.qtype is None else kernel_type(self.qtype, self.layout, False)


def stacked_format(qtype: str, layout: str, stored_shape, transposed: bool) -> tuple[str, str]:
    """(qtype, layout) a stacked matrix of experts ends in once arranged (`arrange_stacked`),
    from its file format and shape alone: no bytes read (the expert file's plan)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    rows, cols = stored_shape[-2], stored_shape[-1]
    if layout == "columns":
        if quants.can_columns(qtype, rows, cols):
            return qtype, layout
        layout = "matvec"  # no columns layout for this format or row count: read whole
    if layout == "groups":
        d, f = stored_shape[-2:]
        if not (qtype in quants.DOWN_GROUP_TYPES and transposed and d % 32 == f % 32 == 0):
            layout = "matvec"  # no groups in this format: every neuron's down row read
    if layout == "matvec" and rows % 16 == 0 and quants.can_interleave(qtype, rows):
        return qtype + quants.INTERLEAVED_SUFFIX, layout
    return qtype, layout


def arrange_stacked(blocks, qtype: str, layout: str, stored_shape, transposed: bool,
                    load=None):
    """(blocks, qtype, layout) of stacked expert blocks uint8 [E, rows, row_bytes] (the file's)
    in `layout`. matvec: each expert's rows interleaved by 16 where the format and row count
    allow (qweights.interleaved: ~3x the file rows' speed at one token; the type becomes e.g.
    "Q4_0x16"). groups: a transposed down projection in a 32-weight format as each expert's
    down groups [E, F / 32, D * block bytes], else matvec (the dense path). The same bytes
    whether the experts are arranged all at once or a few at a time (the expert file's)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    want_qtype, layout = stacked_format(qtype, layout, stored_shape, transposed)
    e, rows = blocks.shape[:2]
    if layout == "columns":  # each expert arranged on the kernels' pool
        blocks = np.stack([columns(np.asarray(b), qtype, load).blocks for b in blocks])
        return blocks, qtype, layout
    if layout == "groups":
        d, f = stored_shape[-2:]
        blocks = np.stack([quants.down_groups(np.asarray(b), qtype, d, f) for b in blocks])
    if want_qtype != qtype:  # groups of 16 rows never span two experts
        flat, qtype = interleaved(np.asarray(blocks).reshape(e * rows, blocks.shape[2]), qtype,
                                  load)
        blocks = flat.reshape(blocks.shape)
    return blocks, qtype, layout


class Experts(Module):
    """E gated FFNs, stacked: gate, up, down_t, each [E, F, D]. relu experts (`sparse_inside`)
    keep up as the file's rows and down as groups: each routed expert reads only the up rows
    and down groups of the neurons whose gate fires."""

    def __init__(self, n_experts: int, d_ff: int, d_model: int, *, dtype, rngs,
                 sparse_inside: bool = False):
        kw = dict(dtype=dtype, rngs=rngs)
        self.d_ff, self.d_model = d_ff, d_model
        self.gate = Stacked(n_experts, d_ff, d_model, scale=d_model ** -0.5, **kw)
        self.up = Stacked(n_experts, d_ff, d_model, scale=d_model ** -0.5,
                          layout="rows" if sparse_inside else "matvec", **kw)
        self.down_t = Stacked(n_experts, d_ff, d_model, scale=d_ff ** -0.5,
                              layout="groups" if sparse_inside else "matvec", **kw)

    def floats(self, first: int, stop: int, dtype) -> tuple[np.ndarray, ...]:
        """Experts [first, stop) as floats (gate, up, down_t), each [n, F, D] in `dtype`,
        dequantized from the blocks in whichever layout each matrix keeps them."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        out = []
        for m in (self.gate, self.up, self.down_t):
            w = np.asarray(jax.device_get(m.weight[...][first:stop]))
            if m.qtype is not None:
                if m.layout == "groups":  # [n, F / 32, D * block bytes] -> the file's [n, D, .]
                    w = np.stack([quants.down_groups_to_file(g, m.qtype, self.d_model, self.d_ff)
                                  for g in w])
                if m.layout == "columns":
                    cols = self.d_ff if m is self.down_t else self.d_model
                    w = np.stack([quants.columns_to_float(e, m.qtype, cols) for e in w])
                else:
                    w = np.stack([quants.dequantize(e, m.qtype) for e in w])  # [n, rows, cols]
                if m is self.down_t:  # the file's ffn_down [D, F]: neuron-major as the floats
                    w = np.swapaxes(w, 1, 2)
            out.append(np.ascontiguousarray(w).astype(dtype))
        return tuple(out)


def hot_dtype(dtype):
    """The dtype hot experts are held in: the model's, but float32 on a CPU backend, where XLA
    computes a bfloat16 dot by widening its weights to float32 first, hoisted out of the decode
    loop for every hot expert at once (the SYNTHETIC OLMoE shape at 25% hot: +6.4 GB for each
    step call)."""
    return jnp.float32 if jax.default_backend() == "cpu" else dtype


class HotExperts(Module):
    """A placed MoE layer's experts [0, n_hot) as floats (gate, up, down_t: [n_hot, F, D]): what
    the accelerator holds and computes with XLA."""

    def __init__(self, gate, up, down_t):
        self.gate, self.up, self.down_t = (nnx.Param(jnp.asarray(a)) for a in (gate, up, down_t))


def route(logits_ne, k: int, normalize: bool):
    """(expert ids [N, k] int32, weights [N, k] float32) from router logits [N, E]: softmax
    over the experts, the k largest (ties to the lower id, as torch.topk), renormalized to sum
    to 1 when `normalize`."""
    probs = jax.nn.softmax(logits_ne.astype(F32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


# ------------------------------------------------------------------ the host half on an accelerator
_HOST: dict[int, "ColdExperts"] = {}
_HANDLES = itertools.count(1)


class ColdExperts:
    """A placed layer's cold experts kept on the host when the model runs on an accelerator:
    their weights as the file has them (committed to the CPU device) and what runs them there:
    a quantized file's blocks through ops.moe_ffn (the host pool), float experts (F32, F16,
    BF16: the model's dtype) through XLA on the CPU, each routed pair alone at decode
    (`_CpuFloatExperts`: MoE's float paths). Registered by handle (the model holds only the
    integer), released with the layer."""

    def __init__(self, experts: "Experts", activation: str, n_used: int):
        cpu = jax.devices("cpu")[0]
        self.blocks = tuple(jax.device_put(np.asarray(jax.device_get(m.weight[...])), cpu)
                            for m in (experts.gate, experts.up, experts.down_t))
        self.quantized = experts.gate.qtype is not None
        self.kw = dict(gate_qtype=experts.gate.kernel_qtype, up_qtype=experts.up.kernel_qtype,
                       down_qtype=experts.down_t.kernel_qtype, activation=activation)
        self.n_used = n_used
        self.cpu = cpu

    @functools.cached_property
    def _run(self):
        kw = self.kw
        if not self.quantized:
            floats = _CpuFloatExperts(self.n_used, kw["activation"])
            return jax.jit(lambda x, ids, w, g, u, d: floats._xla(x, ids, w, (g, u, d)))
        return jax.jit(lambda x, ids, w, g, u, d: ops.moe_ffn(x, ids, w, g, u, d, **kw))

    def __call__(self, x, ids, weights):
        """float32 [N, D] numpy: the cold experts' partial sum for these tokens (on the CPU)."""
        args = jax.device_put((np.asarray(x), np.asarray(ids), np.asarray(weights)), self.cpu)
        return np.asarray(self._run(*args, *self.blocks))


def _register_host(experts) -> int:
    handle = next(_HANDLES)
    _HOST[handle] = experts
    return handle


def _host_part(handle: int, x, ids, weights):
    return _HOST[int(handle)](x, ids, weights)


@dataclasses.dataclass(frozen=True)
class OnDisk:
    """Where an offloaded layer's experts are (runtime/expert_offload.py): the expert store's
    handle, this layer's index in it, the experts' formats as the store keeps them; credit:
    pass the router's probabilities (the "score" cache policy); ahead: experts per token the
    read-ahead guesses for the next layer (0: none)."""

    store: int
    layer: int
    d_ff: int
    gate_qtype: str
    up_qtype: str
    down_qtype: str  # with the down groups' suffix where grouped ("Q4_0g32")
    credit: bool = False
    ahead: int = 0


class Lookahead(Module):
    """The next layer's ffn_norm and router (shared with that layer, not copies): on this
    layer's residual they guess the next layer's experts, which the store reads ahead."""

    def __init__(self, norm, router):
        self.norm, self.router = norm, router

    def __call__(self, residual_btd, k: int):
        x = self.norm(residual_btd)
        x = x.reshape(-1, x.shape[-1]).astype(F32)
        return jax.lax.top_k(self.router(x), k)[1].astype(jnp.int32)  # [N, k]


class MoE(Module):
    """An MoE layer's FFN (module docstring). Has the dense FFN's interface where the model's
    build steps touch it (`selector`, `set_selector`, `quantized`, `placed`, `permute`, `split`,
    hot/cold counts, here in experts); neuron-level sparsity modes are refused by name."""

    def __init__(self, *, d_model: int, d_ff: int, n_experts: int, n_used: int,
                 norm_topk_prob: bool, activation: str, d_ff_shared: int, dtype,
                 rngs: nnx.Rngs | None, kernels: str = "xla"):
        if not 1 <= n_used <= n_experts:
            fail("MoE n_used", f"an integer in [1, n_experts={n_experts}]", n_used)
        self.n_experts, self.n_used = n_experts, n_used
        self.normalize = bool(norm_topk_prob)
        self.activation = activation
        self.kernels = kernels
        self.dtype = dtype
        self.router = Linear(d_model, n_experts, bias=False, dtype=F32, rngs=rngs,
                             kernels="xla")
        self.experts = Experts(n_experts, d_ff, d_model, dtype=dtype, rngs=rngs,
                               sparse_inside=activation == "relu")
        self.shared = (FFN(d_model=d_model, d_ff=d_ff_shared, activation=activation, gated=True,
                           bias=False, dtype=dtype, rngs=rngs, kernels=kernels)
                       if d_ff_shared else None)
        self.shared_gate = (Linear(d_model, 1, bias=False, dtype=F32, rngs=rngs, kernels="xla")
                            if d_ff_shared else None)
        self.execution = "routed"
        # float experts one routed pair at a time (MoE._pairs): on a CPU, where XLA's gather
        # copies rows; a GPU gathers fast and would sync on each pair's condition
        self.per_pair = jax.default_backend() == "cpu"
        self.selector = nnx.data(None)
        # Expert parallelism (runtime/mesh.py): the mesh axis over which the experts are split
        # (E/n on each device, inside shard_map); the output is then this device's partial sum
        self.expert_axis = None
        # Placement (module docstring): the file's expert at each position after `permute`
        # (None: the file's order), the floats of experts [0, n_hot) after `split`
        self.order = nnx.data(None)
        self.hot = None
        self.n_hot = n_experts
        self.placed = False
        self.host_handle = None  # the cold experts in the host store (`split(store="host")`)
        # --ram-budget: the experts in an expert store (OnDisk), the read-ahead's Lookahead
        self.on_disk = None
        self.lookahead = None
        # input sparsity (sparsity/input_sparsity.py): the experts' (and the shared expert's)
        # input mask [D] (the router reads x whole) and the experts' down-input thresholds
        # (an InputMask of [E, F]: each expert's own)
        self.in_mask = nnx.data(None)
        self.mid_mask = nnx.data(None)

    # ------------------------------------------------------------ the build steps' interface
    quantized = False
    backend = None  # sparsity.modes.plan reports the backend's type: "NoneType" here

    @property
    def n_cold(self) -> int:
        """Experts left where they were loaded (the host's, after `split`)."""
        return self.n_experts - self.n_hot if self.placed else 0

    def set_selector(self, selector, *, impl: str = "ffi") -> None:
        if selector is not None:
            fail("MoE FFN selector", "None (the router selects experts; neuron-level sparsity "
                 "inside experts is not implemented)", type(selector).__name__,
                 "run an MoE model with --sparsity dense")

    def permute(self, order) -> None:
        """Reorder the experts: new expert j is the file's expert order[j] (the stacked
        matrices' and the router's rows). The output is unchanged; routed ids are reported in
        the file's numbering (`expert_ids`)."""
        if self.placed:
            fail("MoE.permute", "an unsplit MoE layer", "one already split")
        perm = np.asarray(order)
        e = self.n_experts
        if perm.shape != (e,) or not np.array_equal(np.sort(perm), np.arange(e)):
            fail("MoE.permute order", f"a permutation of range({e})", f"shape {perm.shape}")
        if self.router.qtype is not None:
            fail("MoE.permute router", "float rows", f"{self.router.qtype} blocks")
        if self.expert_axis is not None:
            fail("MoE.permute", "an MoE layer on one device", "experts split over a mesh")
        idx = jnp.asarray(perm, jnp.int32)
        for m in (self.experts.gate, self.experts.up, self.experts.down_t):
            m.weight.set_value(m.weight[...][idx])
        self.router.weight.set_value(self.router.weight[...][idx])
        before = np.arange(e) if self.order is None else np.asarray(self.order)
        self.order = nnx.data(before[perm].astype(np.int32))

    def split(self, n_hot: int, *, store: str = "auto") -> None:
        """Keep experts [0, n_hot) as floats in `hot_dtype` (`hot`, the accelerator's);
        experts [n_hot, E) stay as loaded. store: "operands" (in `experts`, run inline: a
        CPU-only machine), "host" (a file's blocks moved to the host store, run through a host
        callback: what an accelerator needs), "auto" ("host" off the CPU)."""
        e = self.n_experts
        if self.placed or not (isinstance(n_hot, (int, np.integer)) and 0 <= n_hot <= e):
            fail("MoE.split n_hot", f"an integer in [0, {e}] on an unsplit MoE layer", n_hot,
                 f"placed={self.placed}")
        if store == "auto":
            store = "operands" if jax.default_backend() == "cpu" else "host"
        if store not in ("operands", "host"):
            fail("MoE.split store", "'auto', 'operands' or 'host'", store)
        n_hot = int(n_hot)
        x = self.experts
        if n_hot:
            self.hot = HotExperts(*x.floats(0, n_hot, hot_dtype(self.dtype)))
        for m in (x.gate, x.up, x.down_t):
            m.weight.set_value(m.weight[...][n_hot:])
        if n_hot < e and store == "host":
            self.host_handle = _register_host(ColdExperts(x, self.activation, self.n_used))
            weakref.finalize(self, _HOST.pop, self.host_handle, None)
            for m in (x.gate, x.up, x.down_t):  # nothing of them stays in the model's state
                m.weight.set_value(m.weight[...][:0])
        self.n_hot, self.placed = n_hot, True

    def set_execution(self, execution: str) -> None:
        if execution not in EXECUTIONS:
            fail("MoE execution", f"one of {list(EXECUTIONS)}", execution)
        self.execution = execution

    # ------------------------------------------------------------ the call
    def routing(self, x_btd):
        """(ids [N, k], weights [N, k]) of the tokens of x [B, T, D]."""
        x = x_btd.reshape(-1, x_btd.shape[-1]).astype(F32)
        return route(self.router(x), self.n_used, self.normalize)

    def __call__(self, x_btd, residual=None):
        """residual: the block's (as FFN.__call__ takes it), for the expert store's read-ahead."""
        lead, d = x_btd.shape[:-1], x_btd.shape[-1]
        x = x_btd.reshape(-1, d).astype(F32)  # [N, D]
        logits = self.router(x)
        x_whole = x  # what the router and a shared expert's gate read
        if self.in_mask is not None or self.mid_mask is not None:
            self._check_input_sparsity()
            x = apply_mask(self.in_mask, x_btd).reshape(-1, d).astype(F32)  # the experts' x
        ids, weights = route(logits, self.n_used, self.normalize)
        named = ids if self.order is None else jnp.asarray(self.order)[ids]  # the file's ids
        sow(self, "expert_ids", named.reshape(lead + (self.n_used,)))  # [B, T, k] under capture
        sow(self, "router_logits", logits.reshape(lead + (self.n_experts,)))  # [B, T, E]
        if self.on_disk is not None:
            y = self._on_disk(x, ids, weights, logits, residual)
            if self.shared is not None:
                y = y + jax.nn.sigmoid(self.shared_gate(x_whole)) * self.shared(x[None])[0]
            return y.reshape(lead + (d,))
        first_shard = True
        if self.expert_axis is not None:  # this device's experts only; -1 marks the others
            n_local = self.experts.up.weight.shape[0]
            shard = jax.lax.axis_index(self.expert_axis)
            local = ids - shard * n_local
            here = (local >= 0) & (local < n_local)
            ids, weights = jnp.where(here, local, -1), jnp.where(here, weights, 0.0)
            first_shard = shard == 0
        if not self.placed:
            y = self._loaded(x, ids, weights, lead)
        else:  # hot experts [0, n_hot) with XLA, the others as loaded, each by the ids it holds
            hot = ids < self.n_hot
            y = jnp.zeros_like(x)
            if self.n_hot:
                h = self.hot
                y = y + self._xla(x, jnp.where(hot, ids, -1), jnp.where(hot, weights, 0.0),
                                  (h.gate[...], h.up[...], h.down_t[...]))
            if self.n_cold:
                cold = (x, jnp.where(hot, -1, ids - self.n_hot), jnp.where(hot, 0.0, weights))
                if self.host_handle is None:
                    y = y + self._loaded(*cold)
                else:  # on the host, by the host pool, while the device waits
                    y = y + jax.pure_callback(
                        functools.partial(_host_part, self.host_handle),
                        jax.ShapeDtypeStruct(x.shape, F32), *cold, vmap_method="sequential")
        if self.shared is not None:  # whole on every device: added by the first shard
            scale = jax.nn.sigmoid(self.shared_gate(x_whole))  # [N, 1]
            y = y + jnp.where(first_shard, scale, 0.0) * self.shared(x[None])[0]
        return y.reshape(lead + (d,))

    def _on_disk(self, x, ids, weights, logits, residual):
        """The routed experts from the expert store, in one custom call (its `OnDisk`)."""
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        o = self.on_disk
        probs = jax.nn.softmax(logits.astype(F32), axis=-1) if o.credit else None
        ahead = None
        if o.ahead and self.lookahead is not None:
            ahead = self.lookahead(require_residual(residual, "the expert store's read-ahead"),
                                   o.ahead)
        return _ffi.expert_ffn(x, ids, weights, store=o.store, layer=o.layer, d_ff=o.d_ff,
                               gate_qtype=o.gate_qtype, up_qtype=o.up_qtype,
                               down_qtype=o.down_qtype, activation=self.activation,
                               probs=probs, next_ids=ahead)

    def _check_input_sparsity(self) -> None:
        """Input sparsity runs on the experts as loaded, in memory, on one device."""
        if self.placed or self.on_disk is not None or self.expert_axis is not None:
            fail("MoE input sparsity", "experts in memory on one device (no placement, "
                 "--ram-budget or expert mesh)", "placed" if self.placed else
                 "an expert store" if self.on_disk is not None else "an expert mesh")

    def _mid(self):
        """The experts' down-input thresholds [E, F], or None."""
        return None if self.mid_mask is None else self.mid_mask.threshold[...]

    def _sow_mid(self, kept, lead) -> None:
        """Under capture: the nonzero channels of down's input per routed expert [B, T]
        (`ffn_mid_active`, as an InputMask records its own)."""
        if self.mid_mask is not None:
            sow(self.mid_mask, "ffn_mid_active",
                (kept.astype(F32) / self.n_used).reshape(lead))

    def _loaded(self, x, ids, weights, lead=None):
        """The experts in `experts` (ids index them; -1: none, with weight 0), as loaded: a
        file's blocks in one custom call grouped by expert, floats with XLA."""
        e = self.experts
        if e.gate.qtype is None:
            y, kept = self._xla(x, ids, weights, (e.gate.weight[...], e.up.weight[...],
                                                  e.down_t.weight[...]), self._mid(),
                                with_kept=True)
        else:
            if self.activation not in ("silu", "relu"):
                fail("MoE quantized experts' activation", "'silu' or 'relu' (ops.moe_ffn's)",
                     self.activation, "load the file with weights='dtype'")
            impl = "reference" if self.execution == "dense" else op_impl(self.kernels)
            y, kept = ops.moe_ffn(x, ids, weights, e.gate.weight[...], e.up.weight[...],
                                  e.down_t.weight[...], gate_qtype=e.gate.kernel_qtype,
                                  up_qtype=e.up.kernel_qtype, down_qtype=e.down_t.kernel_qtype,
                                  activation=self.activation, mid_thresholds=self._mid(),
                                  return_kept=True, impl=impl)
        if lead is not None:
            self._sow_mid(kept, lead)
        return y

    def _xla(self, x, ids, weights, mats, mid=None, with_kept=False):
        """Float experts `mats` (gate, up, down_t: [E', F, D]) with XLA: one routed pair at a
        time on a CPU at decode, gathered per token elsewhere, or every expert on every token
        (the dense reference, and long prefills). mid: down-input thresholds [E', F] (input
        sparsity) or None. with_kept: (y, each token's nonzero down-input channels [N])."""
        if self.execution == "dense":
            out = self._dense(x, ids, weights, mats, mid)
        elif self.per_pair and x.shape[0] * self.n_used <= _MAX_PAIRS:
            out = self._pairs(x, ids, weights, mats, mid)
        elif x.shape[0] * self.n_used * mats[1][0].size <= _MAX_GATHER:
            out = self._gathered(x, ids, weights, mats, mid)
        else:
            out = self._dense(x, ids, weights, mats, mid)  # XLA has no routed grouping on CPU
        return out if with_kept else out[0]

    def _pairs(self, x_nd, ids, weights, mats, mid=None):
        """Each (token, routed expert) pair alone: that expert's rows sliced in place and
        multiplied, skipped when its id is -1 (an expert held elsewhere, weight 0). XLA's CPU
        gather copies every gathered row first: one SYNTHETIC OLMoE-shaped layer at one token,
        8 bfloat16 experts of 1024 x 2048, took 180 ms gathered, 10.5 ms this way (4.3 with
        half the pairs elsewhere)."""
        gate, up, down = mats
        rows, kept = [], []
        for n in range(x_nd.shape[0]):
            y, c = jnp.zeros((x_nd.shape[1],), F32), jnp.zeros((), jnp.int32)
            for j in range(self.n_used):
                e, w = jnp.maximum(ids[n, j], 0), weights[n, j]

                def one(yc, e=e, w=w, xn=x_nd[n]):
                    g, u, d = (jax.lax.dynamic_index_in_dim(m, e, keepdims=False)
                               for m in (gate, up, down))
                    a = self._act(jnp.dot(g, xn.astype(g.dtype), preferred_element_type=F32),
                                  jnp.dot(u, xn.astype(u.dtype), preferred_element_type=F32))
                    if mid is not None:
                        a = _mask_mid(a, jax.lax.dynamic_index_in_dim(mid, e, keepdims=False))
                    return (yc[0] + jnp.dot((a * w).astype(d.dtype), d,
                                            preferred_element_type=F32),
                            yc[1] + jnp.sum(a != 0, dtype=jnp.int32))

                y, c = jax.lax.cond(ids[n, j] >= 0, one, lambda yc: yc, (y, c))
            rows.append(y)
            kept.append(c)
        return jnp.stack(rows), jnp.stack(kept)

    def _act(self, g, u):
        return gated_activate(self.activation, g, u)

    def _dense(self, x_nd, ids, weights, mats, mid=None):
        """Every expert on every token; unrouted ones weighted 0 (the reference). On a CPU one
        expert at a time (a scan): 16 float32 experts of 1024 x 2048 at 16 tokens took 68 ms so
        against 208 ms as three batched einsums (bfloat16: 180 against 210 ms; 2 threads)."""
        gate, up, down = mats
        hot = jax.nn.one_hot(ids, gate.shape[0], dtype=F32)  # [N, k, E']; -1: a zero row
        w_ne = jnp.sum(hot * weights[..., None], axis=1)  # [N, E']
        routed = jnp.sum(hot, axis=1)  # [N, E'] the pairs routed here (kept counts them)
        if self.per_pair:
            def one(yc, e):
                g, u, d, w, r = (jax.lax.dynamic_index_in_dim(m, e, keepdims=False)
                                 for m in (gate, up, down, w_ne.T, routed.T))
                a = self._act(jnp.dot(x_nd, g.T.astype(F32)), jnp.dot(x_nd, u.T.astype(F32)))
                if mid is not None:
                    a = _mask_mid(a, jax.lax.dynamic_index_in_dim(mid, e, keepdims=False))
                c = (r * jnp.sum(a != 0, axis=-1)).astype(jnp.int32)
                return (yc[0] + jnp.dot(a * w[:, None], d.astype(F32)), yc[1] + c), None

            y0 = (jnp.zeros(x_nd.shape, F32), jnp.zeros(x_nd.shape[:1], jnp.int32))
            return jax.lax.scan(one, y0, jnp.arange(gate.shape[0]))[0]
        g = jnp.einsum("nd,efd->nef", x_nd, gate, preferred_element_type=F32)
        u = jnp.einsum("nd,efd->nef", x_nd, up, preferred_element_type=F32)
        a = self._act(g, u)
        if mid is not None:
            a = _mask_mid(a, mid[None])
        kept = jnp.sum(routed * jnp.sum(a != 0, axis=-1), axis=-1).astype(jnp.int32)
        return jnp.einsum("nef,efd->nd", a * w_ne[..., None], down,
                          preferred_element_type=F32), kept

    def _gathered(self, x_nd, ids, weights, mats, mid=None):
        """Each token's k experts' rows gathered and computed: [N, k, F, D] read, no more."""
        ids_in, ids = ids, jnp.maximum(ids, 0)  # -1 (an expert held elsewhere): weight 0
        gate, up, down = (w[ids] for w in mats)
        g = jnp.einsum("nd,nkfd->nkf", x_nd, gate, preferred_element_type=F32)
        u = jnp.einsum("nd,nkfd->nkf", x_nd, up, preferred_element_type=F32)
        a = self._act(g, u)
        if mid is not None:
            a = _mask_mid(a, mid[ids])
        kept = jnp.sum((ids_in >= 0) * jnp.sum(a != 0, axis=-1), axis=-1).astype(jnp.int32)
        return jnp.einsum("nkf,nkfd->nd", a * weights[..., None], down,
                          preferred_element_type=F32), kept


def _mask_mid(a, thresholds):
    """Down's input a zeroed where |a| < its expert's thresholds (NaN stays, as InputMask)."""
    return jnp.where(jnp.abs(a) < thresholds, jnp.zeros((), a.dtype), a)


class _CpuFloatExperts:
    """MoE's float-expert paths (`MoE._xla`: each routed pair alone at decode, every expert on
    every token for long calls) outside a module, as a CPU runs them: a host store's cold float
    experts (`ColdExperts`)."""

    execution = "routed"
    per_pair = True
    _xla, _pairs, _dense, _gathered, _act = (MoE._xla, MoE._pairs, MoE._dense, MoE._gathered,
                                             MoE._act)

    def __init__(self, n_used: int, activation: str):
        self.n_used, self.activation = n_used, activation
