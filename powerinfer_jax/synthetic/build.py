"""A synthetic sparse llama model: random weights (SYNTHETIC: for speed only, it knows no
language) whose FFN neurons fire with prescribed frequencies on text, and exact predictors.

How a neuron is made to fire with frequency p_i (ReGLU, a_i = relu(gate_i . x) * (up_i . x)):
  * One block of the residual stream is reserved (dims [0, 32)): the embeddings hold a constant
    C at dim 0 and zeros in the rest of the block, and no layer writes into it (the rows of
    attention's output and of the FFN's down projection for those dims are zero), so every FFN
    input has x_0 = C * norm_scale_0 / rms(h) > 0: a bias every token carries.
  * The gate is low-rank plus that bias column: gate = B A + g e_0^T, A [R, D] with zero columns
    over the reserved block (so the gate's first block is (g_i, 0, ..., 0), exact in Q4_0).
  * Layer by layer, on calibration tokens of real text (wiki.train, SmolLM2's tokenizer), the
    layer's true FFN inputs x_t are computed with the engine's own modules (the layers below
    already final), and g_i is set to the p_i-quantile of -(Q(BA)_i . x_t) / x_t0, where Q(BA)
    is the low-rank part as the file stores it (quantized): neuron i then fires on exactly a
    fraction p_i of the calibration tokens. Held-out text measures the frequencies again.
  * dReLU (a_i = relu(gate_i . x) * relu(up_i . x)): the up rows get a bias column the same way,
    firing on sqrt(p_i) of the tokens, and the gate's bias is set on the tokens whose up fires,
    for a joint frequency p_i.
Predictors (PowerInfer's fc1 -> ReLU -> fc2 on the residual h before ffn_norm, no biases): with
A' = [A; e_0^T], B' = [B, g], W = diag(ffn_norm scale): fc1 = [A'W; -A'W], fc2 = [B', -B'], so
fc2(relu(fc1 h)) = B'A'W h = rms(h) * (B A + g e_0^T) . x: its sign is the gate's, up to the
gate's quantization (the predictor is exact for the unquantized gate; its recall on the file is
measured, not assumed).
Down projection: the values s * q with q integer in [-7, 7], and q = -8 wherever
(neuron + dim) % 32 == 0, s a power of two: every 32-block, along the neurons (llama.cpp's
ffn_down) and along the model dimension (PowerInfer's ffn_down_t), holds one -8, so Q4_0 stores
both exactly and the llama GGUF and the PowerInfer GGUF are the same model (other formats round).
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.checkpoint import quants
from powerinfer_jax.checkpoint.base import QuantTensor
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import check, fail
from powerinfer_jax.models.layers import Attention, Norm, shapes_only
from powerinfer_jax.models.rope import layer_rope
from powerinfer_jax.ops.reference import gated_activate
from powerinfer_jax.synthetic.profile import Locality, layer_frequencies

F32 = jnp.float32
RESERVED = 32  # residual dims [0, RESERVED): the bias block (module docstring)
EMBED_CONSTANT = 8.0  # C
ATTN_OUT_STD = 0.3  # per-element std of attention's output, and the FFN's (set by s)
FFN_OUT_STD = 0.3
Q_VAR = 56.0 / 3.0  # variance of a uniform integer in [-7, 7]
SHAPES = {  # public configs of the models whose shapes these are (vocab: the tokenizer's)
    "llama2-7b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                      d_ff=11008, max_seq_len=4096),
    "llama2-13b": dict(d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128,
                       d_ff=13824, max_seq_len=4096),
    "tinyllama-1.1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64,
                           d_ff=5632, max_seq_len=2048),
    "smollm2-135m": dict(d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         d_ff=1536, max_seq_len=2048),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What to build: shape (`config`, activation relu or drelu), frequencies, predictor rank."""

    config: ModelConfig
    locality: Locality
    rank: int = 63  # the gate's low rank R (predictor hidden size 2 (R + 1))
    seed: int = 0
    qtype: str = "Q4_0"

    def __post_init__(self):
        c = self.config
        check(c.arch == "llama" and c.gated and not c.bias and c.norm == "rms",
              "synthetic model config", "a llama shape (gated FFN, RMSNorm, no biases)", c.arch)
        check(c.activation in ("relu", "drelu"), "--activation", "'relu' or 'drelu'",
              c.activation)
        block = quants.block_size(self.qtype)[0] if self.qtype in quants.QUANTIZED_TYPES else 32
        for name in ("d_model", "d_ff"):
            v = getattr(c, name)
            check(v % max(block, RESERVED) == 0 and v > RESERVED, f"--{name.replace('_', '-')}",
                  f"a multiple of {max(block, RESERVED)} above {RESERVED} (the {self.qtype} "
                  "block and the reserved bias block)", v)
        check(c.q_dim % block == 0, "--n-heads * --head-dim", f"a multiple of {block}", c.q_dim)
        check(isinstance(self.rank, int) and 1 <= self.rank < c.d_model - RESERVED, "--rank",
              f"an integer in [1, {c.d_model - RESERVED})", self.rank)
        check(self.qtype in ("F32", "F16", "BF16") or self.qtype in quants.QUANTIZED_TYPES,
              "--qtype", "a GGML type name (Q4_0, Q4_1, Q8_0, F16, BF16, ...)", self.qtype)


