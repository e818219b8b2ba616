"""Test helpers: PowerInfer GGUF files written the way PowerInfer's own converters write them.

Independent of powerinfer_jax's writer: these follow SJTU-IPADS/PowerInfer at d3ebd7c step by
step, with the `gguf` package's writer:
  convert.py (llama, bamboo): q/k rows permuted by its `permute(weights, n_head, n_head_kv)`,
    HF names mapped to GGUF ones, `ffn_down` renamed `ffn_down_t` and transposed
    (`postprocess_transpose`), predictors from `model_<i>.pt` state dicts (fc1 [R, D],
    fc2 [F, R]) named `blk.<i>.fc1/fc2.weight`, `powerinfer.sparse_threshold` from the predictor
    directory's config.json, then the first four bytes overwritten with "PWRI".
  convert-hf-to-powerinfer-gguf.py (falcon): query_key_value regrouped as all Q heads, then K,
    then V ("jploski" layout), ln_mlp -> attn_norm, ln_attn -> attn_norm_2, ffn_down_t transposed,
    feed_forward_length 4 * hidden, context 2048, PWRI magic.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

PWRI = int.from_bytes(b"PWRI", "little")


def _permute(weights, n_head, n_head_kv):  # convert.py's permute, verbatim in behaviour
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tokenizer(w, meta):
    w.add_tokenizer_model(meta["model"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["token_type"])
    if "merges" in meta:
        w.add_token_merges(meta["merges"])
    w.add_bos_token_id(meta["bos_token_id"])
    w.add_eos_token_id(meta["eos_token_id"])


def _finish(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.write(struct.pack("<I", PWRI))
    return Path(path)


def convert_llama(path, hf_state, hf_config, predictors, tokenizer_meta, *, threshold=None,
                  arch="llama"):
    """hf_state: LlamaForCausalLM state_dict as numpy; predictors: per layer (fc1, fc2)."""
    import gguf

    c = hf_config
    n_head, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("LLaMA")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_rope_dimension_count(c["hidden_size"] // n_head)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    # convert.py reads config["rope_theta"]; transformers 5 saves it under rope_parameters
    w.add_rope_freq_base(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])
    w.add_file_type(0)
    if threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", threshold)
    _tokenizer(w, tokenizer_meta)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = {}
    for name, value in hf_state.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = value
        elif name == "model.norm.weight":
            out["output_norm.weight"] = value
        elif name == "lm_head.weight":
            out["output.weight"] = value
        else:
            _, _, i, rest = name.split(".", 3)
            stem, kind = rest.rsplit(".", 1)
            if stem == "self_attn.q_proj":
                value = _permute(value, n_head, n_head)
            elif stem == "self_attn.k_proj":
                value = _permute(value, n_head, n_kv)
            out[f"blk.{i}.{names[stem]}.{kind}"] = value
    for i, (fc1, fc2) in enumerate(predictors):
        out[f"blk.{i}.fc1.weight"], out[f"blk.{i}.fc2.weight"] = fc1, fc2
    for name, value in out.items():
        if ".ffn_down." in name:  # postprocess_transpose
            name, value = name.replace("ffn_down", "ffn_down_t"), value.T
        w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    return _finish(w, path)


def convert_falcon(path, hf_state, hf_config, predictors, tokenizer_meta, *, threshold=None):
    """A Falcon-40B-style (new_decoder_architecture) FalconForCausalLM state_dict."""
    import gguf

    c = hf_config
    n_head, n_kv, hidden = c["num_attention_heads"], c["num_kv_heads"], c["hidden_size"]
    head_dim = hidden // n_head
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_name("Falcon")
    w.add_context_length(2048)
    w.add_tensor_data_layout("jploski")
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_eps(c["layer_norm_epsilon"])
    w.add_file_type(0)
    if threshold is not None:
        w.add_float32("powerinfer.sparse_threshold", threshold)
    _tokenizer(w, tokenizer_meta)
    names = {"self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",
             "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
             "ln_mlp": "attn_norm", "ln_attn": "attn_norm_2"}
    for i, (fc1, fc2) in enumerate(predictors):  # get_tensors yields the predictors first
        w.add_tensor(f"blk.{i}.fc1.weight", np.ascontiguousarray(fc1, np.float32))
        w.add_tensor(f"blk.{i}.fc2.weight", np.ascontiguousarray(fc2, np.float32))
    for name, value in hf_state.items():
        if "query_key_value" in name:  # the converter's QKV transform
            qkv = value.reshape(n_kv, n_head // n_kv + 2, head_dim, hidden)
            q = qkv[:, :-2].reshape(n_head * head_dim, hidden)
            k = qkv[:, [-2]].reshape(n_kv * head_dim, hidden)
            v = qkv[:, [-1]].reshape(n_kv * head_dim, hidden)
            value = np.concatenate([q, k, v]).reshape(value.shape)
        if name == "transformer.word_embeddings.weight":
            new = "token_embd.weight"
        elif name.startswith("transformer.ln_f."):
            new = "output_norm." + name.rsplit(".", 1)[1]
        elif name == "lm_head.weight":
            new = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            stem, kind = rest.rsplit(".", 1)
            new = f"blk.{i}.{names[stem]}.{kind}"
        if "ffn_down" in new:
            new, value = new.replace("ffn_down", "ffn_down_t"), value.T
        w.add_tensor(new, np.ascontiguousarray(value, np.float32))
    return _finish(w, path)
