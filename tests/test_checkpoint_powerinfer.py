"""PowerInfer's formats: model GGUF with predictors ("PWRI"), activation statistics, GPU index;
its predictors running in our engine; and bad input (wrong model, missing files, stale index)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers_models import VOCAB, gpt2_tokenizer_meta, random_params, save_hf_llama, \
    tiny_llama_config  # noqa: E402
from helpers_powerinfer import convert_falcon, convert_llama  # noqa: E402
from helpers_tolerances import assert_close  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.checkpoint import powerinfer as pi  # noqa: E402
from powerinfer_jax.checkpoint.gguf import file_magic  # noqa: E402
from powerinfer_jax.errors import UserError  # noqa: E402
from powerinfer_jax.models.transformer import capture, from_params  # noqa: E402
from powerinfer_jax.sparsity import placement  # noqa: E402
from powerinfer_jax.sparsity import powerinfer_predictor as pip_  # noqa: E402

TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 11))


def _predictors(config, rank=8, seed=0):
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((rank, config["hidden_size"])) * 0.3).astype(np.float32),
             (rng.standard_normal((config.get("intermediate_size") or config["ffn_hidden_size"],
                                   rank)) * 0.3).astype(np.float32))
            for _ in range(config["num_hidden_layers"])]


def _hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _logits(model, tokens=TOKENS):
    """(logits, active counts [L, B, T] or None when dense) with the model's selectors."""
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, sown = capture(lambda m: m.logits(m.hidden(jnp.asarray(tokens), pos)[0]), model)
    return np.asarray(logits), sown.get("n_active")


@pytest.mark.slow
def test_reads_a_file_written_like_powerinfers_convert_py(tmp_path):
    """convert.py's layout (permuted Q/K, ffn_down_t, fc1/fc2, threshold, PWRI) of a ReLU llama:
    ReGLU by the PWRI rule, logits equal to transformers', predictors as written."""
    from transformers import LlamaForCausalLM

    save_hf_llama(tmp_path / "hf", hidden_act="relu", n_kv_heads=2)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0 if p.ndim == 2 else 1.0)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    preds = _predictors(cfg)
    path = convert_llama(tmp_path / "m.powerinfer.gguf", state, cfg, preds,
                         gpt2_tokenizer_meta(), threshold=0.25)
    assert file_magic(path) == b"PWRI"
    ck = load_checkpoint(path)
    assert ck.config.activation == "relu" and not ck.config.tie_embeddings
    model = from_params(ck.config, ck.params)
    assert_close(_logits(model)[0], _hf_logits(hf), "family_logits")
    got = pi.load_predictors(path, ck.config)
    assert got.threshold == 0.25
    for (fc1, fc2), a, b in zip(preds, got.fc1, got.fc2):
        np.testing.assert_array_equal(a, fc1)
        np.testing.assert_array_equal(b, fc2)


@pytest.mark.slow
def test_reads_a_falcon_file_written_like_powerinfers_hf_converter(tmp_path):
    from test_models_families import save_hf_falcon

    # the converter writes no rope.freq_base (llama.cpp then uses 10000, Falcon's default)
    hf = save_hf_falcon(tmp_path / "hf", new_decoder_architecture=True, num_kv_heads=2,
                        ffn_hidden_size=256, rope_theta=10000.0)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    path = convert_falcon(tmp_path / "f.powerinfer.gguf", state, cfg, _predictors(cfg),
                          gpt2_tokenizer_meta())
    ck = load_checkpoint(path)
    c = ck.config
    assert (c.arch, c.activation, c.n_kv_heads, c.parallel_block) == ("falcon", "relu", 2, True)
    model = from_params(c, ck.params)
    assert_close(_logits(model)[0], _hf_logits(hf), "family_logits")
    assert pi.load_predictors(path, c).threshold == 0.0


