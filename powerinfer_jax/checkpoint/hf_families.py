"""Hugging Face model families: each config.json's `model_type` -> a `Family` (how its config
becomes a ModelConfig, its tensor names, and what the loader does to its tensors).

One table (`FAMILIES`); a family is a row, not a branch of the loader. Rows:
  llama, mistral   LlamaForCausalLM / MistralForCausalLM: GQA, SiLU/ReLU, tied or untied,
                   RoPE scalings (rope.py), Mistral's sliding window on every layer
  bamboo           PowerInfer's dReLU llama (relu(gate) * relu(up) whatever hidden_act says)
  qwen2, qwen3     Qwen2 (q/k/v biases, no o bias), Qwen3 (RMSNorm per head on q and k)
  gemma2, gemma3_text  GeGLU (tanh GELU), embeddings * sqrt(D), norms before and after
                   attention and FFN whose (1 + w) weights are loaded as 1 + w (`norm_shift`),
                   query_pre_attn_scalar, soft-caps (Gemma-2), sliding-window layers from
                   `layer_types`, q/k norms and a local RoPE base on sliding layers (Gemma-3)
  phi3             fused qkv_proj and gate_up_proj, split into q, k, v and gate, up at load
  opt, falcon      OPT; Falcon (hf_falcon.py)
RoPE scalings read: linear, llama3, yarn (config.RopeScaling); others (dynamic, longrope, ...)
are refused by name, never ignored. Experts (MoE) would be a row with its own names and split.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from powerinfer_jax.checkpoint import hf_falcon
from powerinfer_jax.config import ModelConfig, RopeScaling

# HF name (prefix stripped) -> canonical; "{i}" is the layer index.
_LLAMA_NAMES = {
    "embed_tokens.weight": "tok_embed",
    "norm.weight": "final_norm.scale",
    "lm_head.weight": "lm_head",
    "layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.scale",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.scale",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.ffn.gate.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.ffn.up.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.ffn.down_t.weight",  # transposed on load
}
_QK_NORM_NAMES = {"layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.scale",
                  "layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.scale"}
_QWEN2_NAMES = {**_LLAMA_NAMES, **{f"layers.{{i}}.self_attn.{p}_proj.bias": f"layers.{{i}}.attn.{p}.bias"
                                   for p in "qkv"}}
_QWEN3_NAMES = {**_LLAMA_NAMES, **_QK_NORM_NAMES}
# Gemma: post_attention_layernorm is the norm on attention's output, pre_feedforward_layernorm
# the FFN's input norm (a llama's post_attention_layernorm).
_GEMMA2_NAMES = {**_LLAMA_NAMES,
                 "layers.{i}.post_attention_layernorm.weight": "layers.{i}.attn_post_norm.scale",
                 "layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.ffn_norm.scale",
                 "layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.ffn_post_norm.scale"}
_GEMMA3_NAMES = {**_GEMMA2_NAMES, **_QK_NORM_NAMES}
# Phi-3: fused tensors to pseudo-names that `Family.split` turns into canonical ones
_PHI3_NAMES = {k: v for k, v in _LLAMA_NAMES.items() if "_proj" not in k or "o_proj" in k
               or "down_proj" in k}
_PHI3_NAMES.update({"layers.{i}.self_attn.qkv_proj.weight": "layers.{i}.attn.qkv.weight",
                    "layers.{i}.mlp.gate_up_proj.weight": "layers.{i}.ffn.gate_up.weight"})
_OPT_NAMES = {
    "embed_tokens.weight": "tok_embed",
    "embed_positions.weight": "pos_embed",
    "final_layer_norm.weight": "final_norm.scale",
    "final_layer_norm.bias": "final_norm.bias",
    "lm_head.weight": "lm_head",
    "layers.{i}.self_attn_layer_norm.weight": "layers.{i}.attn_norm.scale",
    "layers.{i}.self_attn_layer_norm.bias": "layers.{i}.attn_norm.bias",
    "layers.{i}.final_layer_norm.weight": "layers.{i}.ffn_norm.scale",
    "layers.{i}.final_layer_norm.bias": "layers.{i}.ffn_norm.bias",
    "layers.{i}.fc1.weight": "layers.{i}.ffn.up.weight",
    "layers.{i}.fc1.bias": "layers.{i}.ffn.up.bias",
    "layers.{i}.fc2.weight": "layers.{i}.ffn.down_t.weight",  # transposed on load
    "layers.{i}.fc2.bias": "layers.{i}.ffn.down.bias",
}
for _hf, _ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
    for _kind in ("weight", "bias"):
        _OPT_NAMES[f"layers.{{i}}.self_attn.{_hf}.{_kind}"] = f"layers.{{i}}.attn.{_ours}.{_kind}"

# hidden_act / hidden_activation -> ModelConfig.activation for gated (llama-like) families.
# transformers' "gelu_pytorch_tanh" / "gelu_new" are the tanh GELU our kernels compute.
_GATED_ACTS = {"silu": "silu", "relu": "relu", "drelu": "drelu", "gelu_pytorch_tanh": "gelu",
               "gelu_new": "gelu"}

Split = Callable[[str, np.ndarray, Mapping[str, Any], ModelConfig], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Family:
    """config: (config.json, the fields every family shares, source) -> ModelConfig.
    names: HF tensor name (model prefix stripped, "{i}" the layer) -> canonical name.
    norm_shift: added to every norm weight at load (Gemma's RMSNorm multiplies by 1 + w: the
      weight becomes 1 + w here, so the model has one norm). split: a fused tensor's
      pseudo-name -> its canonical parts (Phi-3's qkv_proj, gate_up_proj; Falcon's
      query_key_value)."""

    config: Callable[[Mapping[str, Any], dict, str], ModelConfig]
    names: Mapping[str, str]
    norm_shift: float = 0.0
    split: Split | None = None


def _get(cfg: Mapping[str, Any], key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: expected key {key!r} in config.json, got none")
    return cfg[key]


# ------------------------------------------------------------------------------------ RoPE
_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def rope(cfg: Mapping[str, Any], source: str, layer_type: str = "full_attention",
         ) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of the layers of `layer_type` from config.json: transformers 5's
    `rope_parameters` (flat, or one entry per layer type as Gemma-3 writes it) or 4's
    `rope_scaling` + `rope_theta`. A scaling we do not implement is an error naming it."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or params.get("full_attention") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ValueError(f"{source}: rope type: expected one of {list(_ROPE_KINDS)}, got {kind!r} "
                         "(this RoPE scaling is not implemented; running without it would "
                         "give wrong positions)")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor: expected 1.0 (rotary on the whole "
                         f"head), got {partial!r} (partial rotary is not implemented)")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings"))
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(_get(params, "factor", source)))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", factor=float(_get(params, "factor", source)),
            low_freq_factor=float(_get(params, "low_freq_factor", source)),
            high_freq_factor=float(_get(params, "high_freq_factor", source)),
            original_max_position=int(_get(params, "original_max_position_embeddings", source)))
    if original is None:
        raise ValueError(f"{source}: rope original_max_position_embeddings: expected a number "
                         "for yarn, got none")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = _get(cfg, "max_position_embeddings", source) / original
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:
        def m(scale, ms):
            return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0
        attention = m(factor, mscale) / m(factor, mscale_all)
    return theta, RopeScaling(
        "yarn", factor=float(factor), original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=None if attention is None else float(attention),
        truncate=bool(params.get("truncate", True)))


# ------------------------------------------------------------------------------------ configs
def _activation(cfg: Mapping[str, Any], source: str, default: str = "silu") -> str:
    key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(key) or default
    if act not in _GATED_ACTS:
        hint = (" (the exact erf GELU; the kernels compute the tanh form)" if act == "gelu"
                else "")
        raise ValueError(f"{source}: {key}: expected one of {list(_GATED_ACTS)}, got {act!r}{hint}")
    return _GATED_ACTS[act]


def _no_bias(cfg: Mapping[str, Any], source: str, family: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{source}: {key}: expected false for the {family} family, got true")


def _layer_windows(cfg: Mapping[str, Any], n_layers: int, source: str, default: list[str]
                   ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(per-layer windows, per-layer types) from `layer_types` (transformers 5 writes it) or
    the family's default types; "sliding_attention" layers get `sliding_window`."""
    types = tuple(cfg.get("layer_types") or default)
    if len(types) != n_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"{source}: layer_types: expected {n_layers} entries of "
                         f"'full_attention' / 'sliding_attention', got {list(types)[:8]}")
    if "sliding_attention" not in types:
        return (), types
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"{source}: sliding_window: expected a positive integer for its "
                         f"sliding_attention layers, got {window!r}")
    return tuple(window if t == "sliding_attention" else 0 for t in types), types


