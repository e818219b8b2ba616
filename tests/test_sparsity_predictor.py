"""Predictors: planted mapping learned with high recall; oracle-fed predictor mode == oracle mode;
decision thresholds; cost; artifacts validation (stale, other model, shapes)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_models import active_counts, tiny_llama_config, with_mode
from helpers_tolerances import assert_close
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.ffn import activate
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.sparsity import artifacts as A
from powerinfer_jax.sparsity import modes
from powerinfer_jax.sparsity import predictor as PR
from powerinfer_jax.sparsity import profile as P


def _planted(n, rng, u, v, c):
    x = rng.standard_normal((1, n, u.shape[0])).astype(np.float32)
    return x, (x[0] @ u @ v + c > 0)[None]


@pytest.mark.slow
def test_planted_mapping_recall():
    rng = np.random.default_rng(0)
    d, r, f = 24, 3, 41
    u, v = rng.standard_normal((d, r)), rng.standard_normal((r, f))
    c = rng.standard_normal(f)
    x, m = _planted(6000, rng, u, v, c)
    stack, rep = PR.train_predictors(x, m, PR.TrainConfig(rank=16, steps=600, batch_tokens=128,
                                                          target_recall=0.995), progress=False)
    xt, mt = _planted(4000, rng, u, v, c)  # fresh tokens
    q = PR.predictor_quality(stack, xt, mt)
    assert q["recall"][0] > 0.99
    base_rate = float(mt.mean())
    assert base_rate < 0.7 and q["precision"][0] > 0.85  # far above "everything active"
    assert rep["recall"][0] >= 0.995


def test_decision_thresholds_keep_target_recall():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 500, 7)).astype(np.float32)
    mask = rng.random((2, 500, 7)) < 0.4
    t = PR.decision_thresholds(logits, mask, 0.9)
    for l in range(2):
        recall = ((logits[l] > t[l]) & mask[l]).sum() / mask[l].sum()
        assert 0.9 <= recall < 0.9 + 2 / mask[l].sum()


class _OracleScores(nnx.Module):
    """A perfect predictor: logits |a| - t (copies of the FFN's own weights)."""

    def __init__(self, ffn, threshold):
        self.gate = nnx.Param(ffn.gate.weight[...])
        self.up = nnx.Param(ffn.up.weight[...])
        self.t = threshold
        self.activation = ffn.activation

    def __call__(self, x):
        g = jnp.einsum("...D,FD->...F", x, self.gate[...])
        u = jnp.einsum("...D,FD->...F", x, self.up[...])
        return jnp.abs(activate(self.activation, g) * u) - self.t


@pytest.mark.slow
def test_oracle_fed_predictor_equals_oracle():
    cfg = tiny_llama_config(d_model=48, head_dim=12, d_ff=37 * 3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    thr = (0.05, 0.02)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 32)))
    pos = jnp.broadcast_to(jnp.arange(32), tokens.shape)
    with_mode(model, SparsityConfig("oracle", impl="reference"), thresholds=thr)
    h_o, n_o = active_counts(model, tokens, pos)
    with_mode(model, SparsityConfig("predictor", impl="reference"), thresholds=(0.0, 0.0),
              predictors=[_OracleScores(layer.ffn, t) for layer, t in zip(model.layers, thr)])
    h_p, n_p = active_counts(model, tokens, pos)
    assert 0 < int(n_o.sum()) < n_o.size * cfg.d_ff
    diff = np.abs(np.asarray(n_p) - np.asarray(n_o))
    assert diff.max() <= 1 and diff.mean() < 0.05  # f32 ties at the threshold only
    assert_close(h_p, h_o, "predictor_ties")


def test_predictor_mode_without_predictor_is_an_error():
    model = Transformer(tiny_llama_config(), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="'predictor': expected its calibrated artifacts"):
        with_mode(model, SparsityConfig("predictor", impl="reference"))(tokens)


