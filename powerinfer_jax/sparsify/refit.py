"""Closed-form least-squares refit of each layer's down rows under the student's sparse activations.

Zeroing most of a layer's activations (or swapping its activation) leaves the surviving neurons'
down rows tuned for the dense sum. Layer by layer, bottom up, with the student's own (already
refitted) lower layers feeding it, we solve for new down rows W [F, D]:

    min_W ||A W - Y||^2 + lam ||W - W0||^2   ->   (A^T A + lam I) W = A^T Y + lam W0

A [N, F]: the student's masked activations on N profiled tokens; W0: the current rows (the ridge
pulls neurons the data never activates back to them); Y [N, D]: "local" the dense (teacher's)
FFN output on the same FFN input, or "residual" the teacher's residual stream after the layer
minus the student's before its FFN (which also absorbs the error of the layers below).
lam = ridge * trace(A^T A) / F. Forward and A^T A in float32, the solve in float64.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.models.layers import F32
from powerinfer_jax.sparsify.forward import FFNSpec, block_forward, ffn_activations, layer_quantile
from powerinfer_jax.sparsify.forward import mask_activations, mask_magnitude, _proj

BATCH_SEQUENCES = 8  # sequences per jitted call


@functools.partial(jax.jit, static_argnums=0)
def _attention(graphdef, state, x_btd):
    """The block's attention half: (x after attention, FFN input)."""
    layer = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(x_btd.shape[1]), x_btd.shape[:2])
    x = layer.attention_residual(x_btd, positions)
    return x, layer.ffn_norm(x)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _activations(graphdef, state, h_btd, student: FFNSpec, teacher: FFNSpec, threshold):
    """(student's masked activations, dense FFN output of the teacher's activation)."""
    ffn = nnx.merge(graphdef, state).ffn
    g = _proj(h_btd, ffn.gate.weight[...])
    u = _proj(h_btd, ffn.up.weight[...])
    a_s = ffn_activations(student.activation, g, u)
    if student.target is not None:
        a_s = mask_activations(a_s, student, threshold, mask_magnitude(student, a_s, g))
    a_t = ffn_activations(teacher.activation, g, u)
    w = ffn.down_t.weight[...]
    return a_s, jnp.einsum("btf,fd->btd", a_t, w, preferred_element_type=F32)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _magnitudes(graphdef, state, h_btd, student: FFNSpec):
    """The student's unmasked mask magnitudes (|a| or relu(gate)), the layer threshold's sample."""
    ffn = nnx.merge(graphdef, state).ffn
    g = _proj(h_btd, ffn.gate.weight[...])
    u = _proj(h_btd, ffn.up.weight[...])
    return mask_magnitude(student, ffn_activations(student.activation, g, u), g)


def _batches(x, fn):
    return [fn(x[i:i + BATCH_SEQUENCES]) for i in range(0, x.shape[0], BATCH_SEQUENCES)]


def refit_down_rows(student, teacher, tokens_nt: np.ndarray, student_spec: FFNSpec,
                    teacher_spec: FFNSpec, *, target: str = "local", ridge: float = 1e-3,
                    progress: bool = True) -> dict:
    """Refit every layer's `ffn.down_t.weight` of `student` in place (see the module docstring).
    Both models float32 with kernels="xla"; `teacher` is the dense model (same weights as the
    student's gate/up/attention). Returns per-layer relative residuals before and after."""
    if target not in ("local", "residual"):
        raise ValueError(f"refit target: expected 'local' or 'residual', got {target!r}")
    x_s = np.asarray(student.tok_embed[...])[tokens_nt].astype(np.float32)
    x_t = x_s.copy()
    report = {"before": [], "after": [], "thresholds": []}
    layers = range(len(student.layers))
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="refit down rows", unit="layer")
    for l in layers:
        s_def, s_state = nnx.split(student.layers[l])
        mid = _batches(x_s, lambda xb: _attention(s_def, s_state, jnp.asarray(xb)))
        x_mid = np.concatenate([np.asarray(m[0]) for m in mid])
        h = np.concatenate([np.asarray(m[1]) for m in mid])
        thr = None
        if student_spec.target is not None:
            sample = np.concatenate(_batches(h, lambda hb: np.asarray(_magnitudes(
                s_def, s_state, jnp.asarray(hb), student_spec))))
            thr = float(layer_quantile(jnp.asarray(sample), student_spec.target))
        out = _batches(h, lambda hb: _activations(s_def, s_state, jnp.asarray(hb), student_spec,
                                                  teacher_spec, thr))
        a = np.concatenate([np.asarray(o[0]) for o in out])
        a = a.reshape(-1, a.shape[-1])  # [N, F]
        if target == "local":
            y = np.concatenate([np.asarray(o[1]) for o in out]).reshape(a.shape[0], -1)
        else:
            t_def, t_state = nnx.split(teacher.layers[l])
            x_t = np.concatenate(_batches(x_t, lambda xb: np.asarray(_teacher_block(
                t_def, t_state, jnp.asarray(xb), teacher_spec))))
            y = (x_t - x_mid).reshape(a.shape[0], -1)
        w0 = np.asarray(student.layers[l].ffn.down_t.weight[...], np.float64)
        w = solve_ridge(a, y, w0, ridge)
        report["before"].append(relative_residual(a, y, w0))
        report["after"].append(relative_residual(a, y, w))
        report["thresholds"].append(thr)
        student.layers[l].ffn.down_t.weight.set_value(jnp.asarray(w, F32))
        x_s = x_mid + (a @ w.astype(np.float32)).reshape(x_mid.shape)
    return report


@functools.partial(jax.jit, static_argnums=(0, 3))
def _teacher_block(graphdef, state, x_btd, spec: FFNSpec):
    layer = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(x_btd.shape[1]), x_btd.shape[:2])
    return block_forward(layer, x_btd, positions, spec)[0]


def solve_ridge(a_nf: np.ndarray, y_nd: np.ndarray, w0_fd: np.ndarray, ridge: float) -> np.ndarray:
    """argmin_W ||a W - y||^2 + lam ||W - w0||^2 with lam = ridge * trace(a^T a) / F (float64)."""
    a = np.asarray(a_nf, np.float32)
    gram = (a.T @ a).astype(np.float64)  # float32 GEMM (2x faster), float64 solve
    lam = ridge * max(np.trace(gram) / gram.shape[0], 1e-12)
    rhs = (a.T @ np.asarray(y_nd, np.float32)).astype(np.float64) + lam * w0_fd
    gram[np.diag_indices_from(gram)] += lam
    return np.linalg.solve(gram, rhs)


def relative_residual(a_nf, y_nd, w_fd) -> float:
    """||a w - y|| / ||y||."""
    r = np.asarray(a_nf, np.float64) @ np.asarray(w_fd, np.float64) - y_nd
    return float(np.linalg.norm(r) / max(np.linalg.norm(y_nd), 1e-30))
