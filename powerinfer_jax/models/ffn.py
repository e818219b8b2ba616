"""The feed-forward block: dense XLA matmuls or the neuron-aware sparse custom call.

Weights are neuron-major: `gate.weight` [F, D], `up.weight` [F, D], `down_t.weight` [F, D] (down
transposed), so neuron i's three rows are contiguous and a sparse kernel reads only active rows.
  gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)
  non-gated: a_i = act(up_i . x + b_up_i)
  y = b_down + sum_i a_i * down_t[i]

Sparse modes (SparsityConfig.mode) choose the active set handed to the custom call:
  oracle:    |a_i| > threshold, from the true activations (the quality upper bound)
  threshold: |act(gate_i . x)| > threshold, the gate computed densely (CATS-style)
  predictor: predictor scores > threshold, from `self.predictor` (attached after loading: the q4
             estimate of |a_i| or a low-rank MLP's logits)

Placed (hybrid) FFNs: `permute(order)` reorders the neurons (and the predictor's outputs) so the
hot ones come first, then `split(n_hot)` keeps rows [0, n_hot) in the Params (the accelerator's
rows) and moves rows [n_hot, F) into `HostRows` variables (`self.cold`). A placed FFN computes the
hot rows with XLA (jnp, masked by the active set) and the cold rows with the FFI custom call on the
host pool, and adds the two partial sums. See sparsity/placement.py and models/hybrid.py.

On a GPU backend with the CUDA build, `split` instead copies the cold rows once into the host store
of the CUDA module (ops/_ffi.register_cold_rows) and keeps only its handle (`cold_handle`, a static
attribute, so no cold byte is ever an XLA operand or device buffer). The FFN then runs as one custom
call: the predicted-active hot rows in CUDA kernels on XLA's stream and the cold rows on the host
pool, overlapped (xla_ffi/sparse_ffn_hybrid_cuda.cu). Modes that need every row's activations on
the device (threshold; `activations`) are rejected there with a clear error.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.models.layers import F32, Linear, _param, use_ffi
from powerinfer_jax.ops.reference import (  # pure jnp, shared with the kernels' oracle
    activate, gated_activate)


def cuda_hybrid_available() -> bool:
    """A GPU backend and the CUDA build (powerinfer_jax._pij_cuda): placed FFNs keep their cold
    rows in the CUDA module's host store and run the hybrid custom call."""
    if jax.default_backend() != "gpu":
        return False
    try:
        from powerinfer_jax.ops import _ffi
    except ImportError:
        return False
    return _ffi._pij_cuda is not None


class HostRows(nnx.Variable):
    """FFN rows kept in host memory: the cold part of a placed FFN."""


class DownT(nnx.Module):
    """The down projection stored transposed: weight [F, D] (row i is neuron i), bias [D]."""

    def __init__(self, d_ff: int, d_model: int, *, bias: bool, dtype, rngs: nnx.Rngs | None):
        self.weight = _param((d_ff, d_model), dtype, rngs, scale=d_ff ** -0.5)
        self.bias = _param((d_model,), F32, None) if bias else None

    def __call__(self, a_btf):
        w = self.weight[...]
        y = jnp.einsum("btf,fd->btd", a_btf.astype(w.dtype), w, preferred_element_type=F32)
        return y + self.bias[...] if self.bias is not None else y