def _random_predictors(config, *, rank, seed, threshold):
    rng = np.random.default_rng(seed)
    return pi.PowerInferPredictors(
        tuple((rng.standard_normal((rank, config.d_model)) * 0.3).astype(np.float32)
              for _ in range(config.n_layers)),
        tuple((rng.standard_normal((config.d_ff, rank)) * 0.3).astype(np.float32)
              for _ in range(config.n_layers)), threshold)


def _tiny(kind="reglu"):
    from test_models_families import _config

    return _config(kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["reglu", "drelu", "falcon", "opt"])
def test_round_trip_keeps_logits_and_predictor_outputs(tmp_path, kind):
    """ours -> PowerInfer GGUF -> ours: same logits dense and in predictor mode (PowerInfer's
    predictors on the residual), same predictor outputs."""
    config = _tiny(kind)
    params = random_params(config)
    preds = _random_predictors(config, rank=8, seed=1, threshold=0.1)
    path = pi.write_powerinfer_gguf(tmp_path / "m.powerinfer.gguf", config, params,
                                    gpt2_tokenizer_meta(), preds, weight_type="F32")
    ck = load_checkpoint(path)
    a, b = from_params(config, params), from_params(ck.config, ck.params)
    np.testing.assert_array_equal(_logits(a)[0], _logits(b)[0])
    back = pi.load_predictors(path, ck.config)
    assert back.threshold == pytest.approx(0.1)
    pip_.attach(a, preds)
    pip_.attach(b, back)
    la, na = _logits(a)
    lb, nb = _logits(b)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(np.asarray(na), np.asarray(nb))
    assert 0 < float(np.asarray(na).mean()) < config.d_ff  # the predictors skip some neurons
    # the "powerinfer" sparsity mode: the same predictors, read from the file by the build
    import powerinfer_jax as pij

    built = pij.load(str(path), sparsity="powerinfer", progress=False).model
    lc, nc = _logits(built)
    assert_close(lc, lb, "regrouped")
    np.testing.assert_array_equal(np.asarray(nc), np.asarray(nb))


@pytest.mark.slow
def test_predictor_reads_the_residual_and_decides_like_powerinfer():
    """One block in predictor mode vs numpy: neuron i computed iff fc2(relu(fc1 r)) >= t, r the
    residual after attention (not the FFN input); a zero predictor computes every neuron."""
    config = _tiny("reglu")
    model = from_params(config, random_params(config))
    rng = np.random.default_rng(2)
    preds = pi.PowerInferPredictors(
        tuple((rng.standard_normal((8, config.d_model))).astype(np.float32)
              for _ in range(config.n_layers)),
        tuple((rng.standard_normal((config.d_ff, 8))).astype(np.float32)
              for _ in range(config.n_layers)), 0.5)
    pip_.attach(model, preds)
    block = model.layers[0]
    x = jnp.asarray(rng.standard_normal((1, 5, config.d_model)), jnp.float32)
    pos = jnp.arange(5)[None]
    out, _ = block(x, pos, None, None, None)
    r = np.asarray(block.attn(block.attn_norm(x), pos)[0] + x, np.float64)[0]
    ffn_in = block.ffn_norm(jnp.asarray(r, jnp.float32))[None]
    keep = np.maximum(r @ preds.fc1[0].T, 0) @ preds.fc2[0].T >= preds.threshold
    h = np.asarray(ffn_in, np.float64)[0]
    g, u, dn = (np.asarray(w, np.float64) for w in (block.ffn.gate.weight[...],
                                                    block.ffn.up.weight[...],
                                                    block.ffn.down_t.weight[...]))
    a = np.where(keep, np.maximum(h @ g.T, 0) * (h @ u.T), 0)
    assert_close(np.asarray(out)[0], r + a @ dn, "ffn_vs_float64")
    assert 0 < keep.mean() < 1
    # all-active predictors: predictor mode is the dense model
    for layer in model.layers:
        layer.ffn.set_selector(None)
    dense = _logits(model)[0]
    pip_.attach(model, pi.all_active_predictors(config))
    sparse, n = _logits(model)
    assert_close(sparse, dense, "sparse_vs_dense_logits")
    assert np.all(np.asarray(n) == config.d_ff)


