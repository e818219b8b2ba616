"""Pure-jnp twins of the custom calls: the oracle every kernel is tested against.

Same signatures and semantics as powerinfer_jax.ops.api (without `impl`); float32 math throughout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.ops import nibble_rows
from powerinfer_jax.ops.qblocks import dequantize_rows, round_activations

_HIGHEST = jax.lax.Precision.HIGHEST


def activate(activation: str, v):
    """silu, relu, or the tanh-approximate gelu (jax.nn.gelu(approximate=True)) like the kernel.
    "drelu" applied to one projection is relu (its gated form is `gated_activate`)."""
    if activation == "silu":
        return jax.nn.silu(v)
    if activation in ("relu", "drelu"):
        return jax.nn.relu(v)
    if activation == "gelu":
        return jax.nn.gelu(v, approximate=True)
    raise ValueError(f"activation: expected one of ['silu', 'relu', 'gelu', 'drelu'], got "
                     f"{activation!r}")


def floor_gate(gate, gate_floor: float = 0.0):
    """FATReLU's gate (ProSparse's activation threshold shifting): gate values at or below
    gate_floor (> 0) become 0, so that relu(gate) is the gate where it exceeds the floor and 0
    elsewhere; NaN stays NaN. gate_floor 0 returns the gate as it is. The kernels' FloorGate."""
    return gate if not gate_floor else jnp.where(gate <= gate_floor, 0.0, gate)


def gated_activate(activation: str, gate, up, gate_floor: float = 0.0):
    """A gated FFN's activations from its gate and up projections (up bias included):
    act(gate) * up, or relu(gate) * relu(up) for "drelu" (dReLU: TurboSparse, PowerInfer's
    "bamboo"); gate_floor > 0 (relu, drelu): FATReLU's gate, `floor_gate`. The kernels'
    GatedActivate (cpu_backend/pij_math.h)."""
    gate = floor_gate(gate, gate_floor)
    if activation == "drelu":
        return jax.nn.relu(gate) * jax.nn.relu(up)
    return activate(activation, gate) * up


def _activations(x_td, w_up, w_gate, b_up, activation, gate_floor=0.0):
    """a [..., T, F] = act(gate.x) * (up.x + b_up) (gated) or act(up.x + b_up), float32."""
    up_tf = jnp.einsum("...TD,FD->...TF", x_td, w_up.astype(jnp.float32), precision=_HIGHEST)
    if b_up is not None:
        up_tf = up_tf + b_up.astype(jnp.float32)
    if w_gate is None:
        return activate(activation, up_tf)
    gate_tf = jnp.einsum("...TD,FD->...TF", x_td, w_gate.astype(jnp.float32), precision=_HIGHEST)
    return gated_activate(activation, gate_tf, up_tf, gate_floor)


def sparse_ffn(x, w_up, w_down_t, *, w_gate=None, b_up=None, b_down=None, scores=None,
               threshold=0.0, activation="silu", criterion="scores", gate_floor=0.0):
    """Returns (y [..., T, D] float32, n_active [..., T] int32). See ops.api.sparse_ffn."""
    # "not <=" rather than ">": a NaN activation or score counts as active, so a NaN input
    # reaches the output as in a dense FFN (the kernels' rule, cpu_backend/pij_math.h).
    x_td = jnp.asarray(x, jnp.float32)
    if criterion == "activations":  # the scores are the activations; gate/up are not read
        act_tf = jnp.asarray(scores, jnp.float32)
        mask_tf = ~(jnp.abs(act_tf) <= threshold)
    else:
        act_tf = _activations(x_td, w_up, w_gate, b_up, activation, gate_floor)
        if criterion == "scores":
            mask_tf = ~(jnp.asarray(scores, jnp.float32) <= threshold)
        else:
            mask_tf = ~(jnp.abs(act_tf) <= threshold)
    act_tf = jnp.where(mask_tf, act_tf, 0.0)
    y_td = jnp.einsum("...TF,FD->...TD", act_tf, w_down_t.astype(jnp.float32),
                      precision=_HIGHEST)
    if b_down is not None:
        y_td = y_td + b_down.astype(jnp.float32)
    return y_td, jnp.sum(mask_tf, axis=-1, dtype=jnp.int32)


