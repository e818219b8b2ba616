"""Hybrid placement on the CPU: hot rows through XLA, cold rows through the FFI pool, summed.

Invariants: the hot-first permutation leaves outputs unchanged; a placed model equals the unplaced
one (dense and oracle logits, greedy tokens) for budgets putting 0%, 30% and 100% of FFN bytes hot.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_tolerances import assert_close
from powerinfer_jax.config import ModelConfig, SparsityConfig
from powerinfer_jax.models.hybrid import apply_placement, permute_model
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.runtime.decode import Engine
from powerinfer_jax.sparsity import placement as pl
from powerinfer_jax.sparsity.predictor import Predictor
from helpers_models import active_counts, with_mode

CFG = ModelConfig(arch="llama", vocab_size=53, d_model=12, n_layers=3, n_heads=2, n_kv_heads=1,
                  head_dim=6, d_ff=37, max_seq_len=32, activation="relu")
OPT = CFG.replace(arch="opt", gated=False, bias=True, norm="layer", positions="learned",
                  position_offset=2)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 53, size=(2, 7)))
ORACLE = SparsityConfig(mode="oracle", threshold=0.0)


def model_and_placement(cfg, frac, mode="hybrid", seed=0):
    m = Transformer(cfg, rngs=nnx.Rngs(seed), kernels="ffi")
    s = pl.model_bytes(m, kv_len=cfg.max_seq_len)
    freqs = [np.random.default_rng(seed + l).random(cfg.d_ff) for l in range(cfg.n_layers)]
    budget = s.dense + int(frac * s.ffn)
    return m, pl.place(mode, freqs, s, budget)


@pytest.mark.slow
def test_permutation_leaves_dense_output_unchanged():
    m, p = model_and_placement(CFG, 0.3)
    ref = np.asarray(m(TOKENS))
    permute_model(m, p)
    assert not all(o == tuple(range(37)) for o in p.order)
    assert_close(m(TOKENS), ref, "regrouped")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, OPT], ids=["relu-gated", "opt-bias"])
@pytest.mark.parametrize("frac", [0.0, 0.3, 1.0])
def test_hybrid_equals_unplaced(cfg, frac):
    m, p = model_and_placement(cfg, frac)
    want = {mode: np.asarray(with_mode(m, s)(TOKENS)) for mode, s in
            (("dense", SparsityConfig()), ("oracle", ORACLE))}
    apply_placement(m, p)
    expect_hot = {0.0: 0, 1.0: 3 * 37}.get(frac)
    if expect_hot is not None:
        assert sum(p.hot) == expect_hot
    else:
        assert 0 < sum(p.hot) < 3 * 37
    for layer, h in zip(m.layers, p.hot):
        ffn = layer.ffn
        assert ffn.n_hot == h and ffn.cold["up"][...].shape[0] == 37 - h
    assert_close(with_mode(m, SparsityConfig())(TOKENS), want["dense"], "regrouped")
    assert_close(with_mode(m, ORACLE)(TOKENS), want["oracle"], "regrouped")


@pytest.mark.slow
def test_hybrid_greedy_tokens_equal_unplaced():
    m, p = model_and_placement(CFG, 0.3)
    prompt = [3, 17, 5, 42, 8]
    want = Engine(with_mode(m, ORACLE), max_seq_len=32).generate(prompt, max_new_tokens=8).tokens
    apply_placement(m, p)
    eng = Engine(m, max_seq_len=32)
    assert eng.generate(prompt, max_new_tokens=8).tokens == want
    eng.generate(prompt[1:] + [9, 11], max_new_tokens=8)  # 6 tokens: the same prefill bucket
    assert eng.compile_count == 2  # no recompilation per token with a placement


@pytest.mark.slow
def test_layers_mode_equals_unplaced():
    m, p = model_and_placement(CFG, 0.5, mode="layers")
    want = np.asarray(with_mode(m, ORACLE)(TOKENS))
    apply_placement(m, p)
    assert set(p.hot) <= {0, 37} and p.hot[0] >= p.hot[-1]
    assert_close(m(TOKENS), want, "regrouped")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["threshold", "predictor"])
def test_scores_modes_permute_with_the_neurons(mode):
    m, p = model_and_placement(CFG.replace(activation="silu"), 0.3)
    preds = None
    if mode == "predictor":
        preds = [Predictor(12, 5, 37, rngs=nnx.Rngs(10 + i)) for i in range(len(m.layers))]
    sp = SparsityConfig(mode=mode, threshold=0.1)
    with_mode(m, sp, thresholds=(0.1,) * len(m.layers), predictors=preds)
    want = np.asarray(m(TOKENS))
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    _, n_want = active_counts(m, TOKENS, positions)
    apply_placement(m, p)
    assert_close(m(TOKENS), want, "regrouped")
    _, n_got = active_counts(m, TOKENS, positions)
    np.testing.assert_array_equal(np.asarray(n_got), np.asarray(n_want))


def test_placement_for_another_model_is_rejected():
    _, p = model_and_placement(CFG, 0.3)
    other = Transformer(CFG.replace(d_ff=41), rngs=nnx.Rngs(0), kernels="ffi")
    with pytest.raises(ValueError, match="another model"):
        apply_placement(other, p)


def test_split_store_choices_are_checked():
    from powerinfer_jax.ops import _ffi

    m, _ = model_and_placement(CFG, 0.3)
    ffn = m.layers[0].ffn
    with pytest.raises(ValueError, match="store: expected 'auto', 'operands' or 'cuda'"):
        ffn.split(5, store="disk")
    if _ffi._pij_cuda is None:  # the CPU-only build has no host store for the GPU hybrid
        with pytest.raises(RuntimeError, match="PIJ_CUDA=ON build"):
            ffn.split(5, store="cuda")
    assert not ffn.placed  # a rejected split leaves the FFN whole
    ffn.split(5, store="auto")  # CPU backend: operands
    assert ffn.cold is not None and ffn.cold_handle is None and ffn.n_hot == 5
    assert ffn.n_cold == 37 - 5