def test_cost_fraction():
    c = PR.predictor_cost(d_model=576, d_ff=1536, rank=128, gated=True)
    assert c["flops_fraction"] == pytest.approx((576 * 128 + 128 + 128 * 1536 + 1536)
                                                / (3 * 576 * 1536))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = tiny_llama_config(d_model=48, head_dim=12, d_ff=37 * 3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    chunks = np.random.default_rng(3).integers(0, cfg.vocab_size, (6, 64)).astype(np.int32)
    x = P.collect_ffn_inputs(model, chunks, progress=False)
    base = P.profile_activations(model, x, progress=False)
    arts, prof = A.build_for_target(model, x, base, 0.5, progress=False,
                                    train=PR.TrainConfig(rank=8, steps=30, batch_tokens=64))
    root = tmp_path_factory.mktemp("arts")
    fp = {"id": "files:abc", "shape": A.model_shape(cfg)}
    A.save_artifacts(A.target_dir(root, 0.5), arts, prof, fp)
    return model, root, fp


@pytest.mark.slow
def test_artifacts_round_trip(built):
    model, root, fp = built
    arts = A.load_artifacts(A.target_dir(root, 0.5), fingerprint=fp, need_predictor=True)
    assert len(arts.thresholds_for("threshold")) == 2
    assert arts.thresholds_for("predictor", "lowrank") == (0, 0)  # folded into the biases
    assert arts.thresholds_for("predictor") == arts.thresholds_q4 and min(arts.thresholds_q4) > 0
    with_mode(model, SparsityConfig("predictor", impl="reference"),
              thresholds=arts.thresholds_for("predictor", "lowrank"),
              predictors=[arts.predictors.layer(l) for l in range(2)])
    tokens = jnp.zeros((1, 8), jnp.int32)
    out = model(tokens)
    assert np.isfinite(np.asarray(out)).all()
    assert (A.target_dir(root, 0.5) / "frequency.png").is_file()


@pytest.mark.slow
def test_artifacts_stale_fingerprint(built):
    _, root, fp = built
    with pytest.raises(ValueError, match="expected model fingerprint files:other.*stale"):
        A.load_artifacts(A.target_dir(root, 0.5), fingerprint={**fp, "id": "files:other"},
                         need_predictor=False)


def test_artifacts_other_model_shape(built):
    _, root, fp = built
    other = {**fp, "shape": {**fp["shape"], "d_ff": 64}}
    with pytest.raises(ValueError, match="expected a model of shape.*another model"):
        A.load_artifacts(A.target_dir(root, 0.5), fingerprint=other, need_predictor=True)


def test_predictor_from_another_model(built):
    _, root, fp = built
    arts = A.load_artifacts(A.target_dir(root, 0.5), fingerprint=fp, need_predictor=True)
    other = Transformer(tiny_llama_config(d_ff=64), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"predictors: expected \(layers, D, F\) = \(2, 64, 64\)"):
        modes.configure(other, SparsityConfig("predictor", predictor="lowrank",
                                              target_sparsity=0.5), arts)


def test_artifacts_missing_and_format(built, tmp_path):
    _, root, fp = built
    with pytest.raises(UserError, match="meta.json, got no such file.*python -m powerinfer_jax.calibrate"):
        A.load_artifacts(tmp_path, fingerprint=fp, need_predictor=False)
    meta = json.loads((A.target_dir(root, 0.5) / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "format_version": 0}))
    with pytest.raises(ValueError, match=f"expected format_version {A.FORMAT_VERSION}, got 0"):
        A.load_artifacts(tmp_path, fingerprint=fp, need_predictor=False)


def test_model_fingerprint_changes_with_file(tmp_path):
    cfg = tiny_llama_config()
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 100)
    a = A.model_fingerprint(str(f), f, cfg)
    f.write_bytes(b"a" * 99 + b"b")
    assert A.model_fingerprint(str(f), f, cfg)["id"] != a["id"]
    assert A.artifacts_root(str(f), f) == tmp_path / "m.sparsity"


def test_train_rejects_too_few_tokens():
    x = np.zeros((1, 50, 4), np.float32)
    with pytest.raises(ValueError, match="predictor training tokens: expected at least"):
        PR.train_predictors(x, np.zeros((1, 50, 3), bool), PR.TrainConfig(batch_tokens=64),
                            progress=False)


@pytest.mark.slow
def test_evaluate_reports_predictor_recall():
    from powerinfer_jax.runtime.perplexity import perplexity

    cfg = tiny_llama_config(d_model=48, head_dim=12, d_ff=37 * 3)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    thr = (0.05, 0.02)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 96)
    oracle = perplexity(with_mode(model, SparsityConfig("oracle", impl="reference"),
                                  thresholds=thr), ids, ctx=32, max_chunks=None)
    predictor = SparsityConfig("predictor", impl="reference")
    with_mode(model, predictor, thresholds=(0.0, 0.0),
              predictors=[_OracleScores(layer.ffn, t) for layer, t in zip(model.layers, thr)])
    res = perplexity(model, ids, ctx=32, max_chunks=None, oracle_thresholds=thr)
    assert res["predictor_recall"] > 0.999
    assert res["ppl"] == pytest.approx(oracle["ppl"], rel=1e-3)
    assert res["ffn_sparsity"] == pytest.approx(oracle["ffn_sparsity"], abs=1e-3)
    with_mode(model, predictor, thresholds=(0.0, 0.0),  # selects nothing: recall 0
              predictors=[_OracleScores(layer.ffn, 1e9) for layer in model.layers])
    res = perplexity(model, ids, ctx=32, max_chunks=None, oracle_thresholds=thr)
    assert res["predictor_recall"] == 0.0 and res["ffn_sparsity"] == 1.0


@pytest.mark.parametrize("bad", [0.0, 1.0, 2.0])
def test_sparsity_config_target(bad):
    with pytest.raises(ValueError, match=r"target_sparsity: expected a float in \(0, 1\)"):
        SparsityConfig("threshold", target_sparsity=bad)
    assert modes.needs(SparsityConfig("threshold", target_sparsity=0.5)).thresholds
    assert not modes.needs(SparsityConfig("oracle")).thresholds


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_inference_layer_matches_the_training_stack(kernels):
    """PredictorStack.layer transposes to [out, in] for decode: same logits as the stack."""
    from flax import nnx as _nnx

    from powerinfer_jax.sparsity.predictor import PredictorStack

    stack = PredictorStack(3, 12, 5, 37, rngs=_nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 12)), jnp.float32)
    want = stack(x)
    for l in range(3):
        got = stack.layer(l, kernels=kernels)(x[l])
        assert_close(got, want[l], "regrouped")