def linear(x, w, b=None):
    """y = x @ w.T (+ b) in float32; w stored [O, D]."""
    y = jnp.einsum("...D,OD->...O", jnp.asarray(x, jnp.float32), w.astype(jnp.float32),
                   precision=_HIGHEST)
    return y if b is None else y + b.astype(jnp.float32)


def q4_scores(x, q, dm, b_up=None, *, activation="silu", signed=False):
    """The q4 predictor's estimates |a| (or a if signed) [..., T, F] float32. See
    ops.api.q4_scores."""
    x = jnp.asarray(x, jnp.float32)
    w_fgd = nibble_rows.dequantize(q, dm, x.shape[-1])
    xq = round_activations(x, nibble_rows.BLOCK)
    proj = jnp.einsum("...d,fgd->...fg", xq, w_fgd, precision=_HIGHEST)
    b = 0.0 if b_up is None else jnp.asarray(b_up, jnp.float32)
    if w_fgd.shape[1] == 2:
        a = gated_activate(activation, proj[..., 0], proj[..., 1] + b)
    else:
        a = activate(activation, proj[..., 0] + b)
    return a if signed else jnp.abs(a)


def q4_sparse_ffn(x, q, dm, w_down_t, b_up=None, b_down=None, *, threshold, activation="silu"):
    """The q4 FFN: q4 estimates as activations. See ops.api.q4_sparse_ffn."""
    a = q4_scores(x, q, dm, b_up, activation=activation, signed=True)
    return sparse_ffn(x, w_down_t, w_down_t, b_down=b_down, scores=a, threshold=threshold,
                      criterion="activations")


def _qblock(qtype: str) -> int:
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    return quants.block_size(qtype)[0]


def qlinear(x, blocks, qtype: str, in_features: int, b=None):
    """y = round_activations(x) @ dequant(blocks).T (+ b), float32. See ops.api.qlinear."""
    w = dequantize_rows(blocks, qtype, in_features)
    xq = round_activations(x, _qblock(qtype))
    y = jnp.einsum("...D,OD->...O", xq, w, precision=_HIGHEST)
    return y if b is None else y + jnp.asarray(b, jnp.float32)


