"""Calibration: target sparsity hit on held-out tokens; ReLU thresholds; bad targets."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_models import active_counts, tiny_llama_config, with_mode
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.sparsity import thresholds as C
from powerinfer_jax.sparsity import profile as P


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_llama_config(d_model=48, head_dim=12, d_ff=37 * 3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    calib = rng.integers(0, cfg.vocab_size, (8, 64)).astype(np.int32)
    held = rng.integers(0, cfg.vocab_size, (4, 64)).astype(np.int32)
    base = P.profile_activations(model, P.collect_ffn_inputs(model, calib, progress=False),
                                 progress=False)
    return model, base, held


def _measured_sparsity(model, tokens, mode, thresholds):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    with_mode(model, SparsityConfig(mode=mode, impl="reference"), thresholds=thresholds)
    _, n_active = active_counts(model, jnp.asarray(tokens), pos)
    return 1.0 - float(n_active.mean()) / model.config.d_ff


@pytest.mark.slow
@pytest.mark.parametrize("target", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("mode,criterion", [("oracle", "contribution"), ("threshold", "gate")])
def test_hits_target_on_held_out(tiny, target, mode, criterion):
    model, base, held = tiny
    thr = C.calibrate_thresholds(base, target, criterion=criterion)
    assert len(thr) == model.config.n_layers and all(t > 0 for t in thr)
    assert abs(_measured_sparsity(model, held, mode, thr) - target) < 0.02


def test_histogram_quantile_is_exact_on_planted_values():
    v = np.random.default_rng(0).lognormal(-2.0, 1.5, 100_000)
    idx = np.clip(np.floor((np.log10(v) - P.LOG10_RANGE[0]) / (P.LOG10_RANGE[1] - P.LOG10_RANGE[0])
                           * P.N_BINS), 0, P.N_BINS - 1).astype(int)
    hist = np.bincount(idx, minlength=P.N_BINS)
    for s in (0.1, 0.5, 0.9):
        t = C.threshold_from_histogram(hist, s)
        assert np.mean(v <= t) == pytest.approx(s, abs=0.002)


def test_relu_threshold_is_zero(tiny):
    _, base, _ = tiny
    import dataclasses

    relu = dataclasses.replace(base, activation="relu")
    assert C.calibrate_thresholds(relu, 0.5) == (0.0, 0.0)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.2, 1.5, float("nan"), "x"])
def test_bad_target_sparsity(tiny, bad):
    _, base, _ = tiny
    with pytest.raises(ValueError, match=r"target sparsity: expected a float in \(0, 1\)"):
        C.calibrate_thresholds(base, bad)


def test_bad_criterion(tiny):
    with pytest.raises(ValueError, match="criterion: expected one of"):
        C.calibrate_thresholds(tiny[1], 0.5, criterion="up")
