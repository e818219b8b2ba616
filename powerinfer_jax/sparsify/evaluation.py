"""Points of the learning curve during training: perplexity and FFN sparsity of the current student
as the evaluation CLI would measure them, in-process and on fewer chunks.

Mirrors `python -m powerinfer_jax.evaluate --sparsity oracle --target-sparsity T`: per-layer
thresholds calibrated on the *dense* forward of the same weights over corpus (training) text
(sparsity/thresholds.py: the quantile T of |a_i| per layer, of relu(gate_i) for fatrelu; ReLU
variants: 0, their natural zeros),
then a forward that keeps |a_i| > threshold (fatrelu: relu(gate_i) > threshold, the runtime's
threshold mode), scored on non-overlapping chunks of the validation text
(every token but the first). Float32 throughout. The final figure comes from the real pipeline
(export, calibrate, runtime.perplexity) on 16 chunks; these rows say how many chunks they used.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.models.layers import F32
from powerinfer_jax.sparsify import forward as fw


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _quantiles(graphdef, state, tokens_bt, spec: fw.FFNSpec, target: float):
    return fw.forward(nnx.merge(graphdef, state), tokens_bt, spec, quantile=target)[1]["quantile"]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _score(graphdef, state, tokens_bt, spec: fw.FFNSpec, thresholds, gate_threshold):
    logits, aux = fw.forward(nnx.merge(graphdef, state), tokens_bt, spec, thresholds=thresholds,
                             gate_threshold=gate_threshold)
    return fw.token_nll(logits, tokens_bt), jnp.mean(aux["zero_frac"])


def calibrate(model, spec: fw.FFNSpec, target: float, calib_nt: np.ndarray) -> np.ndarray:
    """[L] per-layer thresholds for `target` from the dense forward (no mask) of `model`'s weights,
    on the spec's mask magnitude (|a|, or relu(gate) for fatrelu); zeros for activations with exact
    zeros (relu, drelu), as the runtime's calibration gives them, unless the mask is on the gate
    (fatrelu: its thresholds are the model's)."""
    n_layers = model.config.n_layers
    if spec.mask_on == "act" and spec.activation in ("relu", "drelu"):
        return np.zeros(n_layers, np.float32)
    graphdef, state = nnx.split(model)
    dense = fw.FFNSpec(spec.activation, mask_on=spec.mask_on)
    qs = [np.asarray(_quantiles(graphdef, state, jnp.asarray(c[None]), dense, float(target)))
          for c in calib_nt]
    return np.mean(qs, axis=0).astype(np.float32)


def perplexity(model, spec: fw.FFNSpec, chunks_nt: np.ndarray, thresholds=None,
               gate_threshold=None) -> dict:
    """Perplexity and mean fraction of zero FFN activations over [n, ctx] chunks (relu/drelu:
    with FATReLU's `gate_threshold` when given)."""
    graphdef, state = nnx.split(model)
    thr = None if thresholds is None else jnp.asarray(thresholds, F32)
    gate = None if gate_threshold is None else jnp.float32(gate_threshold)
    nll, zero = 0.0, []
    for c in chunks_nt:
        a, z = _score(graphdef, state, jnp.asarray(c[None]), spec, thr, gate)
        nll += float(a)
        zero.append(float(z))
    scored = chunks_nt.shape[0] * (chunks_nt.shape[1] - 1)
    return {"ppl": math.exp(nll / scored), "ffn_sparsity": float(np.mean(zero)),
            "tokens_scored": int(scored), "chunks": int(chunks_nt.shape[0])}


class CurveEvaluator:
    """Evaluates students against the teacher's dense perplexity on the same chunks (computed once)."""

    def __init__(self, teacher, valid_nt: np.ndarray, calib_nt: np.ndarray, *, target: float,
                 dense: dict | None = None):
        """dense: the teacher's result on these chunks when already known (a resumed run's)."""
        self.valid_nt, self.calib_nt, self.target = valid_nt, calib_nt, target
        self.dense = dense or perplexity(teacher, fw.teacher_spec(teacher.config), valid_nt)

    def __call__(self, student, spec: fw.FFNSpec, gate_threshold=None) -> dict:
        thr = calibrate(student, spec, self.target, self.calib_nt)
        res = perplexity(student, spec, self.valid_nt, thr, gate_threshold)
        res.update(ppl_dense=self.dense["ppl"], ppl_x_dense=res["ppl"] / self.dense["ppl"],
                   thresholds=[float(t) for t in thr], gate_threshold=gate_threshold)
        return res
