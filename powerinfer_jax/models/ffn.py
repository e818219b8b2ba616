"""The feed-forward block: dense XLA matmuls or the neuron-aware sparse custom call.

Weights are neuron-major: `gate.weight` [F, D], `up.weight` [F, D], `down_t.weight` [F, D] (down
transposed), so neuron i's three rows are contiguous and a sparse kernel reads only active rows.
  gated:     a_i = act(gate_i . x) * (up_i . x + b_up_i)
  non-gated: a_i = act(up_i . x + b_up_i)
  y = b_down + sum_i a_i * down_t[i]

Sparse modes (SparsityConfig.mode) choose the active set handed to the custom call:
  oracle:    |a_i| > threshold, from the true activations (the quality upper bound)
  threshold: |act(gate_i . x)| > threshold, the gate computed densely (CATS-style)
  predictor: predictor logits > threshold, from `self.predictor` (attached after loading)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.models.layers import F32, Linear, _param, use_ffi


def activate(name: str, x):
    """The FFN activation by name. GELU is the tanh approximation, as the C++ kernels use."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "relu":
        return jax.nn.relu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation: expected one of ['silu', 'relu', 'gelu'], got {name!r}")


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

    def activations(self, x_btd):
        """The neuron activations a [B, T, F] (float32), computed densely."""
        up = self.up(x_btd)
        if self.gate is None:
            return activate(self.activation, up)
        return activate(self.activation, self.gate(x_btd)) * up

    def dense(self, x_btd):
        if use_ffi(self.kernels, x_btd, self.up.weight[...]):
            # Every neuron through the custom call: "oracle" with threshold 0 skips only exact
            # zeros, so this is the dense FFN, with rows streamed at their stored width.
            return self.sparse(x_btd, scores=None, threshold=0.0, impl="ffi")[0]
        return self.down_t(self.activations(x_btd))

    def gate_magnitude(self, x_btd):
        """|act(gate . x)| [B, T, F] (non-gated: |a|), the threshold mode's criterion."""
        if self.gate is None:
            return jnp.abs(self.activations(x_btd))
        return jnp.abs(activate(self.activation, self.gate(x_btd)))

    def mode_scores(self, x_btd, mode: str):
        """The scores [B, T, F] a sparse mode compares with its threshold (None: oracle)."""
        if mode == "threshold":
            return self.gate_magnitude(x_btd)
        if mode == "predictor":
            if self.predictor is None:
                raise ValueError("FFN.predictor: expected a predictor attached for "
                                 "sparsity mode 'predictor', got None (load sparsity artifacts)")
            return self.predictor(x_btd)
        return None

    def __call__(self, x_btd, *, sparsity: SparsityConfig, threshold: float = 0.0, scores=None):
        """Returns (y [B, T, D] float32, n_active [B, T] int32 or None for dense).

        scores: overrides the mode's own scores (tests feed exact masks this way).
        """
        if sparsity.mode == "dense":
            return self.dense(x_btd), None
        if scores is None:
            scores = self.mode_scores(x_btd, sparsity.mode)
        return self.sparse(x_btd, scores=scores, threshold=threshold, impl=sparsity.impl)

    def sparse(self, x_btd, *, scores, threshold: float, impl: str):
        """The custom call: neurons with scores > threshold, or |a_i| > threshold if scores is None."""
        from powerinfer_jax import ops

        criterion = "oracle" if scores is None else "scores"
        return ops.sparse_ffn(
            x_btd, self.up.weight[...], self.down_t.weight[...],
            w_gate=None if self.gate is None else self.gate.weight[...],
            b_up=None if self.up.bias is None else self.up.bias[...],
            b_down=None if self.down_t.bias is None else self.down_t.bias[...],
            scores=scores, threshold=float(threshold), activation=self.activation,
            criterion=criterion, impl=impl)
