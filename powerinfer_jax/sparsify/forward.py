"""The training forward of teacher and student, written over the model's modules and arrays.

Per block: `layer.attention_residual` (its XLA path, no cache), `layer.ffn_norm`, then the FFN
from its arrays (`ffn.gate.weight`, `ffn.up.weight`, `ffn.down_t.weight`) with the student's
activation and mask; at the end `model.final_norm` and the (tied or untied) vocabulary matrix. The
models must be built with kernels="xla" (custom calls have no gradient).

Mixed precision: the matrices are cast to `compute_dtype` inside the jitted step (master weights
stay float32, gradients flow through the cast); every matmul accumulates in float32 and the
residual stream, norms, softmax and activations are float32. On this session's CPU (AVX-512 with
bf16) bfloat16 matmuls measured 1.2-1.5x faster per training step than float32.

Axis letters as in models/layers.py: B batch, T tokens, D model, F neurons, V vocab, L layers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from powerinfer_jax.models.layers import F32
from powerinfer_jax.ops.reference import activate

ACTIVATION_OF_VARIANT = {"relu": "relu", "drelu": "drelu"}  # threshold: the teacher's own
QUANTILE_MAX_TOKENS = 256  # tokens per batch the layer threshold's quantile is taken over


@dataclasses.dataclass(frozen=True)
class FFNSpec:
    """How a forward computes each FFN's activations.

    activation: "silu", "relu", "gelu" (act(gate) * up) or "drelu" (relu(gate) * relu(up)).
    target: zero a_i where its mask magnitude (`mask_on`) is under the quantile `target` of the
      layer's in this batch ("layer"), or keep each token's round((1 - target) * F) largest
      ("token"); None: no mask (the teacher, the relu and drelu variants). Fixed per-layer
      thresholds passed to `forward` take precedence (evaluation).
    ste: straight-through gradient for the mask (the backward pass sees the unmasked activation).
    mask_on: what the mask compares: "act" (|a_i|) or "gate" (the gate activation relu(g_i):
      FATReLU with one threshold per layer, what the runtime's threshold mode computes on a ReLU
      model: neuron i runs where relu(gate_i . x) > t).
    """

    activation: str
    target: float | None = None
    mask_by: str = "layer"
    ste: bool = True
    mask_on: str = "act"


def student_spec(config, variant: str, target: float, *, mask_by: str = "layer",
                 ste: bool = True) -> FFNSpec:
    """The student FFN of a variant for a teacher of `config` (DistillConfig fields)."""
    if variant == "threshold":
        return FFNSpec(config.activation, target, mask_by, ste)
    if variant == "fatrelu":
        return FFNSpec("relu", target, mask_by, ste, mask_on="gate")
    return FFNSpec(ACTIVATION_OF_VARIANT[variant])


def teacher_spec(config) -> FFNSpec:
    return FFNSpec(config.activation)


def ffn_activations(activation: str, g_btf, u_btf, gate_threshold=None):
    """a [..., F] from the gate and up projections. gate_threshold (relu, drelu): FATReLU, the
    gate kept only where g > threshold (a scalar >= 0; 0 or None: plain ReLU). Its gradient is
    FATReLU's own (1 where kept, else 0), as ReLU's is."""
    if gate_threshold is not None and activation in ("relu", "drelu"):
        gate = jnp.where(g_btf > gate_threshold, g_btf, 0.0)
    else:
        gate = activate(activation, g_btf) if activation != "drelu" else jax.nn.relu(g_btf)
    if activation == "drelu":
        return gate * jax.nn.relu(u_btf)
    return gate * u_btf


def gate_l1(activation: str, g_btf, u_btf):
    """ProSparse's penalty on the intermediate outputs: mean relu(g) (and for drelu + mean
    relu(u)), the activations whose zeros make the FFN sparse."""
    out = jnp.mean(jax.nn.relu(g_btf))
    return out + jnp.mean(jax.nn.relu(u_btf)) if activation == "drelu" else out


def layer_quantile(abs_a, target: float):
    """The value under which a fraction `target` of |a| [..., F] falls (on a strided subsample of
    at most QUANTILE_MAX_TOKENS tokens), without gradient."""
    flat = jax.lax.stop_gradient(abs_a).reshape(-1, abs_a.shape[-1])
    stride = max(1, flat.shape[0] // QUANTILE_MAX_TOKENS)
    return jnp.quantile(flat[::stride], target)


def mask_magnitude(spec: FFNSpec, a_btf, g_btf):
    """What the spec's mask compares with a threshold: |a| or the gate activation relu(g)."""
    return jax.nn.relu(g_btf) if spec.mask_on == "gate" else jnp.abs(a_btf)


