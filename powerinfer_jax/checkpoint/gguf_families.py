"""GGUF architectures of the llama-like families beyond llama itself, as llama.cpp's
convert_hf_to_gguf.py writes them and llama.cpp reads them (src/models/<arch>.cpp):

  qwen2   llama's tensors plus attn_{q,k,v}.bias; Q/K rows not permuted (NEOX RoPE)
  qwen3   llama's tensors plus attn_{q,k}_norm (per-head RMSNorm)
  gemma2  GeGLU (tanh GELU), embeddings * sqrt(D), post_attention_norm / post_ffw_norm, norm
          weights stored as 1 + w (the converter adds the 1), attention and final logit
          soft-caps (defaults 50 / 30 as llama.cpp), sliding window (default 4096) on every
          other layer starting with layer 0 (`attention.sliding_window_pattern` overrides)
  gemma3  gemma2 without the attention soft-cap, with q/k norms; sliding layers 5 of every 6
          (when `attention.sliding_window` > 0) with their own RoPE base (`rope.freq_base_swa`,
          default 10000) and no scaling; global layers the file's base and scaling
  qwen2moe, qwen3moe, olmoe: experts (gguf_moe.py) with qwen2's, qwen3's attention, and
          OLMoE's q/k norms over the whole projection
  phi3    fused attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows: 2F), read as row ranges

Gemma's query scale is 1/sqrt(head_dim), or 1/sqrt(D / n_heads) for the 27B models (llama.cpp
tells them by their layer count, 46 for Gemma-2 and 62 for Gemma-3; the file stores no
query_pre_attn_scalar). RoPE scalings read (every llama-like arch): `rope.scaling.type` linear
or yarn (with factor, original_context_length, yarn_beta_fast/slow, attn_factor) and a
`rope_freqs` tensor (per-frequency divisors: what the converter writes for Llama-3's "llama3"
scaling); any other type, or Phi-3's longrope factor tensors, is refused by name.
Where llama.cpp deliberately ignores a key it has (Phi-3's sliding window: "currently
disabled"), we follow transformers, which applies it.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import gguf_moe
from powerinfer_jax.config import ModelConfig, RopeScaling
from powerinfer_jax.errors import fail

ARCHITECTURES = ("qwen2", "qwen3", "gemma2", "gemma3", "phi3") + gguf_moe.ARCHITECTURES
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_SCALING_TYPES = ("none", "linear", "yarn")

# canonical per-layer name (after "layers.{i}.") -> GGUF per-layer name (after "blk.{i}.")
LLAMA_TENSORS = {"attn_norm.scale": "attn_norm.weight", "attn.q.weight": "attn_q.weight",
                 "attn.k.weight": "attn_k.weight", "attn.v.weight": "attn_v.weight",
                 "attn.o.weight": "attn_output.weight", "ffn_norm.scale": "ffn_norm.weight",
                 "ffn.gate.weight": "ffn_gate.weight", "ffn.up.weight": "ffn_up.weight"}
_EXTRA_TENSORS = {"attn.q.bias": "attn_q.bias", "attn.k.bias": "attn_k.bias",
                  "attn.v.bias": "attn_v.bias", "attn.q_norm.scale": "attn_q_norm.weight",
                  "attn.k_norm.scale": "attn_k_norm.weight",
                  "attn_post_norm.scale": "post_attention_norm.weight",
                  "ffn_post_norm.scale": "post_ffw_norm.weight"}
TENSORS = {**LLAMA_TENSORS, **_EXTRA_TENSORS}


def _require(meta: Mapping[str, Any], key: str, source: str):
    if key not in meta:
        fail(f"{source}: metadata key {key!r}", "present", None,
             "the file is not a complete GGUF of its architecture")
    return meta[key]


def rope_scaling(meta: Mapping[str, Any], arch: str, source: str,
                 rope_freqs: np.ndarray | None, tensor_names=()) -> RopeScaling | None:
    """The global layers' RopeScaling of a llama-like GGUF (module docstring)."""
    a = arch + "."
    if any(n.startswith(("rope_factors_long", "rope_factors_short")) for n in tensor_names):
        fail(f"{source}: tensor 'rope_factors_long.weight'", "absent (LongRoPE scaling is not "
             "implemented)", "present", "this model's long-context RoPE cannot be run as written")
    kind = str(meta.get(a + "rope.scaling.type", "none")).lower()
    if kind not in _SCALING_TYPES:
        fail(f"{source}: metadata {a}rope.scaling.type", f"one of {list(_SCALING_TYPES)}", kind,
             "this RoPE scaling is not implemented; running without it would give wrong "
             "positions")
    factor = meta.get(a + "rope.scaling.factor")
    if factor is None and meta.get(a + "rope.scale_linear") is not None:  # an older key
        kind, factor = "linear", meta[a + "rope.scale_linear"]
    if rope_freqs is not None:
        if kind != "none":
            fail(f"{source}: tensor 'rope_freqs.weight'", "absent with a scaling type",
                 f"present with {kind!r}")
        return RopeScaling("factors", factors=tuple(float(f) for f in np.ravel(rope_freqs)))
    if kind == "none" or (kind == "linear" and float(factor or 1.0) == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(factor))
    ext = meta.get(a + "rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) not in (-1.0, 1.0):
        fail(f"{source}: metadata {a}rope.scaling.yarn_ext_factor", "1 (the ramp as "
             "transformers computes it)", ext)
    attention = meta.get(a + "rope.scaling.attn_factor")
    return RopeScaling(
        "yarn", factor=float(_require(meta, a + "rope.scaling.factor", source)),
        original_max_position=int(_require(meta, a + "rope.scaling.original_context_length",
                                           source)),
        beta_fast=float(meta.get(a + "rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(a + "rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=None if attention is None else float(attention))


def head_dim(meta: Mapping[str, Any], arch: str, d: int, n_heads: int, source: str) -> int:
    """Attention head size; the rotary dimensions must cover the whole head."""
    a = arch + "."
    h = int(meta.get(a + "attention.key_length") or meta.get(a + "rope.dimension_count")
            or d // n_heads)
    rot = meta.get(a + "rope.dimension_count")
    if rot is not None and int(rot) != h:
        fail(f"{source}: metadata {a}rope.dimension_count", f"{h} (the head size: partial "
             "rotary is not implemented)", int(rot))
    return h


def _swa_pattern(meta: Mapping[str, Any], a: str, n_layers: int, default: int) -> list[bool]:
    """Which layers slide (llama.cpp's load_swa_pattern): the key as a per-layer array, or a
    period n whose last layer of every n is global."""
    pattern = meta.get(a + "attention.sliding_window_pattern", default)
    if isinstance(pattern, (list, tuple)):
        return [bool(p) for p in pattern][:n_layers]
    n = int(pattern)
    return [n > 1 and i % n < n - 1 for i in range(n_layers)]


def config(arch: str, meta: Mapping[str, Any], source: str, common: dict, *, tied: bool,
           rope_freqs: np.ndarray | None, tensor_names=()) -> ModelConfig:
    """ModelConfig of a GGUF of one of ARCHITECTURES. common: the fields every arch reads the
    same way (vocab, d_model, layers, heads, d_ff, ids)."""
    a = arch + "."
    d, n_layers, n_heads = common["d_model"], common["n_layers"], common["n_heads"]
    h = head_dim(meta, arch, d, n_heads, source)
    theta = float(meta.get(a + "rope.freq_base", 10000.0))
    family: dict[str, Any] = {}  # common["activation"]: gguf_arch.activation_for
    window = int(meta.get(a + "attention.sliding_window") or 0)
    windows: tuple[int, ...] = ()
    dense = gguf_moe.DENSE_ANALOGUE.get(arch, arch)  # an MoE arch's attention
    if dense == "qwen2":
        family.update(qkv_bias=True)
    elif dense == "qwen3":
        family.update(qk_norm=True)
    elif arch == "olmoe":
        family.update(qk_norm_full=True)
    elif arch == "phi3":
        if window:
            windows = (window,) * n_layers
    else:  # gemma2, gemma3
        gemma2 = arch == "gemma2"
        if gemma2:
            window = window or 4096  # llama.cpp's default for Gemma-2
        if window:
            slides = _swa_pattern(meta, a, n_layers, 2 if gemma2 else 6)
            windows = tuple(window if s else 0 for s in slides)
        q_dim = d // n_heads if n_layers == _GEMMA_27B_LAYERS[arch] else h
        family.update(
            post_norms=True, qk_norm=not gemma2,
            embed_scale=float(np.float32(d ** 0.5)), query_scale=float(q_dim) ** -0.5,
            attn_softcap=float(meta.get(a + "attn_logit_softcapping", 50.0)) if gemma2 else 0.0,
            final_softcap=float(meta.get(a + "final_logit_softcapping",
                                         30.0 if gemma2 else 0.0)),
            rope_local_theta=_local_theta(meta, a, theta, gemma2) if window else None)
    common = {**common, **gguf_moe.experts(meta, arch, source)}
    return ModelConfig(
        arch="llama", **common, head_dim=h,
        max_seq_len=int(_require(meta, a + "context_length", source)), gated=True, bias=False,
        norm="rms", norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
        positions="rope", rope_theta=theta,
        rope_scaling=rope_scaling(meta, arch, source, rope_freqs, tensor_names),
        tie_embeddings=tied, layer_windows=windows, **family)


def _local_theta(meta: Mapping[str, Any], a: str, theta: float, gemma2: bool) -> float | None:
    """Sliding layers' RoPE base: Gemma-3's own (default 10000, as llama.cpp); Gemma-2's is
    the global one unless the file gives another."""
    local = meta.get(a + "rope.freq_base_swa")
    if gemma2:
        return None if local is None or float(local) == theta else float(local)
    return float(10000.0 if local is None else local)


def fused_rows(config: ModelConfig, rest: str) -> tuple[str, int, int] | None:
    """Phi-3's fused tensors: a canonical per-layer name -> (GGUF name, first row, end row)."""
    q, kv, f = config.q_dim, config.kv_dim, config.d_ff
    rows = {"attn.q.weight": ("attn_qkv.weight", 0, q),
            "attn.k.weight": ("attn_qkv.weight", q, q + kv),
            "attn.v.weight": ("attn_qkv.weight", q + kv, q + 2 * kv),
            "ffn.gate.weight": ("ffn_up.weight", 0, f),
            "ffn.up.weight": ("ffn_up.weight", f, 2 * f)}
    return rows.get(rest)
