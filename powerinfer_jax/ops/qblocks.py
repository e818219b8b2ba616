"""Quantized blocks in jnp: the one 8-bit activation rounding and the one block dequantizer.

`round_activations` is the Python twin of the kernels' activation quantization (C++ QuantizeActs,
cpu_backend/quant_act.h, and the q4 predictor's QuantizeQ8, cpu_backend/q4_estimate.h): every
reference that rounds activations calls it. `dequantize_rows` turns GGML blocks into float32 (jnp
for the common 32-value formats, bit for bit the gguf package's values; the gguf package on the
host for the rest), and `q4_1_values` is the 4-bit affine decode it shares with the q4
predictor's rows (ops/nibble_rows.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def round_activations(x, block: int = 32):
    """x [..., D] float32 -> its int8 rounding as the quantized kernels compute (float32): per
    block of `block` values (32: legacy formats and the q4 predictor, 256: K-quants) scale =
    max|x| / 127 and round-half-even(x * (1 / scale)) * scale, in [-127, 127] * scale. A last
    block shorter than `block` is rounded as if padded with zeros (the q4 predictor's rows).
    XLA computes the division as max|x| * float32(1 / 127), so about 4% of scales are 1 ulp from
    the kernels' amax / 127.0f: tests compare the two with a tolerance."""
    x = jnp.asarray(x, F32)
    d = x.shape[-1]
    nb = -(-d // block)
    xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - d)]).reshape(
        x.shape[:-1] + (nb, block))
    scale = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 127.0
    # a block holding a NaN or an infinity rounds to NaN (the kernels' NaN scale)
    scale = jnp.where(jnp.all(jnp.isfinite(xb), axis=-1, keepdims=True), scale, jnp.nan)
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    xq = jnp.clip(jnp.round(xb * inv), -127, 127) * scale
    return xq.reshape(x.shape[:-1] + (nb * block,))[..., :d]


def q4_1_values(q, scale, minimum):
    """4-bit values q (float32, 0..15) on llama.cpp's Q4_1 grid: scale * q + minimum (the scale
    and minimum broadcast over q's block)."""
    return scale * q + minimum


def _f16(b, start: int):
    """The little-endian f16 at byte `start` of each block [..., nb, bytes] -> float32 [..., nb]."""
    bits = b[..., start].astype(jnp.uint16) | (b[..., start + 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(F32)


def _nibbles(q):
    """uint8 [..., 16] -> float32 [..., 32]: the 16 low nibbles, then the 16 high ones."""
    return jnp.concatenate([q & 0x0F, q >> 4], axis=-1).astype(F32)


def _q8_0(b):
    return _f16(b, 0)[..., None] * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(F32)


def _q4_0(b):
    return _f16(b, 0)[..., None] * (_nibbles(b[..., 2:]) - 8.0)


def _q4_1(b):
    return q4_1_values(_nibbles(b[..., 4:]), _f16(b, 0)[..., None], _f16(b, 2)[..., None])


# format -> (bytes per 32-value block, jnp dequantizer of [..., n_blocks, bytes])
JNP_FORMATS = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}


def _host_dequantize(blocks, qtype: str, dim: int):
    """uint8 [R, row_bytes] -> float32 [R, dim] with the gguf package's dequantizer (a host
    callback, so it also works on traced arrays under jit)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    out = jax.ShapeDtypeStruct((blocks.shape[0], dim), F32)
    return jax.pure_callback(lambda b: quants.dequantize(np.asarray(b), qtype), out, blocks)


def dequantize_rows(blocks, qtype: str, dim: int):
    """uint8 [..., row_bytes] rows in GGML format `qtype` -> float32 [..., dim]: in jnp for
    JNP_FORMATS, else through the gguf package's dequantizer on the host (any format)."""
    blocks = jnp.asarray(blocks)
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if quants.columns_base(qtype) is not None:  # the columns layout: decoded on the host
        return jax.pure_callback(lambda b: quants.columns_to_float(np.asarray(b), qtype, dim),
                                 jax.ShapeDtypeStruct(blocks.shape[:-1] + (dim,), jnp.float32),
                                 blocks)
    if qtype in JNP_FORMATS:
        nbytes, fn = JNP_FORMATS[qtype]
        b = blocks.reshape(blocks.shape[:-1] + (blocks.shape[-1] // nbytes, nbytes))
        return fn(b).reshape(blocks.shape[:-1] + (-1,))[..., :dim]
    flat = blocks.reshape(-1, blocks.shape[-1])
    return _host_dequantize(flat, qtype, dim).reshape(blocks.shape[:-1] + (dim,))
