"""Building blocks of the decoder: linear, norms, rotary positions, attention with a KV cache.

Axis legend (used in einsum strings and as name suffixes):
  B batch, T tokens (queries), S keys (cache slots), D model, F FFN neurons, N query heads,
  K kv heads, G query heads per kv head (N = K * G), H head dim, V vocab, R predictor rank.

Weights are stored [out, in] ("neuron-major", like HF's Linear), so a matrix-vector product reads
each output row contiguously and the checkpoint names map onto module paths one to one.
Activations between layers are float32; matmul inputs are cast to the weight dtype and accumulate in
float32 (`preferred_element_type`), so bfloat16 weights halve the bytes read without a bf16 residual.

`kernels` (a static module attribute) picks who runs the matmuls: "xla" (jnp.einsum) or "ffi" (the
project's `ops.linear` custom call on the C++ thread pool). On CPU, XLA has no fast bfloat16 dot
(~20x slower than streaming the rows, measured) and reads float32 below bandwidth at decode sizes;
so with "ffi", bfloat16/float16 matmuls always use the custom call, float32 ones only for
decode-sized inputs (<= FFI_F32_MAX_ROWS rows), where XLA's blocked GEMM wins beyond that.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from powerinfer_jax import ops
from powerinfer_jax.errors import fail
from powerinfer_jax.models.kv_cache import cache_storage_dtype
from powerinfer_jax.models.qweights import MATVEC, QWeight, host_blocks
from powerinfer_jax.models.rope import Rope
from powerinfer_jax.models.rope import apply as rope_apply

F32 = jnp.float32
_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN
KERNELS = ("xla", "ffi")
FFI_F32_MAX_ROWS = 4  # the C++ kernel's token group: one pass over each weight row


def resolve_kernels(kernels: str) -> str:
    """"auto" -> "ffi" on the CPU backend when the extension is built, else "xla"."""
    if kernels in KERNELS:
        return kernels
    if kernels != "auto":
        raise ValueError(f"kernels: expected one of ['auto', 'xla', 'ffi'], got {kernels!r}")
    if jax.default_backend() != "cpu":
        return "xla"
    try:
        from powerinfer_jax.ops import _ffi  # noqa: F401  # lazy: optional C++ extension
    except ImportError:
        return "xla"
    return "ffi"


def use_ffi(kernels: str, x, w) -> bool:
    """Whether a matmul of x [..., I] with w takes the custom call (see the module docstring)."""
    rows = math.prod(x.shape[:-1])
    return kernels == "ffi" and (w.dtype != F32 or rows <= FFI_F32_MAX_ROWS)


def op_impl(kernels: str) -> str:
    """The `impl` of an op for a module's kernels: the custom call, or its jnp reference (XLA
    kernels on quantized blocks: tests)."""
    return "ffi" if kernels == "ffi" else "reference"


def matmul(x, w_od, kernels: str = "xla"):
    """x [..., I] times a weight stored [O, I] -> [..., O], float32 accumulation."""
    if use_ffi(kernels, x, w_od):
        return ops.linear(x, w_od)
    return jnp.einsum("...i,oi->...o", x.astype(w_od.dtype), w_od, preferred_element_type=F32)


class InputSample(nnx.Variable):
    """What a matrix's input was (attention's and the FFN's inputs), recorded only when a capture
    asks for this kind (input sparsity's calibration): profiles that capture nnx.Intermediate
    never carry them."""


def sow(module: nnx.Module, name: str, value, kind=nnx.Intermediate) -> None:
    """Record a diagnostic (`kind` `name`, nnx.Intermediate by default) when the call runs under
    nnx.capture of that kind (see models.transformer.capture); otherwise nothing is kept, so
    decode steps carry no extra state."""
    if hasattr(module, "__captures__"):  # set by nnx.capture on every module it wraps
        module.sow(kind, name, value)


class Module(nnx.Module, pytree=False):
    """Every module of the project: an nnx graph node (split, merge, state, update, nnx.jit) that
    is not also a JAX pytree. A pytree module checks every attribute it is given (a tree walk per
    setattr, to sort data from static); SmolLM2's ~2700 attributes cost ~0.08 s of load that way
    (0.11 s -> 0.03 s to construct the model). No code passes a module itself through jax.jit or
    jax.tree: they go through nnx.split/merge or nnx.state, which work on graph nodes."""

    def __init_subclass__(cls, **kwargs):  # nnx re-reads `pytree` per subclass (default: True)
        kwargs.setdefault("pytree", False)
        super().__init_subclass__(**kwargs)


_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Modules built inside get parameters with a shape and dtype only (jax.ShapeDtypeStruct), as
    nnx.eval_shape gives, for a loader that replaces every one. Built directly, without tracing
    the constructors: for SmolLM2 that is ~0.07 s instead of eval_shape's ~0.12 s of load time."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def constant(shape, dtype, fill: float = 0.0):
    """A constant-filled array, or only its shape and dtype under `shapes_only`."""
    if _SHAPES_ONLY.get():
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
    return jnp.full(shape, fill, dtype)


def _param(shape, dtype, rngs: nnx.Rngs | None, scale: float | None = None, fill: float = 0.0):
    """A parameter initialised randomly (tests, tiny models) or with a constant (loaded later)."""
    if rngs is not None and scale is not None and not _SHAPES_ONLY.get():
        return nnx.Param((jax.random.normal(rngs.params(), shape, F32) * scale).astype(dtype))
    return nnx.Param(constant(shape, dtype, fill))


class Linear(Module):
    """y = x @ weight.T (+ bias); weight [out, in] floats, or a quantized matrix's blocks uint8
    [out, row_bytes] (a models/qweights.py QWeight: `qtype`, `layout`), computed on by
    ops.qlinear in either of its layouts (MATVEC rows interleaved by 16, or the file's ROWS)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs | None,
                 kernels: str = "xla"):
        self.kernels = kernels
        self.d_in = d_in
        self.qtype = None  # GGML block format of `weight`; None: floats
        self.layout = MATVEC
        self.interleaved = False
        self.weight = _param((d_out, d_in), dtype, rngs, scale=d_in ** -0.5)
        self.bias = _param((d_out,), F32, None) if bias else None

    def load(self, w: QWeight) -> None:
        """Keep `weight` as the QWeight's blocks, in its layout (chosen by the build plan)."""
        self.weight.set_value(host_blocks(w.blocks))  # in place: no new Param per tensor
        self.qtype, self.layout, self.interleaved = w.qtype, w.layout, w.interleaved

    @property
    def qweight(self) -> QWeight:
        return QWeight(self.weight[...], self.qtype, self.layout, self.interleaved)

    @property
    def kernel_qtype(self) -> str | None:
        """The blocks' type name for the custom calls ("Q4_0x16" when interleaved)."""
        return None if self.qtype is None else self.qweight.kernel_qtype

    def __call__(self, x):
        if self.qtype is not None:
            y = ops.qlinear(x, self.weight[...], self.kernel_qtype, self.d_in,
                            impl=op_impl(self.kernels))
        else:
            y = matmul(x, self.weight[...], self.kernels)
        return y + self.bias[...] if self.bias is not None else y


class InputThreshold(nnx.Variable):
    """Per-channel thresholds of an input mask (not a checkpoint parameter)."""


class InputMask(Module):
    """Input sparsity of the matrices that read one input: x_j is zeroed where |x_j| < threshold_j
    (per channel: the magnitude rule's one value repeated, or the weighted rule's value divided
    by the weight column's norm; sparsity/input_sparsity.py calibrates them). A quantized matrix
    in the columns layout (models/qweights.py) then reads no weight of a zeroed channel. Under
    `capture` it records the nonzero channels it lets through ("<name>_active" [B, T])."""

    def __init__(self, thresholds, *, name: str):
        self.name = name
        self.threshold = InputThreshold(jnp.asarray(thresholds, F32))

    def __call__(self, x):
        x = jnp.where(jnp.abs(x) < self.threshold[...], jnp.zeros((), x.dtype), x)  # NaN stays
        sow(self, f"{self.name}_active", jnp.sum(x != 0, axis=-1, dtype=jnp.int32))
        return x


def apply_mask(mask, x):
    """x through an InputMask, or as it is (None: dense)."""
    return x if mask is None else mask(x)


_SUM_WIDTH = 64  # the lanes of row_mean's fixed-order sum


def row_mean(v):
    """Mean over the last axis [..., 1], summed in a fixed order: the 64-wide chunks one after
    another, then halves of the 64 lanes. Every step is an elementwise add, so a row's result
    does not depend on how many rows share the call. XLA's own reduce is vectorized by shape:
    at 8 or more rows it gave other last bits than a row alone, and 8-bit activations
    downstream turned that into other greedy tokens in batched decoding."""
    d = v.shape[-1]
    pad = -d % _SUM_WIDTH
    if pad:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])  # adding zeros is exact
    chunks = v.reshape(v.shape[:-1] + (-1, _SUM_WIDTH))
    acc = chunks[..., 0, :]
    for i in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc / d


