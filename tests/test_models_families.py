"""The sparse model families against implementations nobody here wrote: HF transformers on tiny
random models this test builds (Falcon in every attention/norm layout, ReGLU llama, dReLU llama
with transformers' own Llama whose MLP is patched to relu(gate) * relu(up)), HF's GGUF loader
on a Falcon GGUF we write, and GGUF round trips of every family."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers_models import VOCAB, _save, gpt2_tokenizer_meta, save_hf_llama  # noqa: E402
from helpers_tolerances import TOL, assert_close  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.checkpoint.gguf import load_gguf, write_gguf  # noqa: E402
from powerinfer_jax.models.transformer import from_params, init_cache  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 11))


def _randomize(model, seed=0):
    """HF's init gives near-zero logits; larger weights make the comparison mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith(("ln_attn.weight", "ln_mlp.weight",
                                                          "layernorm.weight", "ln_f.weight",
                                                          "norm.weight")) else 0.3 * noise)
    return model


def _hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _ours(path, tokens=TOKENS):
    ck = load_checkpoint(path)
    model = from_params(ck.config, ck.params)
    return np.asarray(model(jnp.asarray(tokens))), ck, model


def save_hf_falcon(d, seed=0, **kw):
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                ffn_hidden_size=96, activation="relu", max_position_embeddings=128,
                bos_token_id=1, eos_token_id=2, rope_theta=5000.0)
    base.update(kw)
    model = _randomize(FalconForCausalLM(FalconConfig(**base)).eval(), seed)
    _save(model, d, None)
    return model


