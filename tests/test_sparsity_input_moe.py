"""Input sparsity (sparsity/input_sparsity.py) inside MoE layers, on a tiny SYNTHETIC OLMoE-shaped
Q4_0 file whose experts take the columns layout: at target 0 each MoE layer is the dense one;
with calibrated masks the columns experts compute what the file's rows compute on the same masked
inputs, and the masks change the output (layers compared on the same input: two models whose
attention reads other layouts differ by float32 rounding, which an int8 activation on a
rounding edge carries on); calibration reaches its target for both rules, the
experts' down inputs measured by the kernel's own counts; the thresholds file keeps the experts'
[E, F] thresholds and refuses another shape; placed experts are refused in one line; the runtime's
mode decodes batches as single sequences."""
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import assert_batch_decodes_as_single, small_input_calibration
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.qweights import DENSE_LAYOUT, INPUTS_LAYOUT
from powerinfer_jax.models.transformer import capture, from_params
from powerinfer_jax.sparsity import input_sparsity as isp

pytestmark = pytest.mark.slow  # a synthetic MoE file and three calibrations (~25 s); the
# columns experts' kernel is in the fast tier (test_ops_moe_ffn.py)

# 16 experts of 128 neurons (a multiple of 64: every expert matrix takes the columns layout)
TINY = ["--d-model", "128", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
        "--head-dim", "32", "--d-ff", "128", "--n-experts", "16", "--top-k", "4"]
TOKENS = np.asarray([[5, 17, 99, 3, 250, 42, 7, 11, 60, 61, 62, 63, 900, 1200, 77, 8]])


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from powerinfer_jax.synthetic.moe import main

    d = tmp_path_factory.mktemp("moe_in")
    main([*TINY, "--calib-tokens", "1024", "--verify-tokens", "0", "--seed", "5", "--out", str(d)])
    return Path(json.loads((d / "synthetic.json").read_text())["file"])


def _model(path, layout):
    q = load_checkpoint(path, keep_quantized=True)
    return from_params(q.config, q.params, kernels="ffi", ffn_layout=layout)


def _chunks(n=6, t=32, seed=1):
    return np.random.default_rng(seed).integers(3, 5000, size=(n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def models(moe_gguf):
    return _model(moe_gguf, DENSE_LAYOUT), _model(moe_gguf, INPUTS_LAYOUT)


def _ffn_outputs(model, ffn_in):
    """Each layer's MoE output on the same inputs ffn_in [L, B, T, D]."""
    return [np.asarray(layer.ffn(jnp.asarray(x))) for layer, x in zip(model.layers, ffn_in)]


def _dense_ffn_inputs(dense):
    positions = jnp.arange(TOKENS.shape[1])[None]
    _, sown = capture(lambda m: m.hidden(jnp.asarray(TOKENS), positions), dense)
    return np.asarray(sown["ffn_in"])


def test_experts_take_columns_and_target_zero_is_the_dense_model(models):
    dense, cols = models
    x = cols.layers[0].ffn.experts
    assert [m.kernel_qtype for m in (x.gate, x.up, x.down_t)] == ["Q4_0c64"] * 3
    assert dense.layers[0].ffn.experts.gate.kernel_qtype == "Q4_0x16"
    ffn_in = _dense_ffn_inputs(dense)
    isp.install(cols, isp.zero_thresholds(cols))
    try:
        for got, want in zip(_ffn_outputs(cols, ffn_in), _ffn_outputs(dense, ffn_in)):
            assert_close(got, want, "quantized_layouts")
    finally:
        isp.install(cols, None)


@pytest.mark.parametrize("rule", isp.RULES)
def test_calibrated_masks_columns_equal_rows_and_reach_the_target(models, rule):
    dense, cols = models
    ffn_in = _dense_ffn_inputs(dense)
    unmasked = _ffn_outputs(dense, ffn_in)
    arts = isp.calibrate(cols, _chunks(), rule=rule, target=0.4, sample_tokens=128)
    assert arts.thresholds[0]["ffn_mid"].shape == (16, 128)  # a threshold per expert and neuron
    assert arts.model_sparsity() == pytest.approx(0.4, abs=0.05)
    measured = isp.measure(cols, arts, _chunks(2, seed=9))  # installed on cols from here on
    assert arts.model_sparsity(measured) == pytest.approx(0.4, abs=0.08)
    for layer in measured:  # the experts' down inputs, counted by the custom call
        assert 0.1 < layer["ffn_mid"] < 0.9 and 0.1 < layer["ffn_in"] < 0.9
    assert isp.bytes_per_token(cols, measured) < isp.bytes_per_token(cols, None)
    isp.install(dense, arts)  # the same masks on the experts' interleaved file rows
    try:
        got, want = _ffn_outputs(cols, ffn_in), _ffn_outputs(dense, ffn_in)
    finally:
        isp.install(dense, None)
        isp.install(cols, None)
    for g, w, u in zip(got, want, unmasked):
        # the two layouts sum g and u in other orders: a down input on its threshold's edge may
        # fall on the other side (one neuron of one expert); every other token row agrees
        assert_close(g, w, "one_neuron")
        rows = np.abs(g - w).max(axis=-1) <= 1e-4 * np.abs(w).max()
        assert rows.mean() >= 0.9, rows
        assert np.abs(g - u).max() > 1e-2 * np.abs(u).max()  # the masks took effect


def test_thresholds_file_keeps_the_experts_shape(models, tmp_path):
    _, cols = models
    arts = isp.calibrate(cols, _chunks(3), rule="magnitude", target=0.3, sample_tokens=64,
                         how="uniform")
    fp = {"id": "files:tiny-moe", "shape": {"n_layers": 2}}
    path = tmp_path / "t.npz"
    isp.save(path, arts, fp)
    back = isp.load(path, fp, cols)
    np.testing.assert_array_equal(back.thresholds[1]["ffn_mid"], arts.thresholds[1]["ffn_mid"])
    bad = isp.InputThresholds(arts.rule, arts.target, tuple(
        {**t, "ffn_mid": t["ffn_mid"][0]} for t in arts.thresholds), arts.sparsity,
        arts.site_bytes)  # one expert's thresholds where [E, F] belongs
    isp.save(path, bad, fp)
    with pytest.raises(UserError, match=r"layer 0 ffn_mid: float32 \[16, 128\] >= 0"):
        isp.load(path, fp, cols)


def test_placed_experts_are_refused_in_one_line(moe_gguf):
    model = _model(moe_gguf, INPUTS_LAYOUT)
    model.layers[0].ffn.split(4)
    with pytest.raises(UserError, match=r"input sparsity, layer 0: expected experts in memory"):
        isp.calibrate(model, _chunks(2), rule="magnitude", target=0.4, sample_tokens=64)


def test_the_mode_decodes_batches_as_single_sequences(moe_gguf, monkeypatch):
    small_input_calibration(monkeypatch)
    llm = pij.load(str(moe_gguf), sparsity="input_weighted", target_sparsity=0.4, max_batch=3,
                   max_seq_len=64, progress=False)
    assert_batch_decodes_as_single(llm)