def mask_activations(a_btf, spec: FFNSpec, threshold=None, mag=None):
    """Zero the activations the spec drops. threshold: a fixed one for this layer (evaluation).
    mag: `mask_magnitude` (default |a|)."""
    if threshold is None and spec.target is None:
        return a_btf
    mag = jnp.abs(a_btf) if mag is None else mag
    if threshold is not None:
        keep = mag > threshold
    elif spec.mask_by == "layer":
        keep = mag > layer_quantile(mag, spec.target)
    else:
        f = a_btf.shape[-1]
        k = max(1, int(round((1.0 - spec.target) * f)))
        kth = jax.lax.top_k(jax.lax.stop_gradient(mag), k)[0][..., -1:]
        keep = mag >= kth
    masked = jnp.where(keep, a_btf, 0.0)
    if spec.ste and threshold is None:
        return a_btf + jax.lax.stop_gradient(masked - a_btf)
    return masked


def _proj(x_btd, w_fd):
    return jnp.einsum("btd,fd->btf", x_btd.astype(w_fd.dtype), w_fd, preferred_element_type=F32)


def ffn_forward(ffn, x_btd, spec: FFNSpec, threshold=None, gate_threshold=None):
    """(y [B, T, D], a [B, T, F], gate L1 (`gate_l1`), the unmasked `mask_magnitude` [B, T, F])
    of one FFN module under `spec` (a: the activations used; gate_threshold: FATReLU's, see
    ffn_activations)."""
    g = _proj(x_btd, ffn.gate.weight[...])
    u = _proj(x_btd, ffn.up.weight[...])
    a = ffn_activations(spec.activation, g, u, gate_threshold)
    mag = mask_magnitude(spec, a, g)
    a = mask_activations(a, spec, threshold, mag)
    w = ffn.down_t.weight[...]
    y = jnp.einsum("btf,fd->btd", a.astype(w.dtype), w, preferred_element_type=F32)
    return y, a, gate_l1(spec.activation, g, u), mag


def block_forward(layer, x_btd, positions_bt, spec: FFNSpec, threshold=None,
                  quantile: float | None = None, gate_threshold=None):
    """One pre-norm block; returns (x [B, T, D], stats [4]: fraction of zero activations, mean |a|,
    the `quantile` of the unmasked mask magnitude (|a| or relu(gate), `mask_magnitude`; 0 when
    None): what calibration sets the layer's threshold to, and the gate L1)."""
    x_btd = layer.attention_residual(x_btd, positions_bt)
    y, a, l1_gate, mag = ffn_forward(layer.ffn, layer.ffn_norm(x_btd), spec, threshold,
                                     gate_threshold)
    if layer.ffn_post_norm is not None:  # Gemma: the FFN's output normed before the residual
        y = layer.ffn_post_norm(y)
    q = jnp.float32(0.0) if quantile is None else layer_quantile(mag, quantile)
    stats = jnp.stack([jnp.mean(jax.lax.stop_gradient(a) == 0.0), jnp.mean(jnp.abs(a)), q,
                       l1_gate])
    return x_btd + y, stats


def _is_matrix(path, value) -> bool:
    """Attention and FFN matrices and an untied lm_head (not embeddings, norms or biases)."""
    names = {str(p) for p in path}
    return (isinstance(value, nnx.Param) and value.ndim == 2
            and bool(names & {"attn", "ffn", "lm_head"}))


def cast_matrices(model, dtype):
    """A copy of `model` whose matrices (`_is_matrix`) are cast to `dtype`; gradients flow through
    the cast to the original float32 arrays."""
    graphdef, mats, rest = nnx.split(model, _is_matrix, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda v: v.astype(dtype), mats), rest)