@pytest.mark.slow  # ~6 s
def test_bias_free_predictors_export_with_the_same_decisions():
    """A bias-free predictor on the FFN input and its export on the residual (fc1 * ffn_norm
    scale) decide alike: RMSNorm is a positive per-token scale, the MLP positively homogeneous."""
    from flax import nnx

    config = _tiny("reglu")
    params = random_params(config)
    model = from_params(config, params)
    stack = pip_.BiasFreeStack(config.n_layers, config.d_model, 8, config.d_ff, rngs=nnx.Rngs(0))
    exported = pip_.to_powerinfer(stack, config, params)
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    _, sown = capture(lambda m: m.hidden(jnp.asarray(TOKENS), pos), model)
    ffn_in = sown["ffn_in"]  # [L, B, T, D]
    on_input = np.asarray(stack(ffn_in.reshape(config.n_layers, -1, config.d_model)))
    preds = [pip_.PowerInferPredictor(a, b) for a, b in zip(exported.fc1, exported.fc2)]
    for l in range(config.n_layers):
        x = ffn_in[l]
        s = np.asarray(preds[l].raw(_residual(model, l)))
        ours = on_input[l].reshape(s.shape)
        clear = np.abs(ours) > 1e-4  # ties at exactly 0 may round either way
        np.testing.assert_array_equal((s >= 0)[clear], (ours >= 0)[clear])
        assert np.all(np.sign(s[clear]) == np.sign(ours[clear])) and x.shape[-1] == config.d_model
    with pytest.raises(UserError, match="model norm: expected 'rms'"):
        pip_.to_powerinfer(stack, _tiny("opt"), random_params(_tiny("opt")))


@pytest.mark.slow
def test_low_rank_stack_exports_only_without_biases():
    from flax import nnx

    from powerinfer_jax.sparsity.predictor import PredictorStack

    config = _tiny("reglu")
    params = random_params(config)
    stack = PredictorStack(config.n_layers, config.d_model, 8, config.d_ff, rngs=nnx.Rngs(0))
    out = pip_.from_predictor_stack(stack, config, params)  # zero biases: exportable
    x = np.random.default_rng(0).standard_normal((5, config.d_model)).astype(np.float32)
    ours = np.asarray(stack(jnp.asarray(np.stack([x] * config.n_layers))))
    scale = params["layers.1.ffn_norm.scale"]
    theirs = np.maximum((x / scale) @ out.fc1[1].T, 0) @ out.fc2[1].T
    assert_close(theirs, ours[1], "other_path")
    stack.b_out_lf.set_value(stack.b_out_lf[...] - 0.5)  # a folded decision threshold
    with pytest.raises(UserError, match=r"biases: expected all zero.*max \|b\| = 0.5"):
        pip_.from_predictor_stack(stack, config, params)


def _residual(model, l):
    """The residual entering layer l's ffn_norm, for TOKENS."""
    x = model.tok_embed[...][jnp.asarray(TOKENS)]
    pos = jnp.broadcast_to(jnp.arange(TOKENS.shape[1]), TOKENS.shape)
    for i, layer in enumerate(model.layers):
        r = x + layer.attn(layer.attn_norm(x), pos)[0]
        if i == l:
            return r
        x = r + layer.ffn(layer.ffn_norm(r), residual=r)


def _powerinfer_llm(tmp_path):
    """(config, predictors, LLM in "powerinfer" mode) of a tiny ReGLU PowerInfer file."""
    import powerinfer_jax as pij

    config = _tiny("reglu")
    preds = _random_predictors(config, rank=8, seed=3, threshold=0.1)
    path = pi.write_powerinfer_gguf(tmp_path / "m.powerinfer.gguf", config,
                                    random_params(config), gpt2_tokenizer_meta(), preds,
                                    weight_type="F32")
    return config, preds, pij.load(str(path), sparsity="powerinfer", progress=False)