def moe_ffn(x, ids, weights, gate, up, down, *, gate_qtype: str, up_qtype: str,
            down_qtype: str, activation: str = "silu", mid_thresholds=None):
    """Every expert on every token through qlinear (rounded activations), weighted by the
    routing (unrouted experts 0), every neuron computed (a relu neuron that does not fire adds
    0: the sparse path's oracle). Down groups go back to the file's rows. Returns (y, kept): see
    ops.api.moe_ffn."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    x = jnp.asarray(x, jnp.float32)
    n, d = x.shape
    e, f = gate.shape[0], gate.shape[1]
    grouped = quants.groups_base(down_qtype) is not None
    down_qtype = quants.groups_base(down_qtype) or down_qtype
    if grouped:
        def file_rows(g):
            return np.stack([quants.down_groups_to_file(np.asarray(b), down_qtype, d, f)
                             for b in g])

        down = jax.pure_callback(file_rows, jax.ShapeDtypeStruct(
            (e, d, quants.row_bytes(down_qtype, f)), jnp.uint8), down)
    ids = jnp.asarray(ids, jnp.int32)  # -1: another shard's expert, adds nothing (dropped)
    pair = (jnp.arange(n)[:, None], jnp.where(ids < 0, e, ids))  # [N, E] cells of each pair
    w_ne = jnp.zeros((n, e), jnp.float32).at[pair].add(weights, mode="drop")
    routed = jnp.zeros((n, e), jnp.int32).at[pair].add(1, mode="drop")  # pairs, for kept
    y = jnp.zeros((n, d), jnp.float32)
    # down groups of the 8-bit formats sum float coefficients (AxpyGroup), unrounded; the
    # 4-bit ones round them to 8 bits per 32 neurons, as the dense matvec rounds its input
    float_coefs = grouped and down_qtype not in quants.DOWN_PAIR_TYPES
    kept = jnp.zeros((n,), jnp.int32)
    for i in range(e):  # the reference: a loop over experts, not over neurons
        h = gated_activate(activation, qlinear(x, gate[i], gate_qtype, d),
                           qlinear(x, up[i], up_qtype, d))
        if mid_thresholds is not None:
            h = jnp.where(jnp.abs(h) < mid_thresholds[i], 0.0, h)
        kept = kept + routed[:, i] * jnp.sum(h != 0, axis=-1, dtype=jnp.int32)
        if float_coefs:
            down_e = jnp.einsum("nf,df->nd", h, dequantize_rows(down[i], down_qtype, f),
                                precision=_HIGHEST)
        else:
            down_e = qlinear(h, down[i], down_qtype, f)
        y = y + w_ne[:, i:i + 1] * down_e
    return y, kept


def qembedding(ids, blocks, qtype: str, in_features: int):
    """Rows ids of the table, dequantized (float32 [..., in_features]). See ops.api.qembedding."""
    ids = jnp.asarray(ids, jnp.int32)
    rows = jnp.take(jnp.asarray(blocks), ids.reshape(-1), axis=0)
    return dequantize_rows(rows, qtype, in_features).reshape(ids.shape + (in_features,))


def qsparse_ffn(x, up, down, *, up_qtype, down_qtype, gate=None, gate_qtype=None, b_up=None,
                b_down=None, scores=None, threshold=0.0, activation="silu", criterion="oracle",
                gate_floor=0.0):
    """The quantized sparse FFN, from dequantized weights and rounded activations. See
    ops.api.qsparse_ffn."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    d = x.shape[-1]
    up_tf = qlinear(x, up, up_qtype, d, b_up)
    if gate is None:
        act_tf = activate(activation, up_tf)
    else:
        gate_qtype = up_qtype if gate_qtype is None else gate_qtype
        act_tf = gated_activate(activation, qlinear(x, gate, gate_qtype, d), up_tf, gate_floor)
    if criterion == "scores":  # "not <=": NaN counts as active, as in sparse_ffn
        mask_tf = ~(jnp.asarray(scores, jnp.float32) <= threshold)
    else:
        mask_tf = ~(jnp.abs(act_tf) <= threshold)
    grouped = quants.groups_base(down_qtype) is not None
    down_qtype = quants.groups_base(down_qtype) or down_qtype
    if grouped:  # back to the file's ffn_down [D, F] blocks, dequantized, as [F, D]
        f = down.shape[0] * 32

        def file_blocks(g):
            return quants.down_groups_to_file(np.asarray(g), down_qtype, d, f)

        file_ds = jax.ShapeDtypeStruct((d, quants.row_bytes(down_qtype, f)), jnp.uint8)
        w_down = dequantize_rows(jax.pure_callback(file_blocks, file_ds, down), down_qtype, f).T
    else:
        w_down = dequantize_rows(down, down_qtype, d)
    coef_tf = jnp.where(mask_tf, act_tf, 0.0)
    if down_qtype in quants.DOWN_PAIR_TYPES and (grouped or down.shape[0] % 32 == 0):
        # 8-bit coefs per 32 neurons (AxpyPairs; 4-bit rows as PowerInfer's Q4_0 axpy)
        coef_tf = round_activations(coef_tf, 32)
    y = jnp.einsum("...F,FD->...D", coef_tf, w_down, precision=_HIGHEST)
    if b_down is not None:
        y = y + jnp.asarray(b_down, jnp.float32)
    return y, jnp.sum(mask_tf, axis=-1, dtype=jnp.int32)
