"""Hugging Face mixture-of-experts families: rows for hf.py's family table (as
hf_families.FAMILIES), and the stacking of per-expert tensors into [E, F, D].

  mixtral     llama attention; `block_sparse_moe.gate` routes over `experts.{e}.w1/w3/w2`
              (gate/up/down), top-k weights always renormalized (transformers' Mixtral)
  qwen3_moe   qwen3 attention (per-head q/k norms); `mlp.gate`, `mlp.experts.{e}.*_proj`,
              `moe_intermediate_size` neurons per expert, `norm_topk_prob` as configured
  qwen2_moe   qwen2 attention (q/k/v biases); as qwen3_moe plus a shared expert
              (`mlp.shared_expert.*`, `shared_expert_intermediate_size`) scaled by
              sigmoid(`mlp.shared_expert_gate` . x)
  olmoe       llama attention with q/k RMS norms over the whole projection; `mlp.gate`,
              `mlp.experts.{e}.*_proj`, `intermediate_size` per expert, `norm_topk_prob`
Models whose layers mix dense and MoE FFNs (`mlp_only_layers`, `decoder_sparse_step` > 1),
OLMoE's `clip_qkv` and a top-k larger than the number of experts are refused by name.
transformers 5's fused expert tensors (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj`
[E, D, F]) are read too.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import hf_families as families
from powerinfer_jax.config import ModelConfig

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ATTN = {k: v for k, v in families._LLAMA_NAMES.items() if ".mlp." not in k}
_ROUTED = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down_t"}


def _moe_names(block: str, parts: Mapping[str, str]) -> dict[str, str]:
    """Router and per-expert names of an MoE block named `block` (`mlp` / `block_sparse_moe`)."""
    names = {f"layers.{{i}}.{block}.gate.weight": "layers.{i}.ffn.router.weight",
             f"layers.{{i}}.{block}.experts.gate_up_proj": "layers.{i}.ffn.experts.gate_up",
             f"layers.{{i}}.{block}.experts.down_proj": "layers.{i}.ffn.experts.down_proj"}
    for hf, ours in parts.items():
        names[f"layers.{{i}}.{block}.experts.{{e}}.{hf}.weight"] = \
            f"layers.{{i}}.ffn.experts.{ours}.weight"
    return names


MIXTRAL_NAMES = {**_ATTN, **_moe_names("block_sparse_moe", {"w1": "gate", "w3": "up",
                                                             "w2": "down_t"})}
_QWEN_MOE = _moe_names("mlp", _ROUTED)
QWEN3_MOE_NAMES = {**_ATTN, **families._QK_NORM_NAMES, **_QWEN_MOE}
QWEN2_MOE_NAMES = {**_ATTN, **{k: v for k, v in families._QWEN2_NAMES.items() if k.endswith(".bias")},
                   **_QWEN_MOE,
                   **{f"layers.{{i}}.mlp.shared_expert.{hf}.weight": f"layers.{{i}}.ffn.shared.{ours}.weight"
                      for hf, ours in _ROUTED.items()},
                   "layers.{i}.mlp.shared_expert_gate.weight": "layers.{i}.ffn.shared_gate.weight"}
OLMOE_NAMES = {**_ATTN, **families._QK_NORM_NAMES, **_QWEN_MOE}


def _experts(cfg: Mapping[str, Any], source: str) -> dict:
    """n_experts (`num_local_experts` or `num_experts`: transformers 5 writes the first for
    Qwen3-MoE, 4 the second) and n_experts_used."""
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    n = int(families._get(cfg, key, source))
    k = int(families._get(cfg, "num_experts_per_tok", source))
    if not 1 <= k <= n:
        raise ValueError(f"{source}: num_experts_per_tok: expected an integer in [1, {key}="
                         f"{n}] (experts routed per token), got {k}")
    return dict(n_experts=n, n_experts_used=k)


def _every_layer_moe(cfg: Mapping[str, Any], source: str) -> None:
    if list(cfg.get("mlp_only_layers") or []) or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"{source}: mlp_only_layers / decoder_sparse_step: expected [] and 1 "
                         f"(an MoE FFN in every layer), got {cfg.get('mlp_only_layers')} and "
                         f"{cfg.get('decoder_sparse_step')} (mixed dense and MoE layers are not "
                         "implemented)")


def _mixtral(cfg, common, source):
    experts = _experts(cfg, source)
    base = families._llama({**cfg, "model_type": "mistral"}, common, source)
    return base.replace(**experts, norm_topk_prob=True)


def _qwen_moe(cfg, common, source):
    _every_layer_moe(cfg, source)
    experts = _experts(cfg, source)
    dense = "qwen3" if cfg.get("model_type") == "qwen3_moe" else "qwen2"
    base = families._qwen({**cfg, "model_type": dense, "intermediate_size": families._get(
        cfg, "moe_intermediate_size", source)}, common, source)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if dense == "qwen2" else 0
    return base.replace(**experts, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                        d_ff_shared=shared)


def _olmoe(cfg, common, source):
    families._no_bias(cfg, source, "olmoe")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"{source}: clip_qkv: expected null, got {cfg['clip_qkv']!r} (clipping "
                         "q/k/v is not implemented)")
    experts = _experts(cfg, source)
    base = families._decoder(cfg, common, source, activation=families._activation(cfg, source),
                             qk_norm_full=True)
    return base.replace(**experts, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


FAMILIES = {
    "mixtral": families.Family(_mixtral, MIXTRAL_NAMES),
    "qwen3_moe": families.Family(_qwen_moe, QWEN3_MOE_NAMES),
    "qwen2_moe": families.Family(_qwen_moe, QWEN2_MOE_NAMES),
    "olmoe": families.Family(_olmoe, OLMOE_NAMES),
}


def expert_of(rest: str) -> tuple[str, int | None]:
    """A per-layer HF name's expert index: ("experts.{e}.w1.weight", 3) for
    "experts.3.w1.weight"; (rest, None) for any other tensor."""
    m = _EXPERT.search(rest)
    if m is None:
        return rest, None
    return rest[:m.start()] + ".experts.{e}." + rest[m.end():], int(m.group(1))


def stack(per_expert: Mapping[str, dict[int, np.ndarray]], config: ModelConfig, source: str
          ) -> dict[str, np.ndarray]:
    """Per-expert tensors (canonical stacked name -> {expert: [F, D]}) -> [E, F, D] each."""
    out = {}
    for name, by_expert in per_expert.items():
        missing = sorted(set(range(config.n_experts)) - set(by_expert))
        extra = sorted(set(by_expert) - set(range(config.n_experts)))
        if missing or extra:
            raise ValueError(f"{source}: {name}: expected experts 0..{config.n_experts - 1}, "
                             f"got missing {missing[:8]}, unexpected {extra[:8]}")
        out[name] = np.stack([by_expert[e] for e in range(config.n_experts)])
    return out


def split_fused(name: str, value: np.ndarray, config: ModelConfig) -> dict[str, np.ndarray]:
    """transformers 5's fused expert tensors: gate_up_proj [E, 2F, D] -> gate, up [E, F, D];
    down_proj [E, D, F] -> down_t [E, F, D]."""
    stem = name.rsplit(".", 1)[0]  # "layers.3.ffn.experts"
    f = config.d_ff
    if name.endswith("gate_up"):
        if value.ndim != 3 or value.shape[1] != 2 * f:
            raise ValueError(f"tensor {name}: expected shape ({config.n_experts}, {2 * f}, "
                             f"{config.d_model}), got {value.shape}")
        return {f"{stem}.gate.weight": np.ascontiguousarray(value[:, :f]),
                f"{stem}.up.weight": np.ascontiguousarray(value[:, f:])}
    if value.ndim != 3:
        raise ValueError(f"tensor {name}: expected 3 dimensions [E, D, F], got {value.shape}")
    return {f"{stem}.down_t.weight": np.ascontiguousarray(np.swapaxes(value, 1, 2))}