class FFN(nnx.Module):
    def __init__(self, *, d_model: int, d_ff: int, activation: str, gated: bool, bias: bool,
                 dtype, rngs: nnx.Rngs | None, kernels: str = "xla"):
        self.activation = activation
        self.kernels = kernels
        lin = dict(dtype=dtype, rngs=rngs, kernels=kernels)
        self.gate = Linear(d_model, d_ff, bias=False, **lin) if gated else None
        self.up = Linear(d_model, d_ff, bias=bias, **lin)
        self.down_t = DownT(d_ff, d_model, bias=bias, dtype=dtype, rngs=rngs)
        self.predictor = nnx.data(None)  # a sparsity.predictor.Predictor, for predictor mode
        self.cold = nnx.data(None)  # after split(): {"gate", "up", "down_t", "b_up"} HostRows
        self.cold_handle = None  # after split() on a GPU: the cold rows' handle in the host store
        self.n_cold = 0  # rows in self.cold or behind cold_handle

    @property
    def placed(self) -> bool:
        return self.cold is not None or self.cold_handle is not None

    def permute(self, order) -> None:
        """Reorder the neurons: new row j is old neuron order[j] (gate/up/down_t rows, up bias and
        the predictor's output rows). The FFN's output is unchanged."""
        if self.placed:
            raise ValueError("FFN.permute: expected an unsplit FFN, got one already split")
        perm = jnp.asarray(order, jnp.int32)
        f = self.up.weight.shape[0]
        if perm.shape != (f,) or not bool(jnp.all(jnp.sort(perm) == jnp.arange(f))):
            raise ValueError(f"FFN.permute: expected a permutation of range({f}), got shape "
                             f"{perm.shape}")
        for lin in (self.gate, self.up, self.down_t):
            if lin is not None:
                lin.weight.set_value(lin.weight[...][perm])
        if self.up.bias is not None:
            self.up.bias.set_value(self.up.bias[...][perm])
        if self.predictor is not None:
            self.predictor.permute(perm)

    def split(self, n_hot: int, *, store: str = "auto") -> None:
        """Keep rows [0, n_hot) as the hot Params; move rows [n_hot, F) to host rows.

        store: where the cold rows go. "operands": `HostRows` variables, passed to the CPU custom
        call as operands (the CPU-only hybrid). "cuda": the CUDA module's host store, referenced
        by handle (GPU builds). "auto": "cuda" on a GPU backend with the CUDA build, else
        "operands". With "cuda" and no cold rows (n_hot == F) the FFN stays unsplit: every row
        is on the device already."""
        f = self.up.weight.shape[0]
        if self.placed or not (isinstance(n_hot, int) and 0 <= n_hot <= f):
            raise ValueError(f"FFN.split: n_hot: expected an integer in [0, {f}] on an unsplit "
                             f"FFN, got {n_hot!r} (placed={self.placed})")
        if store == "auto":
            store = "cuda" if cuda_hybrid_available() else "operands"
        if store not in ("operands", "cuda"):
            raise ValueError(f"FFN.split: store: expected 'auto', 'operands' or 'cuda', got "
                             f"{store!r}")
        if store == "cuda":
            if n_hot < f:
                self._split_to_cuda_store(n_hot)
            return
        cold = {}
        for key, var in (("gate", None if self.gate is None else self.gate.weight),
                         ("up", self.up.weight), ("down_t", self.down_t.weight),
                         ("b_up", self.up.bias)):
            if var is None:
                continue
            rows = var[...]
            cold[key] = HostRows(rows[n_hot:])
            var.set_value(rows[:n_hot])
        self.cold = nnx.data(cold)
        self.n_cold = f - n_hot

    def _split_to_cuda_store(self, n_hot: int) -> None:
        import weakref

        import numpy as np

        from powerinfer_jax.ops import _ffi

        def rows(var):
            return None if var is None else np.asarray(jax.device_get(var[...][n_hot:]))

        f = self.up.weight.shape[0]
        gate = None if self.gate is None else self.gate.weight
        handle = _ffi.register_cold_rows(rows(self.up.weight), rows(self.down_t.weight),
                                         gate=rows(gate), b_up=rows(self.up.bias))
        weakref.finalize(self, _ffi.release_cold_rows, handle)
        for var in (gate, self.up.weight, self.down_t.weight, self.up.bias):
            if var is not None:
                var.set_value(var[...][:n_hot])
        self.cold_handle = int(handle)
        self.n_cold = f - n_hot

    @property
    def n_hot(self) -> int:
        return self.up.weight.shape[0]

    def _rows_act(self, x_btd, gate, up, b_up):
        """Activations [B, T, F_rows] of the given rows, with XLA."""
        def proj(w):
            return jnp.einsum("btd,fd->btf", x_btd.astype(w.dtype), w, preferred_element_type=F32)
        u = proj(up) if b_up is None else proj(up) + b_up
        return activate(self.activation, u) if gate is None else gated_activate(
            self.activation, proj(gate), u)

    def _hot_act(self, x_btd):
        return self._rows_act(x_btd, None if self.gate is None else self.gate.weight[...],
                              self.up.weight[...],
                              None if self.up.bias is None else self.up.bias[...])

    def _cold_act(self, x_btd):
        c = self.cold
        return self._rows_act(x_btd, c["gate"][...] if "gate" in c else None, c["up"][...],
                              c["b_up"][...] if "b_up" in c else None)

    def hybrid(self, x_btd, *, scores, threshold: float, impl: str, dense: bool,
               criterion: str | None = None):
        """Hot rows with XLA, cold rows through the custom call, summed. dense: every neuron
        (cold ones through the custom call's oracle at threshold 0). criterion: as `sparse`.
        Returns (y, n_active|None)."""
        from powerinfer_jax import ops

        if dense:
            criterion, scores = "oracle", None
        elif criterion is None:
            criterion = "oracle" if scores is None else "scores"
        if self.cold_handle is not None:
            return self._hybrid_cuda(x_btd, scores=scores, threshold=0.0 if dense else threshold,
                                     criterion=criterion, dense=dense)
        n_hot, c = self.n_hot, self.cold
        n_cold = c["up"][...].shape[0]
        b_down = None if self.down_t.bias is None else self.down_t.bias[...]
        y = jnp.zeros(x_btd.shape[:-1] + (self.down_t.weight.shape[1],), F32)
        count = jnp.zeros(x_btd.shape[:-1], jnp.int32)
        if n_hot:
            # [B, T, F_hot]; "activations": the scores are the activations (no gate/up rows read)
            a = scores[..., :n_hot] if criterion == "activations" else self._hot_act(x_btd)
            if not dense:
                mask = scores[..., :n_hot] > threshold if criterion == "scores" else \
                    jnp.abs(a) > threshold
                a = jnp.where(mask, a, 0.0)
                count = count + jnp.sum(mask, axis=-1, dtype=jnp.int32)
            w = self.down_t.weight[...]
            y = y + jnp.einsum("btf,fd->btd", a.astype(w.dtype), w, preferred_element_type=F32)
        if n_cold:
            y_cold, n_active_cold = ops.sparse_ffn(
                x_btd, c["up"][...], c["down_t"][...],
                w_gate=c["gate"][...] if "gate" in c else None,
                b_up=c["b_up"][...] if "b_up" in c else None, b_down=None,
                scores=None if scores is None else scores[..., n_hot:],
                threshold=0.0 if dense else float(threshold), activation=self.activation,
                criterion=criterion, impl=impl)
            y = y + y_cold
            count = count + n_active_cold
        if b_down is not None:
            y = y + b_down
        return y, (None if dense else count)

    def _hybrid_cuda(self, x_btd, *, scores, threshold: float, criterion: str, dense: bool):
        """The GPU hybrid: one custom call, hot rows on the device, cold rows behind the handle."""
        from powerinfer_jax.ops import _ffi

        if criterion == "activations":
            raise ValueError("FFN (GPU hybrid): criterion: expected 'scores' or 'oracle', got "
                             "'activations' (--gate-up q4 runs on the CPU backend only)")
        lead, d = x_btd.shape[:-1], x_btd.shape[-1]
        x = x_btd.reshape(-1, d)
        s = None if scores is None else scores.reshape(x.shape[0], -1)
        n_hot = self.n_hot
        y, count = _ffi.sparse_ffn_hybrid(
            x, self.up.weight[...], self.down_t.weight[...],
            w_gate=None if self.gate is None else self.gate.weight[...],
            b_up=None if self.up.bias is None else self.up.bias[...],
            b_down=None if self.down_t.bias is None else self.down_t.bias[...],
            scores=None if s is None else s[:, :n_hot],
            scores_cold=None if s is None else s[:, n_hot:], threshold=float(threshold),
            activation=self.activation, criterion=criterion, cold_handle=self.cold_handle)
        return y.reshape(lead + (d,)), (None if dense else count.reshape(lead))

    def _require_cold_operands(self, what: str) -> None:
        if self.cold_handle is not None:
            raise ValueError(f"FFN.{what}: expected the cold rows as operands (CPU hybrid), got "
                             "them in the GPU host store (a GPU-placed FFN computes them only "
                             "inside the hybrid custom call: use modes dense, oracle or predictor)")

    def activations(self, x_btd):
        """The neuron activations a [B, T, F] (float32), computed densely."""
        if self.placed:
            self._require_cold_operands("activations")
            return jnp.concatenate([self._hot_act(x_btd), self._cold_act(x_btd)], axis=-1)
        up = self.up(x_btd)
        if self.gate is None:
            return activate(self.activation, up)
        return gated_activate(self.activation, self.gate(x_btd), up)

    def dense(self, x_btd):
        if self.placed:
            return self.hybrid(x_btd, scores=None, threshold=0.0, impl="ffi", dense=True)[0]
        if use_ffi(self.kernels, x_btd, self.up.weight[...]):
            # Every neuron through the custom call: "oracle" with threshold 0 skips only exact
            # zeros, so this is the dense FFN, with rows streamed at their stored width.
            return self.sparse(x_btd, scores=None, threshold=0.0, impl="ffi")[0]
        return self.down_t(self.activations(x_btd))

    def gate_magnitude(self, x_btd):
        """|act(gate . x)| [B, T, F] (non-gated: |a|), the threshold mode's criterion."""
        if self.gate is None or self.placed:
            if self.placed:
                self._require_cold_operands("gate_magnitude")
            if self.gate is not None:  # placed: |act(gate)| over hot and cold rows, with XLA
                return jnp.abs(jnp.concatenate(  # act(gate . x): the gate rows as "up" rows
                    [self._rows_act(x_btd, None, self.gate.weight[...], None),
                     self._rows_act(x_btd, None, self.cold["gate"][...], None)], axis=-1))
            return jnp.abs(self.activations(x_btd))
        return jnp.abs(activate(self.activation, self.gate(x_btd)))

    def mode_scores(self, x_btd, mode: str, *, signed: bool = False):
        """The scores [B, T, F] a sparse mode compares with its threshold (None: oracle).
        signed: the q4 predictor's signed estimates a_i (SparsityConfig.gate_up == "q4")."""
        if mode == "threshold":
            return self.gate_magnitude(x_btd)
        if mode == "predictor":
            if self.predictor is None:
                raise ValueError("FFN.predictor: expected a predictor attached for "
                                 "sparsity mode 'predictor', got None (load sparsity artifacts)")
            if not signed:
                return self.predictor(x_btd)
            return self._q4_predictor()(x_btd, signed=True)
        return None

    def _q4_predictor(self):
        from powerinfer_jax.sparsity.q4_predictor import Q4Predictor

        if not isinstance(self.predictor, Q4Predictor):
            raise ValueError("FFN.predictor: expected the q4 predictor for gate_up='q4', got "
                             f"{type(self.predictor).__name__}")
        return self.predictor

    def q4_ffn(self, x_btd, *, threshold: float, impl: str):
        """gate_up="q4" on an unplaced FFN: the q4 predictor's estimates are the activations. With
        impl "ffi" one custom call estimates, selects and reads the active down rows."""
        import jax

        pred = self._q4_predictor()
        if impl != "ffi" or jax.default_backend() != "cpu":
            # The q4 custom calls are CPU-only: elsewhere the jnp reference runs (through XLA).
            return self.sparse(x_btd, scores=pred(x_btd, signed=True), threshold=threshold,
                               impl="reference", criterion="activations")
        return pred.sparse_ffn(x_btd, self.down_t.weight[...],
                               None if self.down_t.bias is None else self.down_t.bias[...],
                               threshold=float(threshold))

    def __call__(self, x_btd, *, sparsity: SparsityConfig, threshold: float = 0.0, scores=None):
        """Returns (y [B, T, D] float32, n_active [B, T] int32 or None for dense).

        scores: overrides the mode's own scores (tests feed exact masks this way; with
        sparsity.gate_up == "q4" they are the activations themselves).
        """
        if sparsity.mode == "dense":
            return self.dense(x_btd), None
        q4_gate_up = sparsity.gate_up == "q4"
        if q4_gate_up and scores is None and not self.placed:
            return self.q4_ffn(x_btd, threshold=threshold, impl=sparsity.impl)
        if scores is None:
            scores = self.mode_scores(x_btd, sparsity.mode, signed=q4_gate_up)
        return self.sparse(x_btd, scores=scores, threshold=threshold, impl=sparsity.impl,
                           criterion="activations" if q4_gate_up else None)

    def sparse(self, x_btd, *, scores, threshold: float, impl: str, criterion: str | None = None):
        """The custom call: neurons with scores > threshold, or |a_i| > threshold if scores is None.
        criterion="activations": scores are the neurons' activations; only down rows are read."""
        from powerinfer_jax import ops

        if self.placed:
            return self.hybrid(x_btd, scores=scores, threshold=threshold, impl=impl, dense=False,
                               criterion=criterion)
        if criterion is None:
            criterion = "oracle" if scores is None else "scores"
        return ops.sparse_ffn(
            x_btd, self.up.weight[...], self.down_t.weight[...],
            w_gate=None if self.gate is None else self.gate.weight[...],
            b_up=None if self.up.bias is None else self.up.bias[...],
            b_down=None if self.down_t.bias is None else self.down_t.bias[...],
            scores=scores, threshold=float(threshold), activation=self.activation,
            criterion=criterion, impl=impl)
