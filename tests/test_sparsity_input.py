"""Input sparsity (sparsity/input_sparsity.py) on tiny quantized SwiGLU models whose matrices take
the columns layout: at target 0 the model is the dense one; with masks the columns kernels equal
the file's rows on the same masked inputs; calibration reaches its target; the thresholds file is
tied to its model and a bad one is refused or rebuilt; batches equal single sequences."""
import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import (assert_batch_decodes_as_single, gpt2_tokenizer_meta, random_params,
                            small_input_calibration, tiny_llama_config, write_tiny_gguf)
from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.qweights import COLUMNS, DENSE_LAYOUT, INPUTS_LAYOUT
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.sparsity import input_sparsity as isp

TOKENS = np.asarray([[5, 17, 99, 3, 250, 42, 7, 11, 60, 61, 62, 63]])
CONFIG = dict(d_model=128, n_heads=2, n_kv_heads=2, head_dim=64, d_ff=192)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "tiny.Q4_0.gguf"
    cfg = tiny_llama_config(**CONFIG)
    types = {f"layers.{i}.{n}": "Q4_0" for i in range(cfg.n_layers) for n in (
        "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "ffn.gate.weight",
        "ffn.up.weight", "ffn.down_t.weight")}
    write_tiny_gguf(path, cfg, types)
    return path


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """Q4_K with Q6_K attn_v and ffn_down (a Q4_K_M file's mix); D = 256, F = 512."""
    from powerinfer_jax.checkpoint.base import QuantTensor
    from powerinfer_jax.checkpoint.gguf import write_gguf

    cfg = tiny_llama_config(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512)
    params = random_params(cfg, 0)
    rng = np.random.default_rng(1)
    types = {}
    for i in range(cfg.n_layers):
        for n in ("attn.q.weight", "attn.k.weight", "attn.o.weight", "ffn.gate.weight",
                  "ffn.up.weight"):
            types[f"layers.{i}.{n}"] = "Q4_K"
        params[f"layers.{i}.attn.v.weight"] = QuantTensor(
            random_blocks("Q6_K", cfg.kv_dim, cfg.d_model, rng), "Q6_K", (cfg.kv_dim, cfg.d_model))
        params[f"layers.{i}.ffn.down_t.weight"] = QuantTensor(
            random_blocks("Q6_K", cfg.d_model, cfg.d_ff, rng), "Q6_K", (cfg.d_ff, cfg.d_model),
            transposed=True)
    path = tmp_path_factory.mktemp("ink") / "tiny.Q4_K_M.gguf"
    write_gguf(path, cfg, params, gpt2_tokenizer_meta(), types)
    return path


def _model(path, layout):
    q = load_checkpoint(path, keep_quantized=True)
    return from_params(q.config, q.params, kernels="ffi", ffn_layout=layout)


def _chunks(n=6, t=32, seed=0):
    return np.random.default_rng(seed).integers(3, 250, size=(n, t)).astype(np.int32)


@pytest.mark.parametrize("which", ["q4_gguf", pytest.param("kquant_gguf", marks=pytest.mark.slow)])
def test_every_matrix_takes_columns_and_target_zero_is_the_dense_model(which, request):
    path = request.getfixturevalue(which)
    dense, cols = _model(path, DENSE_LAYOUT), _model(path, INPUTS_LAYOUT)
    layer = cols.layers[0]
    assert all(m.layout == COLUMNS for mats in isp.site_matrices(layer).values() for m in mats)
    isp.install(cols, isp.zero_thresholds(cols))
    assert_close(np.asarray(cols(TOKENS)), np.asarray(dense(TOKENS)), "other_path")