def forward(model, tokens_bt, spec: FFNSpec, *, compute_dtype=F32, thresholds=None,
            remat: bool = False, collect_hidden: bool = False, quantile: float | None = None,
            gate_threshold=None):
    """Logits [B, T, V] (float32) and per-layer statistics.

    model: a Transformer built with kernels="xla" (float32 weights; cast here to compute_dtype).
    thresholds: fixed per-layer thresholds of the spec's mask magnitude (|a| or relu(gate);
      overrides the spec's batch thresholds; no STE).
    gate_threshold: FATReLU's gate threshold (relu, drelu; a scalar, traced or not).
    Returns (logits, aux) with aux["zero_frac"] [L], aux["l1"] [L] (mean |a|), aux["l1_gate"]
    [L] (`gate_l1`), aux["quantile"] [L] (the `quantile` of each layer's mask magnitude, for
    calibration)
    and, when collect_hidden, aux["hidden"] [L, B, T, D] (the residual stream after each block).
    """
    m = cast_matrices(model, compute_dtype)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    x = m.tok_embed[...][tokens_bt].astype(F32) * m.config.embed_scale
    stats, hidden = [], []
    for i, layer in enumerate(m.layers):
        thr = None if thresholds is None else thresholds[i]
        if remat:
            layer_def, layer_state = nnx.split(layer)

            def run(st, x_btd, thr=thr, layer_def=layer_def):
                return block_forward(nnx.merge(layer_def, st), x_btd, positions, spec, thr,
                                     quantile, gate_threshold)

            x, s = jax.checkpoint(run)(layer_state, x)
        else:
            x, s = block_forward(layer, x, positions, spec, thr, quantile, gate_threshold)
        stats.append(s)
        if collect_hidden:
            hidden.append(x)
    h = m.final_norm(x)
    w = m.tok_embed[...] if m.lm_head is None else m.lm_head.weight[...]
    w = w.astype(compute_dtype)
    logits = jnp.einsum("btd,vd->btv", h.astype(w.dtype), w, preferred_element_type=F32)
    if m.config.final_softcap:
        logits = m.config.final_softcap * jnp.tanh(logits / m.config.final_softcap)
    stats = jnp.stack(stats)
    aux = {"zero_frac": stats[:, 0], "l1": stats[:, 1], "quantile": stats[:, 2],
           "l1_gate": stats[:, 3]}
    if collect_hidden:
        aux["hidden"] = jnp.stack(hidden)
    return logits, aux


def kl_divergence(teacher_logits, student_logits):
    """Mean over tokens of KL(teacher || student) in nats."""
    lp_t = jax.nn.log_softmax(teacher_logits, axis=-1)
    lp_s = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(lp_t) * (lp_t - lp_s), axis=-1))


def topk_kl(teacher_ids, teacher_logp, student_logits):
    """Mean over tokens of KL(teacher || student) over k + 1 outcomes: the teacher's top-k tokens
    (ids [B, T, k], their log-probabilities under the full softmax [B, T, k]) and "any other
    token", whose probability is 1 - the top-k's mass under each model. Exact for the coarsened
    distributions, so at most the full KL; equal to it when the top-k hold all the mass."""
    lp_s = jax.nn.log_softmax(student_logits, axis=-1)
    s_top = jnp.take_along_axis(lp_s, teacher_ids.astype(jnp.int32), axis=-1)
    t_top = teacher_logp.astype(F32)
    p_top = jnp.exp(t_top)
    tiny = 1e-6  # the rest's mass is clamped here: below it both sides carry ~nothing
    t_rest = jnp.maximum(1.0 - jnp.sum(p_top, axis=-1), tiny)
    s_rest = jnp.maximum(-jnp.expm1(jax.nn.logsumexp(s_top, axis=-1)), tiny)
    kl = jnp.sum(p_top * (t_top - s_top), axis=-1) + t_rest * (jnp.log(t_rest) - jnp.log(s_rest))
    return jnp.mean(kl)


def teacher_topk(teacher_logits, k: int):
    """(ids [B, T, k] int32, log-probabilities [B, T, k] float32) of the k most likely tokens
    (the top-k of the logits less their logsumexp: no [B, T, V] array of log-probabilities)."""
    logits = teacher_logits.astype(F32)
    top, ids = jax.lax.top_k(logits, k)
    return ids, top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def hidden_mse(teacher_hidden, student_hidden):
    """Mean over layers of the squared error of the residual stream over the teacher's mean square."""
    err = jnp.mean(jnp.square(student_hidden - teacher_hidden), axis=(1, 2, 3))
    return jnp.mean(err / (jnp.mean(jnp.square(teacher_hidden), axis=(1, 2, 3)) + 1e-6))


def token_nll(logits_btv, tokens_bt):
    """Sum of -log p(token t+1 | ..t) over t = 0..T-2 (every token but the first is scored)."""
    logp = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1))
