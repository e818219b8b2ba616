"""Rotary position embedding: each layer's inverse frequencies, for every scaling the supported
families use.

A layer's rotation is fully described by `Rope`: the inverse frequency of each of the H/2 pairs
(pairs (i, i + H/2), HF's "rotate half") and a factor on cos/sin (YaRN's attention scaling).
Scalings only change those numbers, so the XLA path (`apply`) and the decode custom call
(ops.decode_attention, which takes the frequencies as an operand) need no case per scaling.
The numbers follow transformers' `ROPE_INIT_FUNCTIONS` (modeling_rope_utils.py) step by step in
float32: inv_freq = 1 / base ** (2i / H), then the scaling's rule. A GGUF's `rope_freqs` tensor
(llama.cpp's freq_factors, what convert_hf_to_gguf.py writes for Llama-3's "llama3" scaling)
divides the same base frequencies ("factors").
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from powerinfer_jax.config import ModelConfig, RopeScaling

F32 = np.float32


@dataclasses.dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding (static: hashable, part of the module's graph)."""

    inv_freq: tuple[float, ...]  # [H/2], float32 values
    attention_factor: float = 1.0  # cos and sin are multiplied by it (YaRN)

    @property
    def inv_freq_array(self) -> np.ndarray:
        return np.asarray(self.inv_freq, F32)


def base_inv_freq(head_dim: int, base: float) -> np.ndarray:
    """1 / base ** (2i / H) for i in [0, H/2), float32 as transformers computes it."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(F32) / F32(head_dim)
    return (F32(1.0) / (F32(base) ** exponent)).astype(F32)


def scaled_inv_freq(head_dim: int, base: float, s: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(inv_freq [H/2] float32, attention factor) of RoPE base `base` under scaling `s`."""
    inv = base_inv_freq(head_dim, base)
    if s is None:
        return inv, 1.0
    if s.kind == "linear":
        return (inv / F32(s.factor)).astype(F32), 1.0
    if s.kind == "factors":
        return (inv / np.asarray(s.factors, F32)).astype(F32), 1.0
    if s.kind == "llama3":
        return _llama3(inv, s), 1.0
    if s.kind == "yarn":
        return _yarn(head_dim, base, s)
    raise ValueError(f"RopeScaling.kind: expected one of linear, llama3, yarn, factors, got "
                     f"{s.kind!r}")


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """transformers' _compute_llama3_parameters: wavelengths longer than
    original / low_freq_factor divided by factor, shorter than original / high_freq_factor kept,
    a linear blend in between."""
    old = F32(s.original_max_position)
    low_wavelen = old / F32(s.low_freq_factor)
    high_wavelen = old / F32(s.high_freq_factor)
    wavelen = F32(2 * math.pi) / inv
    factor = F32(s.factor)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(F32)
    smooth = ((old / wavelen - F32(s.low_freq_factor))
              / F32(s.high_freq_factor - s.low_freq_factor)).astype(F32)
    smoothed = ((F32(1) - smooth) * scaled / factor + smooth * scaled).astype(F32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def _yarn(head_dim: int, base: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters (and llama.cpp's rope_yarn): a ramp over the
    dimensions between interpolated (/ factor) and original frequencies; cos/sin scaled."""
    dim = head_dim
    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations):
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    extrapolation = (F32(1) - ramp).astype(F32)
    pos_freqs = (F32(base) ** (np.arange(0, dim, 2).astype(F32) / F32(dim))).astype(F32)
    inv_extra = (F32(1) / pos_freqs).astype(F32)
    inv_inter = (F32(1) / (F32(factor) * pos_freqs)).astype(F32)
    inv = (inv_inter * (F32(1) - extrapolation) + inv_extra * extrapolation).astype(F32)
    return inv, float(attention)


def layer_rope(config: ModelConfig, layer: int) -> Rope | None:
    """Layer `layer`'s rotary embedding, or None for a model without rotary positions. A
    sliding-window layer of a model with `rope_local_theta` (Gemma-3) uses that base, unscaled;
    every other layer the model's base and scaling."""
    if config.positions != "rope":
        return None
    if config.window(layer) and config.rope_local_theta is not None:
        inv, attention = scaled_inv_freq(config.head_dim, config.rope_local_theta, None)
    else:
        inv, attention = scaled_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return Rope(tuple(float(v) for v in inv), float(attention))


def apply(x_btnh, positions_bt, rope: Rope):
    """Rotate x [B, T, N, H] by its positions [B, T]: pairs (h, h + H/2), angle position *
    inv_freq, cos/sin times the attention factor (as transformers multiplies them)."""
    half = x_btnh.shape[-1] // 2
    inv_freq = jnp.asarray(rope.inv_freq_array)  # [H/2]
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    x1, x2 = x_btnh[..., :half], x_btnh[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
