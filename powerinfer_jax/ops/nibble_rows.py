"""Nibble rows: the 4-bit row format of the predictor `--predictor q4` selects and of the FFN
`--gate-up q4` runs (cpu_backend/q4_estimate.h, q4_ffn.h), in numpy and jnp. Not a GGUF Q4_x
block (ops/qblocks.py): its own layout, below.

Rows of D weights are padded with zeros to P = ceil(D / 64) pairs of 32-weight blocks. Each block
has an fp16 scale d and minimum m (weight = m + d * q, q in 0..15: llama.cpp's Q4_1 grid, so a
row that came from a Q4_1 checkpoint is reproduced exactly). Packed per row:
  q  uint8 [P * 32]: byte j of pair p = weight 64p + j (low nibble) | weight 64p + 32 + j (high);
  dm float16 [4P]: the 2P scales, then the 2P minimums.
Activations are quantized per 32-block to int8 with a float32 scale (Q8): qblocks.round_activations.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from powerinfer_jax.ops.qblocks import q4_1_values

BLOCK = 32
PAIR_BYTES = 32


def num_pairs(dim: int) -> int:
    return -(-int(dim) // (2 * BLOCK))


def quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """w [..., D] (any float) -> (q uint8 [..., P * 32], dm float16 [..., 4P])."""
    w = np.asarray(w, np.float32)
    lead, d = w.shape[:-1], w.shape[-1]
    p = num_pairs(d)
    blocks = np.zeros(lead + (2 * p * BLOCK,), np.float32)
    blocks[..., :d] = w
    blocks = blocks.reshape(lead + (2 * p, BLOCK))
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale16 = ((hi - lo) / 15.0).astype(np.float16)
    min16 = lo.astype(np.float16)
    scale = scale16.astype(np.float32)[..., None]
    safe = np.where(scale > 0, scale, 1.0)
    q = np.where(scale > 0, np.clip(np.rint((blocks - min16.astype(np.float32)[..., None]) / safe),
                                    0, 15), 0).astype(np.uint8)
    q = q.reshape(lead + (p, 2, BLOCK))
    packed = q[..., 0, :] | (q[..., 1, :] << 4)
    return (packed.reshape(lead + (p * PAIR_BYTES,)),
            np.concatenate([scale16, min16], axis=-1))


def dequantize(q, dm, dim: int):
    """(q [..., P * 32], dm [..., 4P]) -> float32 [..., dim] (jnp; works on numpy inputs too)."""
    q = jnp.asarray(q, jnp.uint8)
    lead, p = q.shape[:-1], q.shape[-1] // PAIR_BYTES
    pairs = q.reshape(lead + (p, 1, BLOCK))
    nibbles = jnp.concatenate([pairs & 0x0F, pairs >> 4], axis=-2).astype(jnp.float32)
    dm = jnp.asarray(dm).astype(jnp.float32)
    scale = dm[..., :2 * p].reshape(lead + (p, 2, 1))
    minimum = dm[..., 2 * p:].reshape(lead + (p, 2, 1))
    return q4_1_values(nibbles, scale, minimum).reshape(lead + (2 * p * BLOCK,))[..., :dim]
