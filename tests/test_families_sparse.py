"""Sparse modes on the families' tiny models (helpers_families.py; the same models
test_families.py checks against transformers): each FFN custom call against its pure-jnp
reference on the family's own layers (SwiGLU, GeGLU with the tanh GELU, fused Phi-3 weights
split at load) with the family's attention features around it (q/k norms, biases, soft-caps,
sliding windows), and the invariants: every neuron active == dense; a ReLU model's exact
sparsity (oracle at 0) == dense; placed hot/cold == unplaced; calibrated threshold and q4
predictor modes skip about the target share of neurons. `--sparsity auto` picks a mode on a
family model with its calibrated artifacts. Meshes: tests/test_mesh.py (family configs)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

import helpers_families as fam  # noqa: E402
from helpers_models import active_counts, with_mode  # noqa: E402
from helpers_tolerances import assert_close  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.config import SparsityConfig  # noqa: E402
from powerinfer_jax.models.transformer import from_params  # noqa: E402

pytestmark = pytest.mark.slow  # every family built by llama.cpp's converter: minutes

NAMES = list(fam.FAMILIES)
TARGET = 0.5


@pytest.fixture(scope="module")
def loaded(families_built):
    """Per family: (checkpoint, token chunks of wiki text for calibration, tokens to run)."""
    out = {}
    for name in NAMES:
        ck = load_checkpoint(families_built["dirs"][name])
        ids = ck.tokenizer.encode(fam.wiki_sample(6000), add_bos=False)
        n = len(ids) // 32
        out[name] = (ck, np.asarray(ids[:n * 32]).reshape(n, 32)[:8], np.asarray([ids[:24]]))
    return out


def _model(ck, **changes):
    return from_params(ck.config.replace(**changes) if changes else ck.config, ck.params)


def _run(model, toks):
    positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    h, n_active = active_counts(model, jnp.asarray(toks), positions)
    return np.asarray(model.logits(h)), None if n_active is None else np.asarray(n_active)


def _thresholds(model, chunks):
    """Per-layer thresholds for TARGET from the model's own profile (sparsity/thresholds.py), for
    the gate criterion (threshold mode) and the contribution |a| (oracle, q4 predictor)."""
    from powerinfer_jax.sparsity import profile as prof
    from powerinfer_jax.sparsity import thresholds

    x = prof.collect_ffn_inputs(model, chunks, progress=False)
    profile = prof.profile_activations(model, x, progress=False)
    return {c: thresholds.calibrate_thresholds(profile, TARGET, criterion=c)
            for c in thresholds.CRITERIA}


MODES = {"threshold": (SparsityConfig(mode="threshold", target_sparsity=TARGET), "gate"),
         "predictor_q4": (SparsityConfig(mode="predictor", target_sparsity=TARGET),
                          "contribution"),
         "predictor_q4gu": (SparsityConfig(mode="predictor", gate_up="q4",
                                           target_sparsity=TARGET), "contribution")}


@pytest.mark.parametrize("name", NAMES)
def test_sparse_modes_on_the_family(loaded, name):
    """Every neuron active (oracle at 0) == dense; then the calibrated threshold mode and the q4
    predictor (selecting rows, and supplying the activations) through the custom calls equal
    the jnp reference of the same mode and skip about the target share of neurons."""
    ck, chunks, toks = loaded[name]
    f = ck.config.d_ff
    dense, _ = _run(_model(ck), toks)
    got, n_active = _run(with_mode(_model(ck), SparsityConfig(mode="oracle", threshold=0.0)),
                         toks)
    # SwiGLU / GeGLU: about every neuron (tanh-GELU of a very negative gate rounds to 0)
    assert n_active.min() >= 0.95 * f
    assert_close(got, dense, "family_logits")
    thr = _thresholds(_model(ck), chunks)
    for mode, (cfg, criterion) in MODES.items():
        runs = {impl: _run(with_mode(_model(ck), dataclasses.replace(cfg, impl=impl),
                                     thresholds=thr[criterion]), toks)
                for impl in ("ffi", "reference")}
        (got, n_got), (want, n_want) = runs["ffi"], runs["reference"]
        _equal_but_borderline(got, want, n_got, n_want, mode)
        assert 0.2 < 1 - n_got.mean() / f < 0.8, mode


def _equal_but_borderline(got, want, n_got, n_want, mode):
    """The custom call's logits and selection equal the reference's, but for neurons whose
    estimate is the threshold within rounding: --gate-up q4's estimate is act(gate) * up, and the
    C++ SiLU/GELU (a polynomial e^x, simd.h) differs from XLA's by a few ulps, so such a neuron
    may flip. A flip at token t moves every later token and layer by about one neuron's
    contribution, which can flip another borderline neuron there (seen in CI: two at one layer
    and token; one neuron of one layer at one token of 24 x 8 layers; on gemma3, run after other
    tests in the same process, 18 of its 144 (layer, token) counts at its last two layers moved
    by 1-3 neurons, its logits within the bounds below). The exact selection on identical inputs
    is the op tests' (test_sparsity_q4.py, test_ops_qsparse_ffn.py); here a mode's wiring is
    wrong if a count moves by more than a few neurons (a wrong threshold, gate or row moves
    tens of the ~50% active), if more than a quarter of the counts move, or if the logits move
    by more than a neuron's contribution."""
    diff = np.abs(n_got.astype(int) - n_want)
    where = (mode, np.argwhere(diff).tolist(), diff[diff > 0].tolist())
    assert diff.max() <= 3, where
    assert np.count_nonzero(diff) <= max(2, n_got.size // 4), where
    # a flip may also be a swap (one neuron in, another out: the counts agree), so the logits
    # are held to one neuron's contribution everywhere and to a small mean difference
    assert_close(got, want, "one_neuron", err_msg=mode)
    # (2e-3 held until a fresh-clone CI run's gemma3, where 18 counts moved: 3.1e-3; a wrong
    # wiring moves the logits by tenths)
    assert np.abs(got - want).mean() < 5e-3, (mode, float(np.abs(got - want).mean()))


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_a_relu_family_model_is_exactly_sparse(loaded, name):
    """The same weights with a ReLU gate (a relufied model): oracle at 0 skips the zeros only."""
    ck, _, toks = loaded[name]
    dense, _ = _run(_model(ck, activation="relu"), toks)
    got, n_active = _run(with_mode(_model(ck, activation="relu"),
                                   SparsityConfig(mode="oracle", threshold=0.0)), toks)
    assert 0.2 < n_active.mean() / ck.config.d_ff < 0.8
    assert_close(got, dense, "family_logits")


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3"])
def test_placed_hot_cold_equals_unplaced(loaded, name):
    from powerinfer_jax.models.hybrid import apply_placement
    from powerinfer_jax.sparsity import placement as pl

    ck, _, toks = loaded[name]
    c = ck.config
    oracle = SparsityConfig(mode="oracle", threshold=0.05)
    want, n_want = _run(with_mode(_model(ck), oracle), toks)
    model = _model(ck)
    with_mode(model, oracle)
    sizes = pl.model_bytes(model, kv_len=64)
    freqs = [np.random.default_rng(i).random(c.d_ff) for i in range(c.n_layers)]
    placement = pl.place("hybrid", freqs, sizes, sizes.dense + int(0.4 * sizes.ffn))
    assert any(0 < h < c.d_ff for h in placement.hot)
    apply_placement(model, placement)
    got, n_got = _run(model, toks)
    assert_close(got, want, "family_logits")
    np.testing.assert_array_equal(n_got, n_want)


@pytest.mark.slow
def test_auto_picks_a_mode_on_a_family_model(families_built, tmp_path, capsys):
    """calibrate then --sparsity auto on Gemma-2 (GeGLU, soft-caps, windows): a session that
    generates, and a recorded choice with both candidates timed."""
    from powerinfer_jax import calibrate
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build

    d = families_built["dirs"]["gemma2"]
    text = tmp_path / "t.txt"
    text.write_text(fam.wiki_sample(8000))
    root = tmp_path / "arts"
    calibrate.main(["--model", str(d), "--corpus", str(text), "--ctx", "32",
                    "--target-sparsity", str(TARGET), "--out", str(root), "--no-progress",
                    "--json"])
    s = build(str(d), RuntimeConfig(), SparsityConfig(mode="auto"),
              artifacts_root=root, progress=False)
    info = s.describe()["auto"]
    assert info["chosen"] in ("dense", "predictor_q4gu"), info
    out = s.engine.generate(s.tokenizer.encode("The history of"), max_new_tokens=8)
    assert len(out.tokens) == 8


@pytest.mark.parametrize("name", NAMES)
def test_input_sparsity_at_target_zero_is_the_dense_model(families_built, loaded, name):
    """Input sparsity at target 0 (every threshold 0) is the dense model from the HF directory
    (floats: the masks pass every channel); calibrated at 0.4 it skips about that share of the
    blocks' bytes and moves the logits. From llama.cpp's Q4_0 GGUF every block matrix in the
    columns layout computes what the dense arrangement computes on the same inputs (each
    layer's site inputs of the dense model; whole models are not compared: an 8-bit activation
    on a rounding edge moves one step after float32 sums in another order, and gemma3 carries
    such a step to 0.6% of its logits)."""
    from powerinfer_jax.models.qweights import DENSE_LAYOUT, INPUTS_LAYOUT
    from powerinfer_jax.sparsity import input_sparsity as isp

    ck, chunks, toks = loaded[name]
    model = _model(ck)
    dense, _ = _run(model, toks)
    isp.install(model, isp.zero_thresholds(model))
    np.testing.assert_array_equal(_run(model, toks)[0], dense)
    arts = isp.calibrate(model, chunks.astype(np.int32), rule="magnitude", target=0.4,
                         sample_tokens=128, how="uniform")
    measured = isp.measure(model, arts, chunks[:2])
    assert arts.model_sparsity(measured) == pytest.approx(0.4, abs=0.1)
    assert np.abs(_run(model, toks)[0] - dense).max() > 1e-2
    if not families_built["q"]:
        pytest.skip(families_built["why_q"])
    q = load_checkpoint(families_built["q"][name], keep_quantized=True)
    rows = from_params(q.config, q.params, kernels="ffi", ffn_layout=DENSE_LAYOUT)
    q = load_checkpoint(families_built["q"][name], keep_quantized=True)
    cols = from_params(q.config, q.params, kernels="ffi", ffn_layout=INPUTS_LAYOUT)
    from powerinfer_jax.models.layers import InputSample
    from powerinfer_jax.models.transformer import capture

    isp.install(rows, isp.zero_thresholds(rows))  # every site's input sown
    positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    _, sown = capture(lambda m: m.hidden(jnp.asarray(toks), positions), rows, kind=InputSample)
    from powerinfer_jax.checkpoint import quants

    for i, (lr, lc) in enumerate(zip(rows.layers, cols.layers)):
        want, got = isp.site_matrices(lr), isp.site_matrices(lc)
        for site in isp.SITES:
            x = jnp.asarray(sown[site][i])
            for mr, mc in zip(want[site], got[site]):
                # columns wherever the format and the row count allow (this family's odd
                # sizes: some matrices have no multiple of 64 rows and are read whole)
                rows_n = mc.weight[...].shape[0]
                assert mc.qweight.kernel_qtype.endswith(quants.COLUMNS_SUFFIX) == \
                    quants.can_columns(mc.qtype, rows_n, isp._dims(lc)[site]), (i, site)
                assert_close(mc(x), mr(x), "quantized_layouts", err_msg=f"{i} {site}")