def test_predictor_mode_reads_the_residual_it_is_passed(tmp_path):
    """The block hands its residual to the FFN as an argument (no side channel): the API's
    active masks in predictor mode are PowerInfer's decisions on that residual, layer by layer,
    and an FFN called on its own, without one, is refused in one line."""
    config, preds, llm = _powerinfer_llm(tmp_path)
    masks = llm.active_masks(TOKENS[0].tolist())  # [L, T, F]
    for l in range(config.n_layers):
        r = np.asarray(_residual(llm.model, l), np.float64)[0]
        score = np.maximum(r @ preds.fc1[l].T, 0) @ preds.fc2[l].T
        clear = np.abs(score - preds.threshold) > 1e-4  # float32 vs float64 at the threshold
        assert clear.mean() > 0.95
        np.testing.assert_array_equal(masks[l][clear], (score >= preds.threshold)[clear])
        assert 0 < masks[l].mean() < 1
    ffn = llm.model.layers[0].ffn
    with pytest.raises(UserError, match=r"the PowerInfer predictor's input: expected the "
                                        r"block's residual.*got 'none'"):
        ffn(jnp.zeros((1, 2, config.d_model), jnp.float32))


@pytest.mark.slow  # a compiled perplexity scorer: ~4 s
def test_evaluates_predictor_recall_reads_the_residual(tmp_path):
    """evaluate's predictor recall (runtime/perplexity.py) takes each block's residual: it is
    PowerInfer's decisions on that residual (numpy) against the oracle set |a_i| > 0, per layer,
    averaged (fed the FFN input instead, it measured 0.446 against 0.504)."""
    from powerinfer_jax.runtime.perplexity import perplexity

    config, preds, llm = _powerinfer_llm(tmp_path)
    res = perplexity(llm.model, TOKENS[0].tolist(), ctx=TOKENS.shape[1], max_chunks=1,
                     oracle_thresholds=[0.0] * config.n_layers)
    want = []
    for l, layer in enumerate(llm.model.layers):
        r = _residual(llm.model, l)
        a = np.asarray(layer.ffn.activations(layer.ffn_norm(r)))[0]
        score = np.maximum(np.asarray(r, np.float64)[0] @ preds.fc1[l].T, 0) @ preds.fc2[l].T
        oracle = np.abs(a) > 0
        want.append((oracle & (score >= preds.threshold)).sum() / max(oracle.sum(), 1))
    assert 0 < np.mean(want) < 1
    assert res["predictor_recall"] == pytest.approx(float(np.mean(want)), abs=0.02)


def test_training_bias_free_predictors_learns_the_masks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2048, 16)).astype(np.float32)
    w = rng.standard_normal((2, 37, 16)).astype(np.float32)
    mask = np.einsum("lnd,lfd->lnf", x, w) > 0  # a rank-37 linear rule: learnable
    stack, report = pip_.train(x, mask, rank=32, steps=300, batch_tokens=256, positive_weight=1.0)
    # chance would be recall ~ predicted fraction and precision ~ 0.5 (half the pairs active)
    assert report["mean_recall"] > 0.8 and report["mean_precision"] > 0.8


# ------------------------------------------------------------------------------ bad input
def test_predictors_for_another_model_are_rejected(tmp_path):
    config = _tiny("reglu")
    preds = pi.all_active_predictors(config.replace(d_model=32))
    with pytest.raises(UserError, match=r"fc1.weight shape: expected \[R, D = 64\]"):
        pi.write_powerinfer_gguf(tmp_path / "x.gguf", config, random_params(config),
                                 gpt2_tokenizer_meta(), preds)
    path = pi.write_powerinfer_gguf(tmp_path / "m.gguf", config, random_params(config),
                                    gpt2_tokenizer_meta(), pi.all_active_predictors(config))
    with pytest.raises(UserError, match=r"m.gguf.*fc2.weight shape: expected \[F, R\] = \(50, 32\)"):
        pi.load_predictors(path, config.replace(d_ff=50))
    dense = tmp_path / "dense.gguf"
    from powerinfer_jax.checkpoint.gguf import write_gguf

    write_gguf(dense, config, random_params(config), gpt2_tokenizer_meta())
    with pytest.raises(UserError, match=r"dense.gguf.*'blk.0.fc1.weight'.*dense GGUF"):
        pi.load_predictors(dense, config)


