"""The feed-forward block, its active-set selector and the backend that computes its rows.

Weights are neuron-major: `gate.weight` [F, D], `up.weight` [F, D], `down_t.weight` [F, D] (down
transposed), so neuron i's three rows are contiguous and a sparse kernel reads only active rows.
  gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)      (drelu: relu(gate) * relu(up + b))
  non-gated: a_i = act(up_i . x + b_up_i)
  y = b_down + sum_i a_i * down_t[i]

Two parts are chosen once, when the model is built, and never by string tests at call time:
  * `selector`: finds the active set (None: dense). A `Selector` subclass (the sparsity modes in
    sparsity/selectors.py: oracle, calibrated gate threshold, predictors) returns a `Selection`:
    ops.sparse_ffn's criterion, the layer's threshold and the scores it compares.
  * `backend`: computes the rows. `Unsplit` (every row in the FFN's Params: XLA or the custom call),
    `CpuHybrid` (placed: hot rows with XLA, cold `ColdRows` through the custom call on the host
    pool, summed), `CudaHybrid` (placed on a GPU: hot rows in CUDA kernels, cold rows in the CUDA
    module's host store behind a handle, one custom call) or `DiskHybrid` (--ram-budget: every row
    in a neuron store, in memory or read from disk, behind a handle). `FFN.split` switches the
    backend to the first two; runtime/offload.py sets DiskHybrid.
Under models.transformer.capture the FFN records each call's active counts ("n_active" [B, T]).

Dependencies point one way: this module knows only the Selector interface; sparsity/ implements it.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax import ops
from powerinfer_jax.errors import fail
from powerinfer_jax.models.layers import (F32, InputSample, Linear, Module, _param, apply_mask,
                                         op_impl, sow, use_ffi)
from powerinfer_jax.models.qweights import (COLUMNS, GROUPS, MATVEC, ROWS, FfnLayout, QWeight,
                                            host_blocks)
from powerinfer_jax.ops.reference import (  # pure jnp, shared with the kernels' oracle
    activate, floor_gate, gated_activate)


class Selection(NamedTuple):
    """What a selector hands the backend (the arguments of ops.sparse_ffn's selection).

    criterion: "oracle" (|a_i| > threshold from the true activations), "scores" (scores >
    threshold) or "activations" (scores are the activations a_i themselves, |a_i| > threshold:
    only the active down rows are read). scores: [B, T, F] float32, None for "oracle".
    """

    criterion: str
    threshold: float
    scores: jax.Array | None = None

    def active(self, activations=None):
        """The active mask [B, T, F] this selection picks ("oracle" needs the activations)."""
        if self.criterion == "scores":
            return self.scores > self.threshold
        return jnp.abs(self.scores if self.criterion == "activations" else activations) > \
            self.threshold


class Selector(Module):
    """Finds one FFN layer's active neurons (implementations: sparsity/selectors.py)."""

    # whether `select_in_block` reads the block's residual (Block then also sows it under
    # capture, as "ffn_residual", for diagnostics that select outside the block's call)
    reads_residual = False

    def select(self, ffn: "FFN", x_btd) -> Selection:
        """The active set for the FFN input x_btd [B, T, D]."""
        raise NotImplementedError

    def select_in_block(self, ffn: "FFN", x_btd, residual) -> Selection:
        """What the FFN's backends call: `select` on the FFN input. A selector that reads the
        block's residual instead (the tensor ffn_norm normalized, which Block passes to its
        FFN: PowerInfer's predictors) overrides this."""
        return self.select(ffn, x_btd)

    def fused(self, ffn: "FFN", x_btd):
        """(y, n_active) in one call on an unplaced CPU FFN, or None when this selector has no
        fused kernel (the default): then `select` and the backend's sparse call run."""
        return None

    def permute(self, perm) -> None:
        """Reorder per-neuron state (predictor output rows) with the FFN's hot-first order."""

    def describe(self) -> dict:
        return {"selector": type(self).__name__}

    def layouts(self, ffn: "FFN") -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The quantized gate and up layouts this selector's calls can read (models/qweights.py):
        by default ROWS, since scores select rows to read one by one."""
        return (ROWS,), (ROWS,)


def cuda_hybrid_available() -> bool:
    """A GPU backend and the CUDA build (powerinfer_jax._pij_cuda): placed FFNs keep their cold
    rows in the CUDA module's host store and run the hybrid custom call."""
    if jax.default_backend() != "gpu":
        return False
    try:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    except ImportError:
        return False
    return _ffi._pij_cuda is not None


class ColdRows(nnx.Variable):
    """FFN rows kept in host memory: the cold part of a placed FFN."""


class DownT(Module):
    """The down projection stored transposed: weight [F, D] (row i is neuron i), bias [D]. On a
    quantized file (models/qweights.py) it holds a QWeight's blocks in one of its layouts:
      * MATVEC: the file's ffn_down as stored, uint8 [D, row_bytes] blocked along F, a matvec
        for ops.qlinear (rows interleaved by 16 where the format has it): dense models.
      * GROUPS: the same blocks rearranged per 32 neurons, uint8 [F / 32, D * block bytes]
        (checkpoint.quants.down_groups): what the sparse kernel reads in the 32-weight formats.
        Nothing is re-quantized, and a group's scales are read once for all its active neurons.
      * ROWS: uint8 [F, row_bytes], neuron i's down row re-blocked along D (`qtype` may differ
        from the file's): the sparse kernel's other layout, and the one rows can be permuted in.
    The build plan chooses the layout; this module never converts it."""

    def __init__(self, d_ff: int, d_model: int, *, bias: bool, dtype, rngs: nnx.Rngs | None,
                 kernels: str = "xla"):
        self.qtype = None
        self.layout = MATVEC
        self.interleaved = False
        self.kernels = kernels
        self.d_ff = d_ff
        self.weight = _param((d_ff, d_model), dtype, rngs, scale=d_ff ** -0.5)
        self.bias = _param((d_model,), F32, None) if bias else None

    def load(self, w: QWeight) -> None:
        """Keep the QWeight's blocks in its layout."""
        self.weight.set_value(host_blocks(w.blocks))  # in place: no new Param per tensor
        self.qtype, self.layout, self.interleaved = w.qtype, w.layout, w.interleaved

    @property
    def qweight(self) -> QWeight:
        return QWeight(self.weight[...], self.qtype, self.layout, self.interleaved)

    def __call__(self, a_btf):
        if self.qtype is not None and self.layout in (MATVEC, COLUMNS):
            return ops.qlinear(a_btf, self.weight[...], self.qweight.kernel_qtype, self.d_ff,
                               _value(self.bias), impl=op_impl(self.kernels))
        if self.qtype is not None:
            fail("DownT call", "float rows or the file's ffn_down layout (matvec)",
                 f"{'down groups' if self.layout == GROUPS else 'neuron rows'} in {self.qtype} "
                 "(the sparse kernel's layout)")
        w = self.weight[...]
        y = jnp.einsum("btf,fd->btd", a_btf.astype(w.dtype), w, preferred_element_type=F32)
        return y + self.bias[...] if self.bias is not None else y


def _value(var):
    return None if var is None else var[...]


def require_residual(residual, what: str):
    """The block's residual an FFN call was given, for `what` that reads it; one line if none."""
    if residual is None:
        fail(f"{what}'s input", "the block's residual (the tensor ffn_norm normalized), which "
             "Block passes as FFN(x, residual=...)", "none", "run the FFN through its "
             "Transformer block, or pass residual=")
    return residual


# ------------------------------------------------------------------------------------ backends
@dataclasses.dataclass(frozen=True)
class Unsplit:
    """Every row in the FFN's Params. Dense: XLA's matmuls, or with kernels "ffi" the custom call
    over every neuron. Sparse: ops.sparse_ffn with `impl` ("ffi" or "reference"), or the
    selector's fused call (`fused`, decided at build: CPU backend, impl "ffi")."""

    impl: str = "ffi"
    fused: bool = False

    def dense(self, ffn, x_btd, residual=None):
        if ffn.in_mask is not None or ffn.mid_mask is not None:  # input sparsity: the matvecs
            # read their inputs' nonzero channels (columns layout); floats run masked, densely
            a = ffn.activations(apply_mask(ffn.in_mask, x_btd))
            sow(ffn, "ffn_mid", a, InputSample)
            return ffn.down_t(apply_mask(ffn.mid_mask, a))
        if ffn.quantized and ffn.down_t.layout in (MATVEC, COLUMNS):  # three matvecs
            a = ffn.params_activations(x_btd)
            sow(ffn, "ffn_mid", a, InputSample)
            return ffn.down_t(a)
        if ffn.quantized or use_ffi(ffn.kernels, x_btd, ffn.up.weight[...]):
            # Every neuron through the custom call: "oracle" at threshold 0 skips only exact
            # zeros, so this is the dense FFN with rows streamed at their stored width.
            return self.sparse(ffn, x_btd, Selection("oracle", 0.0), impl="ffi")[0]
        return ffn.down_t(ffn.activations(x_btd))

    def run(self, ffn, x_btd, selector, residual=None):
        if self.fused:
            return selector.fused(ffn, x_btd)
        return self.sparse(ffn, x_btd, selector.select_in_block(ffn, x_btd, residual))

    def sparse(self, ffn, x_btd, sel: Selection, impl: str | None = None):
        if ffn.quantized:  # on the file's blocks; "activations" are the file's own: oracle
            return ops.qsparse_ffn(
                x_btd, ffn.up.weight[...], ffn.down_t.weight[...], up_qtype=ffn.up.kernel_qtype,
                down_qtype=ffn.down_t.qweight.kernel_qtype,
                gate=_value(ffn.gate and ffn.gate.weight),
                gate_qtype=ffn.gate and ffn.gate.kernel_qtype, b_up=_value(ffn.up.bias),
                b_down=_value(ffn.down_t.bias),
                scores=sel.scores if sel.criterion == "scores" else None,
                threshold=float(sel.threshold), activation=ffn.activation,
                criterion="scores" if sel.criterion == "scores" else "oracle",
                gate_floor=ffn.gate_floor,
                impl=impl or self.impl)
        return ops.sparse_ffn(
            x_btd, ffn.up.weight[...], ffn.down_t.weight[...], w_gate=_value(ffn.gate and
                                                                             ffn.gate.weight),
            b_up=_value(ffn.up.bias), b_down=_value(ffn.down_t.bias), scores=sel.scores,
            threshold=float(sel.threshold), activation=ffn.activation, criterion=sel.criterion,
            gate_floor=ffn.gate_floor, impl=impl or self.impl)


@dataclasses.dataclass(frozen=True)
class CpuHybrid:
    """A placed FFN without a GPU: hot rows [0, n_hot) with XLA (masked by the active set), cold
    rows (`ffn.cold`, ColdRows) through the custom call, the two partial sums added."""

    impl: str = "ffi"

    def dense(self, ffn, x_btd, residual=None):
        return self._compute(ffn, x_btd, Selection("oracle", 0.0), dense=True)[0]

    def run(self, ffn, x_btd, selector, residual=None):
        return self._compute(ffn, x_btd, selector.select_in_block(ffn, x_btd, residual),
                             dense=False)

    def _compute(self, ffn, x_btd, sel: Selection, *, dense: bool):
        n_hot, c = ffn.n_hot, ffn.cold
        y = jnp.zeros(x_btd.shape[:-1] + (ffn.down_t.weight.shape[1],), F32)
        count = jnp.zeros(x_btd.shape[:-1], jnp.int32)
        scores = sel.scores
        if n_hot:
            # [B, T, F_hot]; "activations": the scores are the activations (no gate/up rows read)
            a = scores[..., :n_hot] if sel.criterion == "activations" else ffn.params_activations(
                x_btd)
            if not dense:
                mask = (scores[..., :n_hot] > sel.threshold if sel.criterion == "scores"
                        else jnp.abs(a) > sel.threshold)
                a = jnp.where(mask, a, 0.0)
                count = count + jnp.sum(mask, axis=-1, dtype=jnp.int32)
            w = ffn.down_t.weight[...]
            y = y + jnp.einsum("btf,fd->btd", a.astype(w.dtype), w, preferred_element_type=F32)
        if ffn.n_cold:
            y_cold, n_cold = ops.sparse_ffn(
                x_btd, c["up"][...], c["down_t"][...], w_gate=_value(c.get("gate")),
                b_up=_value(c.get("b_up")), b_down=None,
                scores=None if scores is None else scores[..., n_hot:],
                threshold=float(sel.threshold), activation=ffn.activation,
                criterion=sel.criterion, gate_floor=ffn.gate_floor, impl=self.impl)
            y = y + y_cold
            count = count + n_cold
        if ffn.down_t.bias is not None:
            y = y + ffn.down_t.bias[...]
        return y, count


@dataclasses.dataclass(frozen=True)
class CudaHybrid:
    """A placed FFN on a GPU: one custom call, hot rows on the device, cold rows behind `handle`
    in the CUDA module's host store (xla_ffi/sparse_ffn_hybrid_cuda.cu)."""

    handle: int

    def dense(self, ffn, x_btd, residual=None):
        return self._compute(ffn, x_btd, Selection("oracle", 0.0))[0]

    def run(self, ffn, x_btd, selector, residual=None):
        sel = selector.select_in_block(ffn, x_btd, residual)
        if sel.criterion == "activations":
            fail("FFN (GPU hybrid) criterion", "'scores' or 'oracle'", sel.criterion,
                 "--gate-up q4 runs on the CPU backend only")
        return self._compute(ffn, x_btd, sel)

    def _compute(self, ffn, x_btd, sel: Selection):
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        ffn.require_no_gate_floor("the GPU hybrid")
        lead, d = x_btd.shape[:-1], x_btd.shape[-1]
        x = x_btd.reshape(-1, d)
        s = None if sel.scores is None else sel.scores.reshape(x.shape[0], -1)
        n_hot = ffn.n_hot
        y, count = _ffi.sparse_ffn_hybrid(
            x, ffn.up.weight[...], ffn.down_t.weight[...],
            w_gate=_value(ffn.gate and ffn.gate.weight), b_up=_value(ffn.up.bias),
            b_down=_value(ffn.down_t.bias), scores=None if s is None else s[:, :n_hot],
            scores_cold=None if s is None else s[:, n_hot:], threshold=float(sel.threshold),
            activation=ffn.activation, criterion=sel.criterion, cold_handle=self.handle)
        return y.reshape(lead + (d,)), count.reshape(lead)


@dataclasses.dataclass(frozen=True)
class DiskHybrid:
    """An FFN whose rows live in a neuron store (runtime/offload.py, --ram-budget): the static
    and cached neurons in memory, the others read from the model's bundle file when the active
    set needs them, in one custom call per layer (ops._ffi.disk_ffn) that takes the store's
    handle and this layer's index. The FFN's own weights are zero-row stubs. With an FFN
    attribute `lookahead` (the next layer's predictor, set by runtime/offload.py) its output on
    this layer's residual is a guess at the next layer's active set, read ahead."""

    store: int
    layer: int

    def dense(self, ffn, x_btd, residual=None):
        return self._compute(ffn, x_btd, Selection("oracle", 0.0), residual)[0]

    def run(self, ffn, x_btd, selector, residual=None):
        sel = selector.select_in_block(ffn, x_btd, residual)
        if sel.criterion == "activations":
            fail("FFN (neuron store) criterion", "'scores' or 'oracle'", sel.criterion,
                 "the selector's activations come from rows the store holds")
        return self._compute(ffn, x_btd, sel, residual)

    def _compute(self, ffn, x_btd, sel: Selection, residual):
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        ahead = getattr(ffn, "lookahead", None)
        if ahead is not None:
            ahead = ahead(require_residual(residual, "the neuron store's read-ahead"))
        y, count = _ffi.disk_ffn(x_btd, sel.scores, store=self.store, layer=self.layer,
                                 threshold=float(sel.threshold), activation=ffn.activation,
                                 criterion=sel.criterion, next_scores=ahead,
                                 gate_floor=ffn.gate_floor)
        if ffn.down_t.bias is not None:
            y = y + ffn.down_t.bias[...]
        return y, count


# ------------------------------------------------------------------------------------ the FFN
class FFN(Module):
    def __init__(self, *, d_model: int, d_ff: int, activation: str, gated: bool, bias: bool,
                 dtype, rngs: nnx.Rngs | None, kernels: str = "xla", gate_floor: float = 0.0):
        self.activation = activation
        # FATReLU's gate threshold (ModelConfig.fatrelu_thresholds): every path computes
        # floor_gate(gate) in place of the gate, so dense, oracle, threshold and predictor modes
        # run the FATReLU model; 0: plain ReLU (or another activation)
        self.gate_floor = float(gate_floor)
        self.kernels = kernels
        lin = dict(dtype=dtype, rngs=rngs, kernels=kernels)
        self.gate = Linear(d_model, d_ff, bias=False, **lin) if gated else None
        self.up = Linear(d_model, d_ff, bias=bias, **lin)
        self.down_t = DownT(d_ff, d_model, bias=bias, dtype=dtype, rngs=rngs, kernels=kernels)
        self.selector = nnx.data(None)  # a Selector; None: dense
        self.backend = Unsplit()
        self.cold = nnx.data(None)  # after split() on the CPU: {"gate", "up", "down_t", "b_up"}
        self.n_cold = 0  # rows in self.cold or behind a CudaHybrid handle
        # input sparsity (sparsity/input_sparsity.py): masks of gate/up's and down's inputs
        self.in_mask = nnx.data(None)
        self.mid_mask = nnx.data(None)

    # ---------------------------------------------------------------- the call: one path
    def __call__(self, x_btd, residual=None):
        """y [B, T, D] float32; records "n_active" [B, T] int32 in sparse modes (under capture).
        residual: the tensor the block's ffn_norm normalized [B, T, D] (the residual after
        attention; a parallel block's input), which Block passes: PowerInfer's predictors and an
        offloaded FFN's read-ahead read it instead of x_btd."""
        if self.selector is None:
            return self.backend.dense(self, x_btd, residual)
        y, n_active = self.backend.run(self, x_btd, self.selector, residual)
        sow(self, "n_active", n_active)
        return y

    def set_selector(self, selector: Selector | None, *, impl: str = "ffi") -> None:
        """Install the layer's selector and resolve the backend for it (see the module doc)."""
        if selector is not None and not isinstance(selector, Selector):
            fail("FFN selector", "a Selector or None", type(selector).__name__)
        if selector is not None and self.quantized:  # the build plan arranged the weights
            gate_ok, up_ok = selector.layouts(self)
            layout = self.layout
            if (self.gate is not None and layout.gate not in gate_ok) or layout.up not in up_ok \
                    or layout.down == MATVEC:
                fail(f"FFN layouts for selector {type(selector).__name__}",
                     f"gate in {list(gate_ok)}, up in {list(up_ok)}, down groups or rows",
                     f"gate {layout.gate}, up {layout.up}, down {layout.down}",
                     "configure the model through sparsity.modes.configure (it arranges them)")
        self.selector = nnx.data(selector)
        if not self.placed:
            fused = (selector is not None and impl == "ffi" and self.kernels == "ffi"
                     and jax.default_backend() == "cpu"
                     and type(selector).fused is not Selector.fused)
            self.backend = Unsplit(impl=impl, fused=fused)
        elif isinstance(self.backend, CpuHybrid):
            self.backend = CpuHybrid(impl=impl)

    def require_no_gate_floor(self, path: str) -> None:
        """Fail clearly where a path has no FATReLU gate threshold (its kernels take none)."""
        if self.gate_floor:
            fail(f"FFN gate_floor {self.gate_floor:g} (a FATReLU model) on {path}",
                 "a path that applies FATReLU's gate threshold", path,
                 "run it on the CPU path without --ram-budget or GPU placement")

    @property
    def quantized(self) -> bool:
        """Rows kept in the file's block format (models/qweights.py), computed on as stored."""
        return self.up.qtype is not None

    @property
    def layout(self) -> FfnLayout | None:
        """The quantized matrices' current layouts (None: float weights)."""
        if not self.quantized:
            return None
        return FfnLayout(gate=self.gate.layout if self.gate is not None else MATVEC,
                         up=self.up.layout, down=self.down_t.layout,
                         down_qtype=self.down_t.qtype if self.down_t.layout == ROWS else None)

    # ---------------------------------------------------------------- placement
    @property
    def placed(self) -> bool:
        return not isinstance(self.backend, Unsplit)

    @property
    def cold_handle(self) -> int | None:
        """The cold rows' handle in the CUDA module's host store (GPU placements), else None."""
        return self.backend.handle if isinstance(self.backend, CudaHybrid) else None

    @property
    def n_hot(self) -> int:
        return self.up.weight.shape[0]

    def permute(self, order) -> None:
        """Reorder the neurons: new row j is old neuron order[j] (gate/up/down_t rows, up bias and
        the selector's per-neuron state). The FFN's output is unchanged."""
        if self.placed:
            fail("FFN.permute", "an unsplit FFN", "one already split")
        perm = np.asarray(order)
        f = self.up.weight.shape[0]
        if perm.shape != (f,) or not np.array_equal(np.sort(perm), np.arange(f)):
            fail("FFN.permute order", f"a permutation of range({f})", f"shape {perm.shape}")
        if self.quantized and (self.up.layout != ROWS or self.down_t.layout != ROWS or (
                self.gate is not None and self.gate.layout != ROWS)):
            fail("FFN.permute layouts", "rows (neurons move whole only as rows)",
                 self.layout, "load the model with rows: from_params(..., "
                 "ffn_layout=FfnLayout(ROWS, ROWS, ROWS))")
        perm = jnp.asarray(perm, jnp.int32)
        for lin in (self.gate, self.up, self.down_t):
            if lin is not None:
                lin.weight.set_value(lin.weight[...][perm])
        if self.up.bias is not None:
            self.up.bias.set_value(self.up.bias[...][perm])
        if self.selector is not None:
            self.selector.permute(perm)

    def split(self, n_hot: int, *, store: str = "auto") -> None:
        """Keep rows [0, n_hot) as the hot Params; move rows [n_hot, F) to host memory.

        store: "operands" (`ColdRows`, passed to the CPU custom call: `CpuHybrid`), "cuda" (the
        CUDA module's host store, referenced by handle: `CudaHybrid`), "auto" ("cuda" on a GPU
        backend with the CUDA build, else "operands"). With "cuda" and no cold rows (n_hot == F)
        the FFN stays unsplit: every row is on the device already."""
        if self.quantized:
            fail("FFN.split", "float rows (placement moves rows between memories)",
                 f"rows in {self.up.qtype} blocks", "build with weights='dtype'")
        f = self.up.weight.shape[0]
        if self.placed or not (isinstance(n_hot, int) and 0 <= n_hot <= f):
            fail("FFN.split n_hot", f"an integer in [0, {f}] on an unsplit FFN", n_hot,
                 f"placed={self.placed}")
        if store == "auto":
            store = "cuda" if cuda_hybrid_available() else "operands"
        if store not in ("operands", "cuda"):
            fail("FFN.split store", "'auto', 'operands' or 'cuda'", store)
        impl = self.backend.impl
        if store == "cuda":
            if n_hot < f:
                self._split_to_cuda_store(n_hot)
            return
        cold = {}
        for key, var in (("gate", self.gate and self.gate.weight), ("up", self.up.weight),
                         ("down_t", self.down_t.weight), ("b_up", self.up.bias)):
            if var is None:
                continue
            rows = var[...]
            cold[key] = ColdRows(rows[n_hot:])
            var.set_value(rows[:n_hot])
        self.cold = nnx.data(cold)
        self.n_cold = f - n_hot
        self.backend = CpuHybrid(impl=impl)

    def _split_to_cuda_store(self, n_hot: int) -> None:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        def rows(var):
            return None if var is None else np.asarray(jax.device_get(var[...][n_hot:]))

        f = self.up.weight.shape[0]
        gate = self.gate and self.gate.weight
        handle = _ffi.register_cold_rows(rows(self.up.weight), rows(self.down_t.weight),
                                         gate=rows(gate), b_up=rows(self.up.bias))
        weakref.finalize(self, _ffi.release_cold_rows, handle)
        for var in (gate, self.up.weight, self.down_t.weight, self.up.bias):
            if var is not None:
                var.set_value(var[...][:n_hot])
        self.n_cold = f - n_hot
        self.backend = CudaHybrid(handle=int(handle))

    # ---------------------------------------------------------------- dense math (XLA)
    def _rows_act(self, x_btd, gate, up, b_up):
        """Activations [B, T, F_rows] of the given rows, with XLA."""
        def proj(w):
            return jnp.einsum("btd,fd->btf", x_btd.astype(w.dtype), w, preferred_element_type=F32)
        u = proj(up) if b_up is None else proj(up) + b_up
        if gate is None:
            return activate(self.activation, u)
        return gated_activate(self.activation, proj(gate), u, self.gate_floor)

    def params_activations(self, x_btd):
        """Activations of the rows in the Params (all of them when unplaced), with XLA (on a
        quantized FFN: the gate and up projections through ops.qlinear)."""
        if self.quantized:
            if self.gate is None:
                return activate(self.activation, self.up(x_btd))

            # gate and up rows in one pool job (the same per-row kernel as two qlinear calls)
            g, u = ops.qlinear_many(x_btd, [self.gate.weight[...], self.up.weight[...]],
                                    [self.gate.kernel_qtype, self.up.kernel_qtype], self.up.d_in,
                                    [None, _value(self.up.bias)],
                                    impl=op_impl(self.kernels))
            return gated_activate(self.activation, g, u, self.gate_floor)
        return self._rows_act(x_btd, _value(self.gate and self.gate.weight), self.up.weight[...],
                              _value(self.up.bias))

    def _require_cold_operands(self, what: str) -> None:
        if isinstance(self.backend, CudaHybrid):
            fail(f"FFN.{what}", "the cold rows as operands (CPU hybrid)",
                 "them in the GPU host store",
                 "a GPU-placed FFN computes them only inside the hybrid custom call: use modes "
                 "dense, oracle or predictor")

    def activations(self, x_btd):
        """The neuron activations a [B, T, F] (float32), computed densely with XLA."""
        if not self.placed:
            return self.params_activations(x_btd)
        self._require_cold_operands("activations")
        c = self.cold
        cold = self._rows_act(x_btd, _value(c.get("gate")), c["up"][...], _value(c.get("b_up")))
        return jnp.concatenate([self.params_activations(x_btd), cold], axis=-1)

    def gate_magnitude(self, x_btd):
        """|act(gate . x)| [B, T, F] (non-gated: |a|): the threshold mode's criterion."""
        if self.gate is None:
            return jnp.abs(self.activations(x_btd))
        act = "relu" if self.activation == "drelu" else self.activation
        if self.quantized:
            return jnp.abs(activate(act, floor_gate(self.gate(x_btd), self.gate_floor)))
        gates = [self.gate.weight[...]]
        if self.placed:
            self._require_cold_operands("gate_magnitude")
            gates.append(self.cold["gate"][...])
        # act(gate . x): the gate rows as non-gated "up" rows
        return jnp.abs(jnp.concatenate([activate(act, floor_gate(jnp.einsum(
            "btd,fd->btf", x_btd.astype(g.dtype), g, preferred_element_type=F32), self.gate_floor))
            for g in gates], axis=-1))