@pytest.mark.parametrize("which", ["q4_gguf", pytest.param("kquant_gguf", marks=pytest.mark.slow)])
def test_columns_kernels_equal_the_files_rows_on_the_same_masks(which, request):
    """Masks at 40%: the kernels that skip zeroed channels' bytes compute what the file's rows
    compute on the same zeroed inputs."""
    path = request.getfixturevalue(which)
    dense, cols = _model(path, DENSE_LAYOUT), _model(path, INPUTS_LAYOUT)
    arts = isp.calibrate(cols, _chunks(), rule="magnitude", target=0.4, how="uniform")
    isp.install(cols, arts)
    isp.install(dense, arts)
    got, want = np.asarray(cols(TOKENS)), np.asarray(dense(TOKENS))
    assert_close(got, want, "other_path")
    isp.install(dense, None)
    assert np.abs(got - np.asarray(dense(TOKENS))).max() > 1e-3  # the masks did something


def test_calibration_reaches_its_target(q4_gguf):
    model = _model(q4_gguf, INPUTS_LAYOUT)
    chunks = _chunks(4)
    inputs = isp.collect_inputs(model, chunks, sample_tokens=128)
    for how in ("uniform", "loss"):
        arts = isp.calibrate(model, chunks, rule="magnitude", target=0.4, inputs=inputs, how=how)
        assert arts.model_sparsity() >= 0.4 - 1e-9 and arts.model_sparsity() < 0.5
        measured = arts.model_sparsity(isp.measure(model, arts, chunks))
        assert abs(measured - arts.model_sparsity()) < 0.06, (how, measured)
    weighted = isp.calibrate(model, chunks, rule="weighted", target=0.4, inputs=inputs,
                             how="uniform")
    norms = np.sqrt(sum(isp.column_sq_norms(m, 128) for m in
                        isp.site_matrices(model.layers[0])["attn_in"]))
    t = weighted.thresholds[0]["attn_in"]
    np.testing.assert_allclose(t * norms, (t * norms)[0], rtol=1e-5)  # tau / ||W[:, j]||


def test_thresholds_file_is_tied_to_its_model(q4_gguf, tmp_path):
    model = _model(q4_gguf, INPUTS_LAYOUT)
    arts = isp.calibrate(model, _chunks(), rule="magnitude", target=0.25, how="uniform")
    path = isp.artifact_path(tmp_path, "magnitude", 0.25)
    fp = {"id": "files:abc", "shape": {}}
    isp.save(path, arts, fp)
    back = isp.load(path, fp, model)
    for a, b in zip(arts.thresholds, back.thresholds):
        for s in isp.SITES:
            np.testing.assert_array_equal(a[s], b[s])
    with pytest.raises(UserError, match="another model"):
        isp.load(path, {"id": "files:other", "shape": {}}, model)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="readable thresholds file"):
        isp.load(path, fp, model)


def test_a_lossy_mode_needs_a_target_in_range(q4_gguf):
    with pytest.raises(UserError, match="target-sparsity"):
        pij.load(str(q4_gguf), sparsity="input_magnitude", progress=False)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="target_sparsity"):
            pij.SparsityConfig(mode="input_magnitude", target_sparsity=bad)
    with pytest.raises(ValueError, match="target_sparsity"):
        pij.SparsityConfig(mode="threshold", target_sparsity=0.0)  # 0 only for input sparsity


@pytest.mark.slow
def test_batched_decode_equals_single_and_a_corrupt_file_is_rebuilt(q4_gguf, monkeypatch):
    small_input_calibration(monkeypatch)  # the runtime's own, on the calibration text
    llm = pij.load(str(q4_gguf), sparsity="input_magnitude", target_sparsity=0.4, max_batch=3,
                   max_seq_len=64, progress=False)
    prompts, alone = assert_batch_decodes_as_single(llm)
    path = next(q4_gguf.parent.glob("*.sparsity/input_sparsity/magnitude_0.400.npz"))
    path.write_bytes(b"not an npz")
    again = pij.load(str(q4_gguf), sparsity="input_magnitude", target_sparsity=0.4,
                     max_seq_len=64, progress=False)
    assert [again.session.engine.generate(p, max_new_tokens=6).tokens for p in prompts] == alone