def _decoder(cfg: Mapping[str, Any], common: dict, source: str, *, windows=(), **family
             ) -> ModelConfig:
    """A llama-like decoder (RMSNorm, gated FFN, RoPE) with `family`'s ModelConfig fields."""
    theta, scaling = rope(cfg, source)
    return ModelConfig(
        arch="llama", **common,
        n_kv_heads=int(cfg.get("num_key_value_heads") or common["n_heads"]),
        head_dim=int(cfg.get("head_dim") or common["d_model"] // common["n_heads"]),
        d_ff=int(_get(cfg, "intermediate_size", source)), gated=True, bias=False, norm="rms",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), positions="rope", rope_theta=theta,
        rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_windows=windows, **family)


def _llama(cfg, common, source):
    _no_bias(cfg, source, "llama")
    act = "drelu" if cfg.get("model_type") == "bamboo" else _activation(cfg, source)
    windows = ()
    if cfg.get("model_type") == "mistral" and cfg.get("sliding_window"):
        windows = (int(cfg["sliding_window"]),) * common["n_layers"]
    return _decoder(cfg, common, source, windows=windows, activation=act)


def _qwen(cfg, common, source):
    kind = cfg.get("model_type")
    if kind == "qwen3":
        _no_bias(cfg, source, kind)
    n = common["n_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    start = int(cfg.get("max_window_layers") or 0)
    default = ["sliding_attention" if window is not None and i >= start else "full_attention"
               for i in range(n)]
    windows, _ = _layer_windows(cfg, n, source, default)
    return _decoder(cfg, common, source, windows=windows, activation=_activation(cfg, source),
                    qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3")


def _gemma(cfg, common, source):
    kind = cfg.get("model_type")
    _no_bias(cfg, source, kind)
    n = common["n_layers"]
    if kind == "gemma2":
        default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    else:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(n)]
    windows, types = _layer_windows(cfg, n, source, default)
    head_dim = int(cfg.get("head_dim") or common["d_model"] // common["n_heads"])
    local_theta = None
    if kind == "gemma3_text":
        if "sliding_attention" in (cfg.get("rope_parameters") or {}):  # transformers 5
            local_theta, local_scaling = rope(cfg, source, "sliding_attention")
            if local_scaling is not None:
                raise ValueError(f"{source}: sliding_attention rope type: expected 'default', "
                                 f"got {local_scaling.kind!r} (scaled local RoPE is not "
                                 "implemented)")
        else:  # transformers 4: the scaling is the global layers' only
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    return _decoder(
        cfg, common, source, windows=windows, activation=_activation(cfg, source,
                                                                     "gelu_pytorch_tanh"),
        qk_norm=kind == "gemma3_text", post_norms=True,
        embed_scale=float(np.float32(common["d_model"] ** 0.5)),
        query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        rope_local_theta=local_theta)


def _phi3(cfg, common, source):
    _no_bias(cfg, source, "phi3")
    windows = ()
    if cfg.get("sliding_window"):
        windows = (int(cfg["sliding_window"]),) * common["n_layers"]
    return _decoder(cfg, common, source, windows=windows, activation=_activation(cfg, source))


def _split_phi3(name: str, value: np.ndarray, cfg, c: ModelConfig) -> dict[str, np.ndarray]:
    """qkv_proj rows [q; k; v] and gate_up_proj rows [gate; up] (transformers' Phi3: `chunk`)."""
    stem = name.rsplit(".", 2)[0]  # "layers.3.attn" / "layers.3.ffn"
    if name.endswith("attn.qkv.weight"):
        q, kv = c.q_dim, c.kv_dim
        parts = {"q": value[:q], "k": value[q:q + kv], "v": value[q + kv:q + 2 * kv]}
    else:
        parts = {"gate": value[:c.d_ff], "up": value[c.d_ff:2 * c.d_ff]}
    if sum(p.shape[0] for p in parts.values()) != value.shape[0]:
        raise ValueError(f"tensor {name}: expected {sum(p.shape[0] for p in parts.values())} "
                         f"rows (the parts the config implies), got {value.shape[0]}")
    return {f"{stem}.{k}.weight": np.ascontiguousarray(v) for k, v in parts.items()}


def _opt(cfg, common, source):
    rules = [("activation_function", "relu", "OPT runs with ReLU only"),
             ("do_layer_norm_before", True, "post-LayerNorm OPT (350m) is not supported"),
             ("enable_bias", True, "OPT without biases is not supported"),
             ("layer_norm_elementwise_affine", True, "LayerNorms need a scale and bias"),
             ("word_embed_proj_dim", common["d_model"],
              "word_embed_proj_dim must equal hidden_size (no project_in/out)")]
    for key, want, hint in rules:
        got = cfg.get(key, want)
        if got != want:
            raise ValueError(f"{source}: {key}: expected {want!r}, got {got!r} ({hint})")
    return ModelConfig(
        arch="opt", **common, n_kv_heads=common["n_heads"],
        head_dim=common["d_model"] // common["n_heads"], d_ff=int(_get(cfg, "ffn_dim", source)),
        activation="relu", gated=False, bias=True, norm="layer", norm_eps=1e-5,
        positions="learned", position_offset=2,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))


def _falcon(cfg, common, source):
    return hf_falcon.config(cfg, common, source, rope(cfg, source)[0])


def _split_falcon(name: str, value: np.ndarray, cfg, c: ModelConfig) -> dict[str, np.ndarray]:
    stem, kind = name.rsplit(".qkv.", 1)
    parts = hf_falcon.split_qkv(value, hf_falcon.layout(cfg), c)
    return {f"{stem}.attn.{p}.{kind}": v for p, v in zip("qkv", parts)}


_LLAMA = Family(_llama, _LLAMA_NAMES)
_GEMMA_SHIFT = 1.0  # Gemma's RMSNorm: x * (1 + w)
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA, "mistral": _LLAMA, "bamboo": _LLAMA,
    "qwen2": Family(_qwen, _QWEN2_NAMES), "qwen3": Family(_qwen, _QWEN3_NAMES),
    "gemma2": Family(_gemma, _GEMMA2_NAMES, norm_shift=_GEMMA_SHIFT),
    "gemma3_text": Family(_gemma, _GEMMA3_NAMES, norm_shift=_GEMMA_SHIFT),
    "phi3": Family(_phi3, _PHI3_NAMES, split=_split_phi3),
    "opt": Family(_opt, _OPT_NAMES),
    "falcon": Family(_falcon, hf_falcon.NAMES, split=_split_falcon),
}
SUPPORTED = tuple(FAMILIES)


def eos_ids(cfg: Mapping[str, Any], d: Path) -> tuple[int, ...]:
    import json

    ids: list[int] = []
    gen = d / "generation_config.json"
    for source in (cfg, json.loads(gen.read_text()) if gen.is_file() else {}):
        eos = source.get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def common_fields(cfg: Mapping[str, Any], d: Path, source: str) -> dict:
    """The ModelConfig fields every family reads the same way."""
    return dict(vocab_size=int(_get(cfg, "vocab_size", source)),
                d_model=int(_get(cfg, "hidden_size", source)),
                n_layers=int(_get(cfg, "num_hidden_layers", source)),
                n_heads=int(_get(cfg, "num_attention_heads", source)),
                max_seq_len=int(_get(cfg, "max_position_embeddings", source)),
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg, d))