def config_for(shape: str | dict, *, vocab_size: int, activation: str = "relu",
               bos: int | None = None, eos: tuple[int, ...] = ()) -> ModelConfig:
    """A llama ModelConfig of a named shape (`SHAPES`) or explicit fields, with the tokenizer's
    vocabulary."""
    fields = SHAPES[shape] if isinstance(shape, str) else dict(shape)
    if isinstance(shape, str) and shape not in SHAPES:
        fail("--shape", f"one of {sorted(SHAPES)}", shape)
    return ModelConfig(arch="llama", vocab_size=vocab_size, activation=activation, gated=True,
                       bias=False, norm="rms", norm_eps=1e-5, positions="rope",
                       rope_theta=10000.0, tie_embeddings=False, bos_token_id=bos,
                       eos_token_ids=eos, **fields)


# ------------------------------------------------------------------------------ tensors
@dataclasses.dataclass
class Tensor:
    """One canonical tensor: `values` (float32, what the model computes with: the stored values
    dequantized) and `blocks` (the rows in `qtype`, or None for float32 vectors and types)."""

    values: np.ndarray
    blocks: np.ndarray | None = None
    qtype: str = "F32"


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def stored(values: np.ndarray, qtype: str) -> Tensor:
    """Quantize rows of `values` in `qtype` and keep what the file will hold, dequantized."""
    values = np.ascontiguousarray(values, np.float32)
    if values.ndim == 1 or qtype == "F32":
        return Tensor(values)
    if qtype in ("F16", "BF16"):
        import ml_dtypes

        dt = np.float16 if qtype == "F16" else ml_dtypes.bfloat16
        return Tensor(values.astype(dt).astype(np.float32), None, qtype)
    blocks = quants.quantize(values, qtype)
    deq = QuantTensor(blocks, qtype, values.shape).dequantize()
    return Tensor(deq, blocks, qtype)


def _q4_exact_scalar(v: np.ndarray) -> np.ndarray:
    """Values a Q4_0/Q8_0-style block holding only v (zeros elsewhere) stores exactly: -8 * d
    with d = f16(v / -8), so the gate's bias column survives quantization unchanged."""
    return (-8.0 * (v / -8.0).astype(np.float16).astype(np.float32)).astype(np.float32)


def down_integers(d_ff: int, d_model: int, seed: int, name: str) -> np.ndarray:
    """int8 [F, D]: uniform in [-7, 7], -8 where (i + d) % 32 == 0, 0 over the reserved dims."""
    q = _rng(seed, name).integers(-7, 8, size=(d_ff, d_model), dtype=np.int8)
    i = np.arange(d_ff)[:, None]
    d = np.arange(d_model)[None, :]
    q[(i + d) % 32 == 0] = -8
    q[:, :RESERVED] = 0
    return q


def attention_weights(c: ModelConfig, seed: int, prefix: str, qtype: str) -> dict[str, Tensor]:
    """One layer's random q, k, v, o (canonical names after `prefix`), o's rows over the
    reserved dims zero: attention never writes the bias block."""
    d = c.d_model
    w = {f"attn.{name}.weight": stored(_rng(seed, prefix + name).standard_normal(
        (rows, d), np.float32) * d ** -0.5, qtype)
        for name, rows in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim))}
    o = _rng(seed, prefix + "o").standard_normal((d, c.q_dim), np.float32) * (
        ATTN_OUT_STD * c.q_dim ** -0.5)
    o[:RESERVED] = 0.0
    w["attn.o.weight"] = stored(o, qtype)
    return w


