"""Hugging Face FalconForCausalLM (model_type "falcon"): its config and tensor names -> ours.

Falcon runs attention and MLP in parallel on the block input (`parallel_attn`, always with
`new_decoder_architecture`), with one shared LayerNorm (`input_layernorm`) or two (`ln_attn`,
`ln_mlp`); `parallel_attn=False` is a sequential block with `post_attention_layernorm`. The
fused `query_key_value` is split into our q/k/v at load (`split_qkv`); rotary positions use the
rotate-half layout we use. Falcon's "gelu" is the exact (erf) GELU; we run the tanh form
(ops/reference.activate), within ~1e-3 of it, and warn. ALiBi variants are rejected.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from powerinfer_jax.config import ModelConfig

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}

# HF name (prefix "transformer." stripped, "h." -> "layers.") -> canonical; "qkv" is split later.
NAMES = {"word_embeddings.weight": "tok_embed", "ln_f.weight": "final_norm.scale",
         "ln_f.bias": "final_norm.bias", "lm_head.weight": "lm_head"}
for _kind in ("weight", "bias"):
    for _hf, _ours in (("self_attention.query_key_value", "qkv"), ("self_attention.dense", "attn.o"),
                       ("mlp.dense_h_to_4h", "ffn.up")):
        NAMES[f"layers.{{i}}.{_hf}.{_kind}"] = f"layers.{{i}}.{_ours}.{_kind}"
    for _hf, _ours in (("ln_attn", "attn_norm"), ("ln_mlp", "ffn_norm"),
                       ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
        NAMES[f"layers.{{i}}.{_hf}.{_kind}"] = \
            f"layers.{{i}}.{_ours}.{'scale' if _kind == 'weight' else 'bias'}"
NAMES["layers.{i}.mlp.dense_4h_to_h.weight"] = "layers.{i}.ffn.down_t.weight"  # transposed on load
NAMES["layers.{i}.mlp.dense_4h_to_h.bias"] = "layers.{i}.ffn.down.bias"


def config(cfg: Mapping[str, Any], common: dict, source: str, rope_theta: float) -> ModelConfig:
    """common: the fields every family shares (vocab, d_model, layers, heads, positions, ids)."""
    if cfg.get("alibi"):
        raise ValueError(f"{source}: alibi: expected false (rotary positions), got true "
                         "(ALiBi Falcon variants are not implemented)")
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new_arch and not parallel:
        raise ValueError(f"{source}: parallel_attn: expected true with new_decoder_architecture, "
                         "got false (transformers builds no ln_attn/ln_mlp for that combination)")
    act = cfg.get("activation", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: activation: expected one of {list(ACTIVATIONS)}, got {act!r}")
    if act == "gelu":
        import warnings

        warnings.warn(f"{source}: Falcon's 'gelu' is the exact erf GELU; running the tanh "
                      "approximation (within ~1e-3)", stacklevel=3)
    n_heads, d = common["n_heads"], common["d_model"]
    n_kv = int(cfg.get("num_kv_heads") or n_heads) if layout(cfg) != "mqa" else 1
    return ModelConfig(
        arch="falcon", **common, n_kv_heads=n_kv, head_dim=d // n_heads,
        d_ff=int(cfg.get("ffn_hidden_size") or 4 * d), activation=ACTIVATIONS[act], gated=False,
        bias=bool(cfg.get("bias", False)), norm="layer",
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), positions="rope",
        rope_theta=rope_theta, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        parallel_block=parallel)


def layout(cfg: Mapping[str, Any]) -> str:
    """How query_key_value's rows are grouped (transformers' FalconAttention._split_heads):
    "grouped" (new_decoder_architecture: per KV head, its query heads, then one key head and one
    value head), "interleaved" (multi-head: per head q, k, v) or "mqa" (every query head, then the
    key head, then the value head)."""
    if cfg.get("new_decoder_architecture", False):
        return "grouped"
    return "mqa" if cfg.get("multi_query", True) else "interleaved"


def split_qkv(w: np.ndarray, kind: str, c: ModelConfig) -> tuple[np.ndarray, ...]:
    """query_key_value rows ([(N + 2K) * H] or [3 * N * H], weight or bias) -> (q, k, v) rows."""
    h, n, k = c.head_dim, c.n_heads, c.n_kv_heads
    rest = w.shape[1:]
    if kind == "grouped":
        g = w.reshape(k, n // k + 2, h, *rest)
        q, kk, v = g[:, :-2], g[:, -2], g[:, -1]
    elif kind == "interleaved":
        g = w.reshape(n, 3, h, *rest)
        q, kk, v = g[:, 0], g[:, 1], g[:, 2]
    else:
        g = w.reshape(n + 2, h, *rest)
        q, kk, v = g[:-2], g[-2], g[-1]
    return tuple(np.ascontiguousarray(a.reshape(-1, *rest)) for a in (q, kk, v))


def finish(params: dict[str, np.ndarray], c: ModelConfig) -> None:
    """One norm shared by attention and FFN (input_layernorm of a parallel block): both use it."""
    if not c.parallel_block:
        return
    for i in range(c.n_layers):
        for kind in ("scale", "bias"):
            shared = params.get(f"layers.{i}.attn_norm.{kind}")
            if shared is not None:
                params.setdefault(f"layers.{i}.ffn_norm.{kind}", shared)