FALCONS = {
    "40b-grouped-2norms": dict(new_decoder_architecture=True, num_kv_heads=2),
    "40b-1norm": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "7b-mqa-parallel": dict(multi_query=True),
    "mha-interleaved": dict(multi_query=False),
    "sequential-bias-untied": dict(multi_query=True, parallel_attn=False, bias=True,
                                   tie_word_embeddings=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("kw", FALCONS.values(), ids=FALCONS.keys())
def test_falcon_logits_match_hf(tmp_path, kw):
    hf = save_hf_falcon(tmp_path, **kw)
    ours, ck, _ = _ours(tmp_path)
    c = ck.config
    assert (c.arch, c.norm, c.gated, c.activation) == ("falcon", "layer", False, "relu")
    assert c.parallel_block == kw.get("parallel_attn", True)
    assert c.n_kv_heads == (1 if kw.get("multi_query") and not kw.get("new_decoder_architecture")
                            else kw.get("num_kv_heads", 4))
    ref = _hf_logits(hf)
    assert np.abs(ref).max() > 1.0  # randomized weights: logits far from zero
    assert_close(ours, ref, "family_logits")


def test_falcon_gelu_is_the_tanh_form_within_its_error(tmp_path):
    hf = save_hf_falcon(tmp_path, new_decoder_architecture=True, num_kv_heads=2,
                        activation="gelu")
    with pytest.warns(UserWarning, match="exact erf GELU"):
        ours, ck, _ = _ours(tmp_path)
    assert ck.config.activation == "gelu"
    ref = _hf_logits(hf)
    assert_close(ours, ref, "gelu_tanh")
    for layer in hf.transformer.h:  # the same model with HF's tanh GELU: our formula exactly
        layer.mlp.act = torch.nn.GELU(approximate="tanh")
    assert_close(ours, _hf_logits(hf), "family_logits")


@pytest.mark.slow
def test_falcon_cached_decode_matches_full_forward(tmp_path):
    save_hf_falcon(tmp_path, new_decoder_architecture=True, num_kv_heads=2)
    full, _, model = _ours(tmp_path, TOKENS[:1])
    cache = init_cache(model.config, batch=1, max_len=32, dtype=jnp.float32)
    h, cache = model.hidden(jnp.asarray(TOKENS[:1, :5]), jnp.arange(5)[None], cache, 0)
    steps = [model.logits(h)]
    for t in range(5, TOKENS.shape[1]):
        h, cache = model.hidden(jnp.asarray(TOKENS[:1, t:t + 1]), jnp.full((1, 1), t), cache, t)
        steps.append(model.logits(h))
    assert_close(np.concatenate([np.asarray(s) for s in steps], 1), full, "other_path")


def test_falcon_rejections(tmp_path):
    save_hf_falcon(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for changes, pattern in ((dict(alibi=True), "alibi: expected false"),
                             (dict(activation="silu"), "activation: expected one of"),
                             (dict(new_decoder_architecture=True, parallel_attn=False),
                              "parallel_attn: expected true")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
        with pytest.raises(ValueError, match=pattern):
            load_checkpoint(tmp_path)


def _patch_drelu(model):
    """transformers' Llama with its MLP computing dReLU: down(relu(gate x) * relu(up x))."""
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: m.down_proj(torch.relu(m.gate_proj(x))
                                                       * torch.relu(m.up_proj(x))))(mlp)
    return model


def test_drelu_bamboo_matches_patched_hf_llama(tmp_path):
    from transformers import LlamaForCausalLM

    save_hf_llama(tmp_path, hidden_act="relu", n_kv_heads=2)
    hf = _patch_drelu(LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval())
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0 if p.ndim == 2 else 1.0)  # HF's init is tiny; scale up (norms stay 1)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "bamboo"}))
    ours, ck, _ = _ours(tmp_path)
    assert ck.config.activation == "drelu"
    ref = _hf_logits(hf)
    assert_close(ours, ref, "family_logits")
    # and it is not ReGLU: the same weights with relu(gate) * up differ
    relu, _, _ = _ours_with(ck, activation="relu")
    assert np.abs(relu - ref).max() > 100 * TOL["family_logits"].atol


def _ours_with(ck, **changes):
    model = from_params(ck.config.replace(**changes), ck.params)
    return np.asarray(model(jnp.asarray(TOKENS))), ck, model


# ------------------------------------------------------------------------ GGUF round trips
def _random_params(config, seed=0):
    from helpers_models import random_params

    return random_params(config, seed)


def _config(kind):
    from helpers_models import tiny_llama_config

    base = tiny_llama_config(d_ff=96)
    if kind == "reglu":
        return base.replace(activation="relu")
    if kind == "drelu":
        return base.replace(activation="drelu")
    if kind == "falcon":
        return base.replace(arch="falcon", gated=False, norm="layer", activation="relu",
                            parallel_block=True, n_kv_heads=1, tie_embeddings=True)
    if kind == "falcon-bias":
        return _config("falcon").replace(bias=True, n_kv_heads=2, tie_embeddings=False,
                                         activation="gelu")
    return base.replace(arch="opt", gated=False, bias=True, norm="layer", positions="learned",
                        position_offset=2, activation="relu", tie_embeddings=True)


@pytest.mark.parametrize("kind", ["reglu", "drelu", "falcon", "falcon-bias", "opt"])
@pytest.mark.parametrize("powerinfer", [False, True], ids=["gguf", "pwri"])
def test_gguf_round_trip(tmp_path, kind, powerinfer):
    """ours -> GGUF (llama.cpp or PowerInfer layout) -> ours: the same config and tensors."""
    config = _config(kind)
    params = _random_params(config)
    if kind == "falcon":  # one shared norm (Falcon-7B): written once, read into both
        for i in range(config.n_layers):
            for k in ("scale", "bias"):
                params[f"layers.{i}.ffn_norm.{k}"] = params[f"layers.{i}.attn_norm.{k}"]
    path = write_gguf(tmp_path / "m.gguf", config, params, gpt2_tokenizer_meta(),
                      powerinfer=powerinfer)
    ck = load_gguf(path)
    assert ck.config.norm_eps == pytest.approx(config.norm_eps)  # stored as float32
    assert ck.config.replace(norm_eps=config.norm_eps) == config
    for name, value in params.items():
        np.testing.assert_array_equal(ck.params[name], value, err_msg=name)


def test_gguf_activation_rule(tmp_path):
    """Our key wins; without it a PWRI llama is ReGLU, a plain llama SiLU, a bamboo dReLU."""
    import gguf

    config = _config("reglu")
    params = _random_params(config)
    for powerinfer, key, want in ((False, True, "relu"), (True, False, "relu"),
                                  (False, False, "silu")):
        path = tmp_path / f"{powerinfer}{key}.gguf"
        write_gguf(path, config, params, gpt2_tokenizer_meta(), powerinfer=powerinfer)
        if not key:
            _drop_key(path, "powerinfer_jax.ffn_activation")
        assert load_gguf(path).config.activation == want
    path = write_gguf(tmp_path / "b.gguf", _config("drelu"), params, gpt2_tokenizer_meta())
    _drop_key(path, "powerinfer_jax.ffn_activation")
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "bamboo"
    assert load_gguf(path).config.activation == "drelu"
    path = write_gguf(tmp_path / "bad.gguf", config, params, gpt2_tokenizer_meta(), arch="bamboo")
    with pytest.raises(ValueError, match=r"ffn_activation: expected one of \['drelu'\].*'relu'"):
        load_gguf(path)


def _drop_key(path, key):
    """Rewrite a GGUF without one metadata key (gguf's own reader and writer), keeping its magic."""
    import gguf

    from powerinfer_jax.checkpoint.gguf import file_magic

    magic = file_magic(path)
    with open(path, "r+b") as f:  # gguf's reader knows only the GGUF magic
        f.write(b"GGUF")
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    out = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(out), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in (key, "general.architecture"):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out.replace(path)
    with open(path, "r+b") as f:
        f.write(magic)


def test_falcon_gguf_matches_transformers_gguf_loader(tmp_path):
    """Our Falcon GGUF (Falcon-7B shape: multi-query, one norm) read by transformers' own GGUF
    loader (whose Falcon runs the exact GELU: swapped for ReLU after loading) and by us."""
    from transformers import AutoModelForCausalLM

    config = _config("falcon").replace(d_ff=256, max_seq_len=128, norm_eps=1e-5)
    params = _random_params(config)
    for i in range(config.n_layers):
        for k in ("scale", "bias"):
            params[f"layers.{i}.ffn_norm.{k}"] = params[f"layers.{i}.attn_norm.{k}"]
    path = write_gguf(tmp_path / "falcon.gguf", config, params, gpt2_tokenizer_meta())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                              torch_dtype=torch.float32).eval()
    for layer in hf.transformer.h:
        layer.mlp.act = torch.nn.ReLU()
    ours, _, _ = _ours(path)
    assert_close(ours, _hf_logits(hf), "other_path")