# ------------------------------------------------------------------------------ the forward
class _Layer:
    """The engine's own attention and norms (models/layers.py), float32 XLA, for one layer's
    calibration forward; weights set per layer."""

    def __init__(self, c: ModelConfig):
        with shapes_only():
            self.attn_norm = Norm(c.d_model, kind="rms", eps=c.norm_eps)
            self.attn = Attention(d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                                  head_dim=c.head_dim, bias=False, rope=layer_rope(c, 0),
                                  dtype=F32, rngs=None, kernels="xla")
            self.ffn_norm = Norm(c.d_model, kind="rms", eps=c.norm_eps)
        self.config = c

    def set(self, w: dict[str, Tensor]) -> None:
        self.attn_norm.scale.set_value(jnp.asarray(w["attn_norm.scale"].values))
        self.ffn_norm.scale.set_value(jnp.asarray(w["ffn_norm.scale"].values))
        for p in "qkvo":
            getattr(self.attn, p).weight.set_value(jnp.asarray(w[f"attn.{p}.weight"].values))

    def attention(self, h_btd):
        b, t, _ = h_btd.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        return h_btd + self.attn(self.attn_norm(h_btd), pos)[0]


def _ffn_act(activation: str, g, u):
    return gated_activate(activation, g, u)


def _bias_for(u: np.ndarray, x0: np.ndarray, p: np.ndarray, tokens: np.ndarray | None = None
              ) -> np.ndarray:
    """[F] bias-column values g with frac(u_t + g * x0_t > 0) = p over the tokens (or over the
    tokens where `tokens` [N, F] is True, a per-neuron subset)."""
    w = -u / x0[:, None]  # fires iff g > w
    if tokens is None:
        return _column_quantiles(w, p)
    w = np.where(tokens, w, np.inf)  # tokens outside the subset sort last, never counted
    return _column_quantiles(w, p, tokens.sum(axis=0))


def _column_quantiles(w: np.ndarray, p: np.ndarray, counts: np.ndarray | None = None
                      ) -> np.ndarray:
    """Per column j the value below which a fraction p[j] of its first counts[j] sorted entries
    lie (between the k-th and (k+1)-th: no token sits exactly on the threshold)."""
    s = np.sort(w, axis=0)
    n = np.full(w.shape[1], w.shape[0]) if counts is None else np.maximum(counts, 1)
    k = np.clip(np.round(p * n).astype(np.int64), 0, n)  # tokens that fire
    cols = np.arange(w.shape[1])
    lo = np.where(k > 0, s[np.maximum(k - 1, 0), cols], s[0, cols] - 1.0)
    hi = np.where(k < n, s[np.minimum(k, n - 1), cols], lo + 1.0)
    return (0.5 * (lo + hi)).astype(np.float32)


