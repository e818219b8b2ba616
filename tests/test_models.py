"""Our Transformer's logits against HF transformers' on tiny random models it builds and saves itself."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers_models import VOCAB, save_hf_llama, save_hf_opt, tiny_llama_config, write_tiny_gguf
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.models.transformer import from_params, init_cache, param_names

TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 11))


def hf_logits(model_dir, tokens, **kw):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return m(torch.tensor(tokens)).logits.float().numpy()


def our_logits(path, tokens, dtype=jnp.float32):
    ckpt = load_checkpoint(path)
    model = from_params(ckpt.config, ckpt.params, dtype=dtype)
    return np.asarray(model(jnp.asarray(tokens))), model


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    dict(hidden_act="silu", tied=False, n_kv_heads=2),
    dict(hidden_act="relu", tied=False, n_kv_heads=1),
    dict(hidden_act="silu", tied=True, n_kv_heads=4),
    dict(hidden_act="relu", tied=True, n_kv_heads=2, model_type="mistral"),
], ids=["silu-gqa-untied", "relu-mqa-untied", "silu-mha-tied", "mistral-relu-tied"])
def test_llama_family_logits_match_hf(tmp_path, variant):
    save_hf_llama(tmp_path, **variant)
    ours, _ = our_logits(tmp_path, TOKENS)
    assert_close(ours, hf_logits(tmp_path, TOKENS), "hf_logits")


def test_opt_logits_match_hf(tmp_path):
    save_hf_opt(tmp_path)
    ours, _ = our_logits(tmp_path, TOKENS)
    assert_close(ours, hf_logits(tmp_path, TOKENS), "hf_logits")


@pytest.mark.slow
def test_opt_cached_decode_matches_full_forward(tmp_path):
    """Learned positions with OPT's offset must index the same rows with and without a cache."""
    save_hf_opt(tmp_path)
    full, model = our_logits(tmp_path, TOKENS[:1])
    cache = init_cache(model.config, batch=1, max_len=32, dtype=jnp.float32)
    h, cache = model.hidden(jnp.asarray(TOKENS[:1, :6]), jnp.arange(6)[None], cache, 0)
    steps = [model.logits(h)]
    for t in range(6, TOKENS.shape[1]):
        h, cache = model.hidden(jnp.asarray(TOKENS[:1, t:t + 1]), jnp.full((1, 1), t), cache, t)
        steps.append(model.logits(h))
    assert_close(np.concatenate([np.asarray(s) for s in steps], 1), full, "regrouped")


@pytest.mark.parametrize("tensor_types", [None, "mixed"])
def test_gguf_logits_match_hf_gguf_loader(tmp_path, tensor_types):
    """A tiny GGUF (incl. Q8_0/Q4_0/Q4_1 tensors) read by us and by HF's own GGUF loader."""
    types = None
    if tensor_types == "mixed":
        types = {"layers.0.ffn.up.weight": "Q4_1", "layers.0.attn.q.weight": "Q8_0",
                 "layers.1.ffn.gate.weight": "Q4_0", "layers.1.attn.k.weight": "Q4_1",
                 "layers.1.ffn.down_t.weight": "Q8_0"}
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tensor_types=types)
    ours, _ = our_logits(path, TOKENS)
    theirs = hf_logits(tmp_path, TOKENS, gguf_file=path.name)
    assert_close(ours, theirs, "other_path")


def test_bfloat16_weights_stay_close_to_float32(tmp_path):
    save_hf_llama(tmp_path)
    f32, _ = our_logits(tmp_path, TOKENS)
    bf16, model = our_logits(tmp_path, TOKENS, dtype=jnp.bfloat16)
    assert model.layers[0].attn.q.weight[...].dtype == jnp.bfloat16
    assert np.mean(np.argmax(f32, -1) == np.argmax(bf16, -1)) > 0.9
    assert_close(bf16, f32, "bf16_weights")


@pytest.mark.parametrize("changes", [
    {}, {"tie_embeddings": True},
    {"arch": "opt", "gated": False, "bias": True, "norm": "layer", "positions": "learned",
     "position_offset": 2, "activation": "relu"},
    {"arch": "falcon", "gated": False, "norm": "layer", "parallel_block": True,
     "activation": "gelu", "tie_embeddings": True}])
def test_param_names_are_the_loaders_expected_shapes(changes):
    """from_params finds each Param by its canonical name (checkpoint.base.expected_shapes) instead
    of walking the module graph: the two lists must be the same, shapes included."""
    from flax import nnx

    from powerinfer_jax.checkpoint.base import expected_shapes
    from powerinfer_jax.models.layers import shapes_only
    from powerinfer_jax.models.transformer import Transformer, _param_name

    config = tiny_llama_config(**changes)
    with shapes_only():
        model = Transformer(config)
    got = {_param_name(p): tuple(v.get_value().shape)
           for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert got == expected_shapes(config)


def test_from_params_names_missing_and_misshaped_tensors(tmp_path):
    save_hf_llama(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    params = dict(ckpt.params)
    assert set(params) == set(param_names(ckpt.config))
    del params["layers.1.ffn.up.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.ffn.up.weight'\]"):
        from_params(ckpt.config, params)
    params = dict(ckpt.params)
    params["final_norm.scale"] = params["final_norm.scale"][:-1]
    with pytest.raises(ValueError, match=r"tensor final_norm.scale: expected shape \(64,\)"):
        from_params(ckpt.config, params)


@pytest.mark.parametrize("kind,d", [("rms", 576), ("layer", 100)])
def test_norm_gives_a_row_the_same_bits_whatever_the_batch(kind, d):
    """XLA's reduce vectorizes by shape (jnp.mean over 16 rows of 576 gave other last bits than
    each row alone); the norms sum in a fixed order, so batched decoding matches single."""
    from powerinfer_jax.models.layers import Norm

    norm = Norm(d, kind=kind, eps=1e-5)
    f = jax.jit(lambda v: norm(v))
    x = np.random.default_rng(0).standard_normal((16, 1, d)).astype(np.float32)
    together = np.asarray(f(x))
    alone = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(16)])
    np.testing.assert_array_equal(together, alone)
    mean = x.astype(np.float64).mean(-1, keepdims=True)
    ref = (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
           if kind == "rms" else (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True)
                                                      + 1e-5))
    assert_close(together, ref, "norms")


def test_shapes_only_builds_what_eval_shape_builds():
    """from_params builds its placeholder model directly under `shapes_only` instead of tracing
    the constructors with nnx.eval_shape: the same parameters, shapes and dtypes, nothing
    materialised; outside the context modules get concrete arrays again."""
    from flax import nnx

    from helpers_models import tiny_llama_config
    from powerinfer_jax.models.layers import Norm, shapes_only
    from powerinfer_jax.models.transformer import Transformer

    cfg = tiny_llama_config()
    with shapes_only():
        direct = Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    traced = nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.bfloat16))

    def leaves(m):
        return [(p, v.get_value().shape, v.get_value().dtype)
                for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))]

    assert leaves(direct) == leaves(traced)
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct)
               for _, v in nnx.to_flat_state(nnx.state(direct, nnx.Param)))
    norm = Norm(5, kind="layer", eps=1e-5)
    np.testing.assert_array_equal(np.asarray(norm.scale[...]), np.ones(5, np.float32))
    np.testing.assert_array_equal(np.asarray(norm.bias[...]), np.zeros(5, np.float32))

