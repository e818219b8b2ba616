"""Mixture-of-experts GGUFs as llama.cpp's convert_hf_to_gguf.py writes them and llama.cpp
reads them (src/models/<arch>.cpp, build_moe_ffn with softmax gating):

  llama     with `llama.expert_count` (Mixtral): llama's attention, top-k weights normalized
  qwen3moe  qwen3's attention; normalized top-k weights (llama.cpp: always)
  qwen2moe  qwen2's attention; weights not normalized; a shared expert (`ffn_*_shexp`,
            `expert_shared_feed_forward_length`) scaled by sigmoid(`ffn_gate_inp_shexp` . x)
  olmoe     llama's attention without permuted rows (NEOX RoPE), q/k RMS norms over the whole
            projection (`attn_q_norm` [N * H], `attn_k_norm` [K * H]); weights not normalized
A file's `expert_weights_norm` key, when present, overrides the arch's default.
Per layer: `ffn_gate_inp` [E, D] (the router), `ffn_gate_exps` / `ffn_up_exps` [E, F, D],
`ffn_down_exps` [E, D, F] (numpy order; canonical down_t is its last two axes swapped).
"""
from __future__ import annotations

from typing import Any, Mapping

from powerinfer_jax.errors import fail

ARCHITECTURES = ("qwen2moe", "qwen3moe", "olmoe")
DENSE_ANALOGUE = {"qwen2moe": "qwen2", "qwen3moe": "qwen3"}  # attention as these archs'
_NORMALIZED = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}

# canonical per-layer name (after "layers.{i}.") -> (GGUF name after "blk.{i}.", kind)
TENSORS = {"ffn.router.weight": ("ffn_gate_inp.weight", "plain"),
           "ffn.experts.gate.weight": ("ffn_gate_exps.weight", "plain"),
           "ffn.experts.up.weight": ("ffn_up_exps.weight", "plain"),
           "ffn.experts.down_t.weight": ("ffn_down_exps.weight", "transposed"),
           "ffn.shared.gate.weight": ("ffn_gate_shexp.weight", "plain"),
           "ffn.shared.up.weight": ("ffn_up_shexp.weight", "plain"),
           "ffn.shared.down_t.weight": ("ffn_down_shexp.weight", "transposed"),
           "ffn.shared_gate.weight": ("ffn_gate_inp_shexp.weight", "vector")}


def experts(meta: Mapping[str, Any], arch: str, source: str) -> dict:
    """The ModelConfig fields of a file's experts ({} for a dense file)."""
    a = arch + "."
    n = meta.get(a + "expert_count")
    if not n:
        if arch in ARCHITECTURES:
            fail(f"{source}: metadata key '{a}expert_count'", "present (an MoE architecture)",
                 None)
        return {}
    n, k = int(n), int(meta.get(a + "expert_used_count") or 0)
    if not 1 <= k <= n:
        fail(f"{source}: metadata {a}expert_used_count", f"an integer in [1, {a}expert_count="
             f"{n}] (experts routed per token)", k)
    out = dict(n_experts=n, n_experts_used=k,
               norm_topk_prob=bool(meta.get(a + "expert_weights_norm", _NORMALIZED[arch])))
    if meta.get(a + "expert_feed_forward_length"):
        out["d_ff"] = int(meta[a + "expert_feed_forward_length"])
    if arch == "qwen2moe":
        out["d_ff_shared"] = int(meta.get(a + "expert_shared_feed_forward_length") or 0)
    gating = meta.get(a + "expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        fail(f"{source}: metadata {a}expert_gating_func", "1 (softmax)", gating,
             "sigmoid gating is not implemented")
    return out