def predictor(a: np.ndarray, gate: np.ndarray, x: np.ndarray, norm_scale: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """PowerInfer-shape predictors (fc1 [2(R+1), D], fc2 [F, 2(R+1)], on the residual) of the
    stored gate's sign: A' = [A; e_0^T] as built, B' the least-squares fit of the stored gate's
    pre-activations on the calibration inputs x (the stored gate is B A + g e_0^T rounded: the
    fit absorbs the part of the rounding that A' can express). The e_0 row is scaled so that
    the bias column of B' has the spread of the others (fc2's blocks then quantize evenly)."""
    a_full = np.concatenate([a, np.eye(1, a.shape[1], 0, dtype=np.float32)])  # A' [R+1, D]
    z = x @ a_full.T  # [N, R+1]
    target = x @ gate.T  # [N, F] the stored gate's pre-activations
    b_full = np.linalg.lstsq(z.astype(np.float64), target.astype(np.float64), rcond=None)[0].T
    b_full = b_full.astype(np.float32)  # [F, R+1]
    spread = float(np.sqrt(np.mean(b_full[:, :-1] ** 2)))
    lam = float(np.sqrt(np.mean(b_full[:, -1] ** 2))) / max(spread, 1e-30)
    a_full[-1] *= lam
    b_full[:, -1] /= lam
    fc1 = a_full * norm_scale[None, :]  # on the residual: ffn_norm's scale folded in
    return (np.concatenate([fc1, -fc1]).astype(np.float32),
            np.concatenate([b_full, -b_full], axis=1).astype(np.float32))


@dataclasses.dataclass
class Layer:
    """One finished layer: canonical tensors and the predictor (fc1 [2(R+1), D], fc2 [F, 2(R+1)],
    float32, on the residual), with the frequencies it was calibrated to."""

    tensors: dict[str, Tensor]
    fc1: np.ndarray
    fc2: np.ndarray
    calibrated: np.ndarray  # [F] frequencies on the calibration tokens


def build(spec: Spec, calib_ids: np.ndarray, *, on_global: Callable[[str, Tensor], None],
          on_layer: Callable[[int, Layer], None], progress: Callable[[str], None] = lambda m: None
          ) -> np.ndarray:
    """Generate the model layer by layer on calibration token ids [S, T] (sequences of real
    text). Calls on_global(name, Tensor) for tok_embed, then on_layer(i, Layer) per layer, then
    on_global for final_norm.scale and lm_head. Returns the prescribed frequencies [L, F]."""
    c, seed, qt = spec.config, spec.seed, spec.qtype
    d, f, r = c.d_model, c.d_ff, spec.rank
    freq = layer_frequencies(c.n_layers, f, spec.locality, seed)
    emb = _rng(seed, "tok_embed").standard_normal((c.vocab_size, d), np.float32)
    emb[:, :RESERVED] = 0.0
    emb[:, 0] = EMBED_CONSTANT
    tok = stored(emb, qt)
    on_global("tok_embed", tok)
    h = jnp.asarray(tok.values[calib_ids])  # [S, T, D]
    del emb, tok
    layer_mod = _Layer(c)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w: dict[str, Tensor] = {"attn_norm.scale": Tensor(np.ones(d, np.float32)),
                                "ffn_norm.scale": Tensor(np.ones(d, np.float32))}
        w.update(attention_weights(c, seed, p, qt))
        layer_mod.set(w)
        h = layer_mod.attention(h)
        x = np.asarray(layer_mod.ffn_norm(h)).reshape(-1, d)  # [N, D] the FFN's inputs
        x0 = x[:, 0]
        if not np.all(x0 > 0):
            fail("synthetic calibration", "x_0 > 0 on every token (the bias block)",
                 f"min {x0.min():.3g} at layer {i}")
        rng = _rng(seed, p + "lowrank")
        a = rng.standard_normal((r, d), np.float32) * d ** -0.5
        a[:, :RESERVED] = 0.0
        b = rng.standard_normal((f, r), np.float32) * r ** -0.5
        low = stored(b @ a, qt)  # the low-rank part as stored (its first block is zero)
        u_gate = x @ low.values.T  # [N, F]
        up_vals = _rng(seed, p + "up").standard_normal((f, d), np.float32) * d ** -0.5
        fires_up = None
        if c.activation == "drelu":  # up fires on sqrt(p_i), the gate on the rest
            up_vals[:, :RESERVED] = 0.0
            up_lin = x @ stored(up_vals, qt).values.T
            up_vals[:, 0] = _q4_exact_scalar(_bias_for(up_lin, x0, np.sqrt(freq[i])))
            del up_lin
        up = stored(up_vals, qt)
        u_up = x @ up.values.T
        if c.activation == "drelu":
            fires_up = u_up > 0
            cond = np.clip(freq[i] / np.maximum(fires_up.mean(axis=0), 1e-9), 0.0, 1.0)
            g = _q4_exact_scalar(_bias_for(u_gate, x0, cond, fires_up))
        else:
            g = _q4_exact_scalar(_bias_for(u_gate, x0, freq[i]))
        gate_vals = low.values.copy()
        gate_vals[:, 0] = g
        gate = stored(gate_vals, qt)  # Q4_0 keeps the bias block exactly; others round it
        # 32-blocks quantize independently: only the first block differs from the low-rank part
        pre = u_gate + x[:, :RESERVED] @ gate.values[:, :RESERVED].T  # the gate as stored
        act = np.asarray(_ffn_act(c.activation, jnp.asarray(pre), jnp.asarray(u_up)))
        calibrated = (act != 0).mean(axis=0)
        del u_gate, u_up, pre
        ssq = float((act.astype(np.float64) ** 2).sum(axis=1).mean())
        s = 2.0 ** np.round(np.log2(FFN_OUT_STD / max(np.sqrt(Q_VAR * ssq), 1e-30)))
        down_t = down_integers(f, d, seed, p + "down").astype(np.float32) * np.float32(s)
        w.update({"ffn.gate.weight": gate, "ffn.up.weight": up,
                  "ffn.down_t.weight": Tensor(down_t, None, "exact")})
        y = act @ down_t  # [N, D]
        h = h + jnp.asarray(y.reshape(h.shape))
        del act, y
        fc1, fc2 = predictor(a, gate.values, x, w["ffn_norm.scale"].values)
        on_layer(i, Layer(w, fc1, fc2, calibrated))
        progress(f"layer {i + 1}/{c.n_layers}: calibrated sparsity "
                 f"{1 - calibrated.mean():.3f} (prescribed {1 - freq[i].mean():.3f}), down scale "
                 f"2^{int(np.log2(s))}")
    on_global("final_norm.scale", Tensor(np.ones(d, np.float32)))
    head = _rng(seed, "lm_head").standard_normal((c.vocab_size, d), np.float32) * d ** -0.5
    on_global("lm_head", stored(head, qt))
    return freq