def test_activation_statistics_numeric_order_and_errors(tmp_path, monkeypatch):
    """12 layers: sorted as text, activation_10.pt would come third (PowerInfer's bug #247)."""
    config = tiny_llama_config(n_layers=12, d_ff=20)
    freqs = [np.full(20, float(i)) for i in range(12)]
    pi.write_activation_profile(tmp_path / "activation", freqs)
    got = pi.load_activation_profile(tmp_path / "activation", config)
    assert [int(f[0]) for f in got] == list(range(12))
    with pytest.raises(UserError, match=r"expected a 1-D tensor of \(21,\)"):
        pi.load_activation_profile(tmp_path / "activation", config.replace(d_ff=21))
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real(name, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", no_torch)
        with pytest.raises(UserError, match=r"activation'.*expected the torch package"):
            pi.load_activation_profile(tmp_path / "activation", config)
    (tmp_path / "activation" / "activation_7.pt").unlink()
    with pytest.raises(UserError, match=r"activation_7.pt.*one per layer.*'missing'"):
        pi.load_activation_profile(tmp_path / "activation", config)
    with pytest.raises(UserError, match="an existing directory"):
        pi.load_activation_profile(tmp_path / "nowhere", config)


def _sizes(config):
    from powerinfer_jax.sparsity.placement import model_bytes

    return model_bytes(from_params(config, random_params(config)), kv_len=64)


def test_gpu_index_becomes_a_placement(tmp_path):
    config = _tiny("reglu")
    rng = np.random.default_rng(0)
    hot = [np.sort(rng.choice(config.d_ff, 30, replace=False)), np.arange(0)]
    sizes = _sizes(config)
    need = sizes.dense + 30 * sizes.neuron_bytes[0]
    path = pi.write_gpu_index(tmp_path / "m.gguf.generated.gpuidx", hot, config.d_ff, need)
    assert file_magic(path) == b"PWRI"
    index = pi.load_gpu_index(path, config)
    assert [h.tolist() for h in index.hot] == [h.tolist() for h in hot]
    p = placement.from_gpu_index(index, sizes, need)
    assert p.hot == (30, 0) and list(p.order[0][:30]) == hot[0].tolist()
    assert sorted(p.order[0]) == list(range(config.d_ff)) and p.device_bytes == need
    # applying it leaves the model's output unchanged (CPU-only hybrid)
    from powerinfer_jax.models.hybrid import apply_placement

    model = from_params(config, random_params(config))
    want = _logits(model)[0]
    apply_placement(model, p)
    assert_close(_logits(model)[0], want, "regrouped")


def test_stale_gpu_index_is_rejected(tmp_path):
    config = _tiny("reglu")
    sizes = _sizes(config)
    path = pi.write_gpu_index(tmp_path / "i.gpuidx", [np.arange(10)] * 2, config.d_ff, 10**6)
    with pytest.raises(UserError, match=r"i.gpuidx.*split.vram_capacity: expected <= the budget"):
        placement.from_gpu_index(pi.load_gpu_index(path, config), sizes, 10**5)
    with pytest.raises(UserError, match=r"i.gpuidx.*tensors: expected 2 per layer of the model \(6\)"):
        pi.load_gpu_index(path, config.replace(n_layers=3))
    with pytest.raises(UserError, match=r"gpu_idx: expected 50 values in \{0, 1\}"):
        pi.load_gpu_index(path, config.replace(d_ff=50))
    small = pi.write_gpu_index(tmp_path / "s.gpuidx", [np.arange(10)] * 2, config.d_ff, 1000)
    with pytest.raises(UserError, match=r"s.gpuidx': GPU neurons: expected fitting the budget"):
        placement.from_gpu_index(pi.load_gpu_index(small, config), sizes,
                                  sizes.dense + 5 * sizes.neuron_bytes[0])
    other = tmp_path / "plain.gguf"
    from powerinfer_jax.checkpoint.gguf import write_gguf

    write_gguf(other, config, random_params(config), gpt2_tokenizer_meta(), powerinfer=True)
    with pytest.raises(UserError, match=r"general.architecture: expected 'generic.gpu_index'"):
        pi.load_gpu_index(other, config)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["reglu", "drelu"])
