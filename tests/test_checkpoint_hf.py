"""HF directory loading: every tensor of tiny random transformers models, and config rejections."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers_models import save_hf_llama, save_hf_opt  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.checkpoint.hf import load_hf  # noqa: E402

_LLAMA = {"input_layernorm.weight": "attn_norm.scale",
          "post_attention_layernorm.weight": "ffn_norm.scale",
          "self_attn.q_proj.weight": "attn.q.weight", "self_attn.k_proj.weight": "attn.k.weight",
          "self_attn.v_proj.weight": "attn.v.weight", "self_attn.o_proj.weight": "attn.o.weight",
          "mlp.gate_proj.weight": "ffn.gate.weight", "mlp.up_proj.weight": "ffn.up.weight",
          "mlp.down_proj.weight": "ffn.down_t.weight"}
_OPT = {"self_attn_layer_norm.weight": "attn_norm.scale", "self_attn_layer_norm.bias": "attn_norm.bias",
        "final_layer_norm.weight": "ffn_norm.scale", "final_layer_norm.bias": "ffn_norm.bias",
        "fc1.weight": "ffn.up.weight", "fc1.bias": "ffn.up.bias",
        "fc2.weight": "ffn.down_t.weight", "fc2.bias": "ffn.down.bias",
        **{f"self_attn.{h}_proj.{k}": f"attn.{o}.{k}" for h, o in
           (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o")) for k in ("weight", "bias")}}
_GLOBAL = {"model.embed_tokens.weight": "tok_embed", "model.norm.weight": "final_norm.scale",
           "lm_head.weight": "lm_head", "model.decoder.embed_tokens.weight": "tok_embed",
           "model.decoder.embed_positions.weight": "pos_embed",
           "model.decoder.final_layer_norm.weight": "final_norm.scale",
           "model.decoder.final_layer_norm.bias": "final_norm.bias"}


def _check_all_tensors(state, ck, table, prefix):
    tied = ck.config.tie_embeddings
    seen = set()
    for hf_name, value in state.items():
        if hf_name in _GLOBAL:
            name = _GLOBAL[hf_name]
            if name == "lm_head" and tied:
                np.testing.assert_array_equal(ck.params["tok_embed"], value)
                continue
        else:
            _, i, rest = hf_name.removeprefix(prefix).split(".", 2)  # "layers", i, rest
            name = f"layers.{i}.{table[rest]}"
        ours = ck.params[name].T if name.endswith("down_t.weight") else ck.params[name]
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, value, err_msg=hf_name)
        seen.add(name)
    assert seen == set(ck.params)


@pytest.mark.parametrize("kw", [
    dict(hidden_act="silu", tied=False, n_kv_heads=2),
    dict(hidden_act="relu", tied=True, n_kv_heads=4),
    dict(hidden_act="silu", tied=False, n_kv_heads=1, max_shard_size="40KB"),
    dict(hidden_act="silu", tied=True, n_kv_heads=2, model_type="mistral"),
    dict(hidden_act="silu", tied=False, n_kv_heads=2, dtype="bfloat16"),
], ids=["silu-gqa-untied", "relu-mha-tied", "mqa-sharded", "mistral-tied", "bf16"])
def test_llama_family(tmp_path, kw):
    state = save_hf_llama(tmp_path, **kw)
    if "max_shard_size" in kw:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = load_checkpoint(tmp_path)
    c = ck.config
    assert (c.arch, c.norm, c.gated, c.bias, c.positions) == ("llama", "rms", True, False, "rope")
    assert (c.activation, c.tie_embeddings, c.n_kv_heads) == (kw["hidden_act"], kw["tied"], kw["n_kv_heads"])
    assert (c.head_dim, c.d_ff, c.max_seq_len, c.rope_theta) == (16, 96, 128, 5000.0)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert ck.tokenizer.bos_id is not None and ck.source == str(tmp_path)
    _check_all_tensors(state, ck, _LLAMA, "model.")


@pytest.mark.parametrize("kw", [dict(), dict(tie_word_embeddings=False, max_shard_size="40KB")],
                         ids=["tied", "untied-sharded"])
def test_opt(tmp_path, kw):
    state = save_hf_opt(tmp_path, **kw)
    ck = load_hf(tmp_path)
    c = ck.config
    assert (c.arch, c.norm, c.gated, c.bias, c.positions, c.position_offset, c.activation) == \
        ("opt", "layer", False, True, "learned", 2, "relu")
    assert ck.params["pos_embed"].shape == (128 + 2, 64)
    assert c.tie_embeddings == kw.get("tie_word_embeddings", True)
    _check_all_tensors(state, ck, _OPT, "model.decoder.")


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, pattern", [
    (dict(activation_function="gelu"), r"activation_function: expected 'relu', got 'gelu'"),
    (dict(do_layer_norm_before=False), r"do_layer_norm_before: expected True, got False.*post-LayerNorm"),
    (dict(word_embed_proj_dim=32), r"word_embed_proj_dim: expected 64, got 32"),
])
def test_opt_rejections(tmp_path, changes, pattern):
    save_hf_opt(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=pattern):
        load_hf(tmp_path)


def test_llama_rejections(tmp_path):
    save_hf_llama(tmp_path)
    _edit_config(tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act: expected one of \['silu', 'relu', "
                       r"'drelu', 'gelu_pytorch_tanh', 'gelu_new'\], got 'gelu' \(the exact erf"):
        load_hf(tmp_path)
    _edit_config(tmp_path, hidden_act="silu", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"architecture: expected one of .*llama.*opt.*got 'GPT2LMHeadModel"):
        load_hf(tmp_path)


def test_missing_pieces(tmp_path):
    save_hf_llama(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="expected a tokenizer.json, got none"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="expected model.safetensors"):
        load_hf(tmp_path)


def test_truncated_safetensors(tmp_path):
    save_hf_llama(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors.*truncated"):
        load_hf(tmp_path)
