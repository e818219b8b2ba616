"""Tiny random mixture-of-experts models built by transformers (as helpers_families.py builds
the dense families): Mixtral, Qwen3-MoE (normalized top-k, as every published Qwen3-MoE and
as llama.cpp runs qwen3moe), Qwen2-MoE (a shared expert, weights not normalized) and OLMoE
(q/k norms over the whole projection). Odd sizes, 6 experts, 2 routed per token, expert FFNs
of 96 neurons (a multiple of 32: every expert matrix quantizes to Q4_0 / Q8_0), grouped KV
heads, three layers, seeded; a byte-level BPE tokenizer trained here.
`build(name, dir)` saves the HF directory and returns the torch model.
"""
from __future__ import annotations

import helpers_families as fam

_COMMON = dict(hidden_size=160, num_hidden_layers=3, max_position_embeddings=256,
               rms_norm_eps=1e-6, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {
    "mixtral": fam.FamilySpec(
        "MixtralConfig", "MixtralForCausalLM",
        dict(_COMMON, num_attention_heads=10, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, num_local_experts=6, sliding_window=None),
        fam.LLAMA3_TOK, "meta-llama-Llama-3.1-8B-Instruct", gguf_pre="llama-bpe"),
    "qwen3_moe": fam.FamilySpec(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(_COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
             intermediate_size=224, moe_intermediate_size=96, num_experts=6,
             norm_topk_prob=True, rope_theta=1000000.0),
        fam.QWEN_TOK, "Qwen-Qwen3-0.6B", gguf_pre="qwen2"),
    "qwen2_moe": fam.FamilySpec(
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(_COMMON, num_attention_heads=5, num_key_value_heads=1, intermediate_size=224,
             moe_intermediate_size=96, shared_expert_intermediate_size=128, num_experts=6,
             norm_topk_prob=False, rope_theta=1000000.0),
        fam.QWEN_TOK, "Qwen-Qwen2.5-7B-Instruct", gguf_pre="qwen2"),
    "olmoe": fam.FamilySpec(
        "OlmoeConfig", "OlmoeForCausalLM",
        dict(_COMMON, num_attention_heads=5, num_key_value_heads=5, intermediate_size=96,
             num_experts=6, norm_topk_prob=False, rms_norm_eps=1e-5),  # OLMoE's (the
        # converter writes 1e-5 whatever the config says)
        fam.QWEN_TOK, "Qwen-Qwen2.5-7B-Instruct", gguf_pre="qwen2"),
}


def _randomize(model, seed: int):
    """Matrices and stacked experts ~ 1.5 / sqrt(fan-in) (HF's init gives near-uniform
    logits and routers); norms around 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.2 * noise + 1.0)
            elif p.ndim >= 2:
                p.copy_(1.5 * noise * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.3 * noise)
    return model


def build(name: str, d, *, seed: int = 0, **overrides):
    """Save MoE family `name`'s tiny model and tokenizer to `d`; returns the torch model."""
    import torch
    import transformers

    spec = FAMILIES[name]
    fam.save_tokenizer(d, spec.tokenizer, fam.template(spec.template))
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = {k: tok.convert_tokens_to_ids(getattr(spec.tokenizer, k))
           for k in ("bos", "eos", "pad") if getattr(spec.tokenizer, k)}
    torch.manual_seed(seed)
    cfg = getattr(transformers, spec.config_class)(
        **{**spec.config, **overrides}, vocab_size=len(tok), bos_token_id=ids.get("bos"),
        eos_token_id=ids["eos"], pad_token_id=ids.get("pad"))
    model = getattr(transformers, spec.model_class)(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(d)
    return model