class Norm(Module):
    """RMSNorm (llama) or LayerNorm (OPT), computed in float32."""

    def __init__(self, d: int, *, kind: str, eps: float):
        self.kind = kind
        self.eps = eps
        self.scale = nnx.Param(constant((d,), F32, 1.0))
        self.bias = nnx.Param(constant((d,), F32)) if kind == "layer" else None

    def __call__(self, x):
        x = x.astype(F32)
        if self.kind == "rms":
            y = x * jax.lax.rsqrt(row_mean(x * x) + self.eps)
            return y * self.scale[...]
        mean = row_mean(x)
        var = row_mean(jnp.square(x - mean))
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


def to_cache(x, storage):
    if storage == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def from_cache(c):
    """Cache contents as float32 (bf16 bits widen exactly: they are the high half of an f32)."""
    if c.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(c.astype(jnp.uint32) << 16, F32)
    return c.astype(F32)


class Attention(Module):
    """Multi-head attention with grouped KV heads and an optional fixed-size KV cache.

    Per head, q and k may be RMS-normed before the rotation (`qk_norm_eps`: Qwen3, Gemma-3);
    the rotation is `rope` (models/rope.py: any scaling; None: no rotary positions); scores are
    q.k * `scale` (None: head_dim ** -0.5), soft-capped to c * tanh(s / c) with `softcap` > 0
    (Gemma-2), and with `window` > 0 each query sees only the last `window` positions
    (Mistral, Gemma's local layers). Biases: on all four projections (`bias`) or on q, k, v
    only (`qkv_bias`: Qwen2)."""

    def __init__(self, *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 bias: bool, rope: Rope | None, dtype, rngs: nnx.Rngs | None,
                 kernels: str = "xla", decode_attention: str = "auto", fuse_qkv: bool = True,
                 qkv_bias: bool = False, qk_norm_eps: float | None = None,
                 scale: float | None = None, softcap: float = 0.0, window: int = 0,
                 qk_norm_full_eps: float | None = None):
        """decode_attention: "auto" (one custom call per decode token when kernels is "ffi" on
        CPU) or "xla" (XLA's ops: the ablation). fuse_qkv: at decode with "ffi", q, k and v in
        one ops.linear_many call (False: three calls, the ablation)."""
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope = rope
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.softcap = float(softcap)
        self.window = int(window)
        self.kernels = kernels
        self.decode_kernel = kernels == "ffi" and decode_attention == "auto"
        self.fuse_qkv = fuse_qkv
        lin = dict(dtype=dtype, rngs=rngs, kernels=kernels)
        self.q = Linear(d_model, n_heads * head_dim, bias=bias or qkv_bias, **lin)
        self.k = Linear(d_model, n_kv_heads * head_dim, bias=bias or qkv_bias, **lin)
        self.v = Linear(d_model, n_kv_heads * head_dim, bias=bias or qkv_bias, **lin)
        self.o = Linear(n_heads * head_dim, d_model, bias=bias, **lin)
        qk_norm = qk_norm_eps is not None
        self.q_norm = Norm(head_dim, kind="rms", eps=qk_norm_eps) if qk_norm else None
        self.k_norm = Norm(head_dim, kind="rms", eps=qk_norm_eps) if qk_norm else None
        if qk_norm_full_eps is not None:  # OLMoE: over the whole projection, before the heads
            if qk_norm:
                fail("Attention q/k norms", "per head or over the projection, not both",
                     (qk_norm_eps, qk_norm_full_eps))
            self.q_norm = Norm(n_heads * head_dim, kind="rms", eps=qk_norm_full_eps)
            self.k_norm = Norm(n_kv_heads * head_dim, kind="rms", eps=qk_norm_full_eps)
        self.qk_norm_full = qk_norm_full_eps is not None
        # input sparsity (sparsity/input_sparsity.py): masks of q/k/v's input and o's input
        self.in_mask = nnx.data(None)
        self.out_mask = nnx.data(None)

    def __call__(self, x_btd, positions_bt, cache=None, cache_index=None, kv_len=None):
        """cache: None (attend within x only) or (k_rskh, v_rskh) with R >= B rows; sequence b uses
        row b. cache_index: where the T new keys/values go: a scalar (slots [cache_index,
        cache_index + T) of every row: prefill) or int32 [B] (one slot per sequence, T == 1: a
        batched decode step whose sequences sit at different positions). kv_len (static):
        attend only to the first kv_len slots, which must cover every position in positions_bt;
        it keeps decode from reading the whole cache while sequences are short. Returns
        (y_btd, new_cache)."""
        b, t, _ = x_btd.shape
        sow(self, "attn_in", x_btd, InputSample)
        x_btd = apply_mask(self.in_mask, x_btd)
        # KV heads from the weights: on a mesh (runtime/mesh.py) this device's share of them
        h, g = self.head_dim, self.n_heads // self.n_kv_heads
        kh = self.k.weight.shape[0] // h
        if (cache is not None and kv_len is not None and t == 1 and self.decode_kernel
                and jax.default_backend() == "cpu"):
            return self._decode_ffi(x_btd, positions_bt, cache, cache_index, kv_len)
        q, k = self._full_norm(self.q(x_btd), self.k(x_btd))
        q = q.reshape(b, t, kh * g, h)
        k = k.reshape(b, t, kh, h)
        v = self.v(x_btd).reshape(b, t, kh, h)
        if self.q_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q = rope_apply(q, positions_bt, self.rope)
            k = rope_apply(k, positions_bt, self.rope)
        if cache is None:
            k_all, v_all, key_pos = k, v, positions_bt  # [B, S=T, ...]
            new_cache = None
        else:
            k_all, v_all = new_cache = tuple(
                _cache_write(c, new, cache_index) for c, new in zip(cache, (k, v)))
            k_all, v_all = k_all[:b, :kv_len], v_all[:b, :kv_len]
            # Slot s holds position s; slots past each sequence's position are masked by causality.
            key_pos = jnp.broadcast_to(jnp.arange(k_all.shape[1]), (b, k_all.shape[1]))
        q = q.reshape(b, t, kh, g, h).astype(F32) * self.scale
        scores = jnp.einsum("btkgh,bskh->bkgts", q, from_cache(k_all))
        if self.softcap > 0:
            scores = self.softcap * jnp.tanh(scores / self.softcap)
        visible = key_pos[:, None, :] <= positions_bt[:, :, None]  # [B, T, S]: causal
        if self.window > 0:  # and within the window
            visible &= key_pos[:, None, :] > positions_bt[:, :, None] - self.window
        scores = jnp.where(visible[:, None, None], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, from_cache(v_all))
        return self._out(out.reshape(b, t, kh * g * h)), new_cache

    def _out(self, out_btd):
        """o's product of the heads' output (through o's input mask)."""
        sow(self, "attn_out", out_btd, InputSample)
        return self.o(apply_mask(self.out_mask, out_btd))

    def _decode_ffi(self, x_btd, positions_bt, cache, cache_index, kv_len):
        """One token per sequence: q/k norms, rope, cache write, scores (soft-capped, windowed),
        softmax and values in one custom call (the XLA path above runs them as ~20 small thunks
        per layer). Same result up to float rounding."""
        b = x_btd.shape[0]
        slots = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32).reshape(-1), (b,))
        where = jnp.stack([slots, positions_bt.reshape(b).astype(jnp.int32)], axis=1)  # [B, 2]
        lins = (self.q, self.k, self.v)
        biases = [None if l.bias is None else l.bias[...] for l in lins]
        if self.fuse_qkv and all(l.qtype is not None for l in lins):
            # the file's q, k, v blocks (their formats may differ) in one pool job
            q, k, v = ops.qlinear_many(x_btd, [l.weight[...] for l in lins],
                                       [l.kernel_qtype for l in lins], self.q.d_in, biases)
        elif self.fuse_qkv and all(l.qtype is None and use_ffi(l.kernels, x_btd, l.weight[...])
                                   for l in lins):
            # q, k and v in one pool job: three small matrices cost one dispatch
            q, k, v = ops.linear_many(x_btd, [l.weight[...] for l in lins], biases)
        else:
            q, k, v = (l(x_btd) for l in lins)
        q, k = self._full_norm(q, k)
        norm = self.q_norm is not None and not self.qk_norm_full
        out, k_cache, v_cache = ops.decode_attention(
            q, k, v, cache[0], cache[1], where, kv_len=kv_len,
            inv_freq=None if self.rope is None else self.rope.inv_freq_array,
            rope_factor=1.0 if self.rope is None else self.rope.attention_factor,
            scale=self.scale, softcap=self.softcap, window=self.window,
            q_norm=self.q_norm.scale[...] if norm else None,
            k_norm=self.k_norm.scale[...] if norm else None,
            norm_eps=self.q_norm.eps if norm else 1e-6)
        return self._out(out), (k_cache, v_cache)

    def _full_norm(self, q, k):
        """q [.., N * H] and k [.., K * H] RMS-normed over the whole projection (OLMoE), or as
        they are."""
        if not self.qk_norm_full:
            return q, k
        return self.q_norm(q), self.k_norm(k)


def _cache_write(cache_rskh, new_btkh, cache_index):
    """Write the new keys (or values) into the cache: slots [i, i + T) of rows [0, B) for a scalar
    index, slot index[b] of row b for an index per sequence (T == 1)."""
    new = to_cache(new_btkh, cache_rskh.dtype)
    if jnp.ndim(cache_index) == 0:
        return jax.lax.dynamic_update_slice(cache_rskh, new, (0, cache_index, 0, 0))
    rows = jnp.arange(new.shape[0])
    return cache_rskh.at[rows, jnp.asarray(cache_index, jnp.int32)].set(new[:, 0])
