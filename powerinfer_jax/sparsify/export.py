"""Write a llama-family model as a Hugging Face directory every CLI loads with `--model DIR`.

checkpoint/ reads HF directories but has no writer; this is the one the sparsified models need:
config.json (LlamaForCausalLM, with the student's hidden_act), model.safetensors (float32, HF
names, down_proj = down_t transposed), tokenizer.json (the `tokenizers` backend as loaded, also
from GGUF metadata), tokenizer_config.json (BOS/EOS tokens, add_bos_token, chat template),
generation_config.json, and sparsify.json (how the model was made). The directory is written next
to its destination and renamed into place, so a reader never sees half a model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint.base import check_params
from powerinfer_jax.errors import check

_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "down_t": "down_proj"}


def canonical_params(model) -> dict[str, np.ndarray]:
    """A llama Transformer's weights under the canonical checkpoint names (float32 numpy)."""
    def arr(v):
        return np.asarray(v[...], np.float32)

    out = {"tok_embed": arr(model.tok_embed), "final_norm.scale": arr(model.final_norm.scale)}
    if model.lm_head is not None:
        out["lm_head"] = arr(model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        out[p + "attn_norm.scale"] = arr(layer.attn_norm.scale)
        out[p + "ffn_norm.scale"] = arr(layer.ffn_norm.scale)
        for name in _ATTN:
            out[f"{p}attn.{name}.weight"] = arr(getattr(layer.attn, name).weight)
        for name in _MLP:
            out[f"{p}ffn.{name}.weight"] = arr(getattr(layer.ffn, name).weight)
    return out


def hf_state_dict(params: dict[str, np.ndarray], n_layers: int) -> dict[str, np.ndarray]:
    """Canonical names -> HF LlamaForCausalLM names (down_t transposed back to down_proj)."""
    out = {"model.embed_tokens.weight": params["tok_embed"],
           "model.norm.weight": params["final_norm.scale"]}
    if "lm_head" in params:
        out["lm_head.weight"] = params["lm_head"]
    for i in range(n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = params[p + "attn_norm.scale"]
        out[h + "post_attention_layernorm.weight"] = params[p + "ffn_norm.scale"]
        for ours, theirs in _ATTN.items():
            out[f"{h}self_attn.{theirs}.weight"] = params[f"{p}attn.{ours}.weight"]
        for ours, theirs in _MLP.items():
            w = params[f"{p}ffn.{ours}.weight"]
            out[f"{h}mlp.{theirs}.weight"] = w.T if ours == "down_t" else w
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def hf_config(config, hidden_act: str, fatrelu_threshold=None) -> dict:
    """config.json of the model. fatrelu_threshold: FATReLU's gate threshold (sparsify/fatrelu.py),
    one for every layer or a list with one per layer (the fatrelu variant), a key of our own that
    Hugging Face loaders keep as an attribute and ignore."""
    c = config
    if isinstance(fatrelu_threshold, (list, tuple)):
        extra = {"fatrelu_threshold": [float(t) for t in fatrelu_threshold]}
    else:
        extra = {} if not fatrelu_threshold else {"fatrelu_threshold": float(fatrelu_threshold)}
    return {**extra, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
            "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
            "hidden_act": hidden_act, "max_position_embeddings": c.max_seq_len,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else (
                c.eos_token_ids[0] if c.eos_token_ids else None),
            "dtype": "float32"}


def _tokenizer_files(d: Path, tokenizer, max_len: int) -> None:
    tokenizer.backend.save(str(d / "tokenizer.json"))
    name = tokenizer.id_to_token
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "add_bos_token": bool(tokenizer.add_bos),
           "bos_token": None if tokenizer.bos_id is None else name(tokenizer.bos_id),
           "eos_token": name(tokenizer.eos_ids[0]) if tokenizer.eos_ids else None}
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def write_hf_dir(out: str | os.PathLike, config, params: dict[str, np.ndarray], tokenizer, *,
                 hidden_act: str, record: dict | None = None,
                 fatrelu_threshold=None) -> Path:
    """Write the model to directory `out` (replacing it); returns its path."""
    from safetensors.numpy import save_file

    check(config.arch == "llama" and config.gated and not config.bias, "export architecture",
          "a gated llama-family model without biases", config.arch)
    check_params(config, params, "export")
    out = Path(out).resolve()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf_state_dict(params, config.n_layers), str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(config, hidden_act, fatrelu_threshold),
                                                indent=1))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
    _tokenizer_files(tmp, tokenizer, config.max_seq_len)
    if record is not None:
        (tmp / "sparsify.json").write_text(json.dumps(record, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
