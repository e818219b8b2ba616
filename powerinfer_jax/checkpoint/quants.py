"""Vectorized numpy dequantizers for the GGML block formats the loader accepts.

Block layouts (little endian, one block = 32 consecutive values along a row's fastest axis):
  Q8_0: f16 scale d, 32 x int8 q                 -> x = d * q                       (34 bytes)
  Q4_0: f16 scale d, 16 bytes of nibbles         -> x = d * (q - 8)                 (18 bytes)
  Q4_1: f16 scale d, f16 min m, 16 bytes nibbles -> x = d * q + m                   (20 bytes)
In the 4-bit formats byte j holds value j in its low nibble and value j + 16 in its high nibble.
Float types: F32, F16, BF16 (the top 16 bits of an IEEE float32).

Every function takes the raw bytes of whole rows, `uint8[..., row_bytes]`, and returns float32
`[..., row_elements]`.
"""
from __future__ import annotations

import numpy as np

BLOCK = 32
# type name -> (values per block, bytes per block)
BLOCK_SIZES = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (BLOCK, 2 + BLOCK),
    "Q4_0": (BLOCK, 2 + BLOCK // 2),
    "Q4_1": (BLOCK, 4 + BLOCK // 2),
}
SUPPORTED_TYPES = tuple(BLOCK_SIZES)
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def _blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    """View `uint8[..., row_bytes]` as `uint8[..., n_blocks, block_bytes]`."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    block_bytes = BLOCK_SIZES[qtype][1]
    if raw.shape[-1] % block_bytes:
        raise ValueError(f"{qtype} row: expected a multiple of {block_bytes} bytes, "
                         f"got {raw.shape[-1]}")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // block_bytes, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 stored at byte `start` of every block, as float32 `[..., n_blocks, 1]`."""
    return blocks[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """`uint8[..., 16]` -> float32 `[..., 32]`: the 16 low nibbles, then the 16 high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)


def _flatten_blocks(x: np.ndarray) -> np.ndarray:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q8_0")
    q = b[..., 2:].view(np.int8).astype(np.float32)
    return _flatten_blocks(_f16(b, 0) * q)


def dequantize_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q4_0")
    return _flatten_blocks(_f16(b, 0) * (_nibbles(b[..., 2:]) - 8.0))


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, "Q4_1")
    return _flatten_blocks(_f16(b, 0) * _nibbles(b[..., 4:]) + _f16(b, 2))


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def dequantize_f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def dequantize_f32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float32).copy()


_DEQUANTIZERS = {
    "F32": dequantize_f32,
    "F16": dequantize_f16,
    "BF16": dequantize_bf16,
    "Q8_0": dequantize_q8_0,
    "Q4_0": dequantize_q4_0,
    "Q4_1": dequantize_q4_1,
}


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Raw bytes of whole rows (`uint8[..., row_bytes]`, or an already typed float array) -> float32."""
    if qtype not in _DEQUANTIZERS:
        raise ValueError(f"tensor type: expected one of {list(SUPPORTED_TYPES)}, got {qtype!r}")
    if raw.dtype != np.uint8:  # GGUFReader hands float tensors over already typed
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(*raw.shape[:-1], -1)
    return _DEQUANTIZERS[qtype](raw)