def test_quantized_file_keeps_its_predictor_blocks(tmp_path, kind):
    """A Q4_0 PowerInfer GGUF (PowerInfer's `quantize` writes fc1/fc2 in the model's type): on its
    blocks, the predictors compute with ops.qlinear as PowerInfer's ggml does (8-bit activations),
    equal to the jnp reference of the same arithmetic; a float model gets them dequantized; the
    hot-first permutation moves whole block rows."""
    from powerinfer_jax.checkpoint.base import QuantTensor
    from powerinfer_jax.ops import reference

    config = _tiny(kind)
    params = random_params(config)
    preds = _random_predictors(config, rank=32, seed=2, threshold=0.0)  # rank: a Q4_0 block
    path = pi.write_powerinfer_gguf(tmp_path / "m.powerinfer.gguf", config, params,
                                    gpt2_tokenizer_meta(), preds, weight_type="Q4_0")
    kept = pi.load_predictors(path, config, keep_quantized=True)
    assert all(isinstance(t, QuantTensor) and t.qtype == "Q4_0" for t in kept.fc1 + kept.fc2)
    floats = pi.load_predictors(path, config)
    np.testing.assert_array_equal(kept.fc2[0].dequantize(), floats.fc2[0])
    with pytest.raises(UserError, match=r"fc2.weight shape: expected \[F, R\] = \(50, 32\)"):
        pi.load_predictors(path, config.replace(d_ff=50), keep_quantized=True)  # another model

    from powerinfer_jax.models.qweights import SELECTED_LAYOUT

    ck = load_checkpoint(path, keep_quantized=True)
    model = from_params(ck.config, ck.params, kernels="ffi",
                        ffn_layout=SELECTED_LAYOUT)  # loaded for predictor mode
    assert model.layers[0].ffn.quantized
    sels = pip_.selectors(model, kept)
    pred = sels[0].predictor
    assert pred.fc1.qtype == pred.fc2.qtype == "Q4_0"
    assert pred.fc1.weight[...].dtype == jnp.uint8
    xla_model = from_params(ck.config, ck.params, kernels="xla")  # float weights: float predictors
    r = _residual(xla_model, 0)
    d, rank = config.d_model, 32
    want = reference.qlinear(jax_relu(reference.qlinear(r, kept.fc1[0].blocks, "Q4_0", d)),
                             kept.fc2[0].blocks, "Q4_0", rank)
    got = np.asarray(pred.raw(r))
    assert_close(got, want, "powerinfer_predictor")
    perm = np.random.default_rng(3).permutation(config.d_ff)
    pred.permute(perm)
    np.testing.assert_array_equal(np.asarray(pred.raw(r)), got[..., perm])
    back = np.argsort(perm)  # permutes compose (the gather orders; the blocks never move)
    pred.permute(back)
    np.testing.assert_array_equal(np.asarray(pred.raw(r)), got)

    pred_f = pip_.selectors(xla_model, kept)[0].predictor
    assert pred_f.fc1.qtype is None
    np.testing.assert_array_equal(np.asarray(pred_f.fc1.weight[...]), floats.fc1[0])

    pip_.attach(model, kept)  # the whole model in predictor mode on the blocks runs and skips
    logits, n = _logits(model)
    assert np.all(np.isfinite(logits)) and 0 < float(np.asarray(n).mean()) < config.d_ff


def jax_relu(x):
    return jnp.maximum(x, 0.0)
