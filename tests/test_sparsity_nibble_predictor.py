"""The nibble predictor (`--predictor q4`): its 4-bit nibble rows (exact on llama.cpp Q4_1
data), the q4_scores custom call vs its jnp twin and vs an independent numpy estimate,
determinism, recall vs the exact |a_i|, predictor mode end to end against a numpy FFN, placement
permutation, calibration, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_models import ffn_run, q4_selector, tiny_llama_config
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint.quants import dequantize
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.ops import _ffi
from powerinfer_jax.ops import nibble_rows
from powerinfer_jax.sparsity import artifacts as A
from powerinfer_jax.sparsity import profile as P
from powerinfer_jax.sparsity import nibble_predictor as npred


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _random_q4_1_rows(rng, rows, dim):
    """Rows of weights as llama.cpp stores them in Q4_1 (GGUF blocks: f16 d, f16 m, 16 bytes of
    nibbles), dequantized by the project's GGUF loader. Every block uses nibbles 0 and 15."""
    n_blocks = rows * dim // 32
    d = (rng.uniform(0.001, 0.01, n_blocks)).astype(np.float16)
    m = (-rng.uniform(0.0, 0.05, n_blocks)).astype(np.float16)
    nib = rng.integers(0, 16, (n_blocks, 32)).astype(np.uint8)
    nib[:, 0], nib[:, 1] = 0, 15
    packed = nib[:, :16] | (nib[:, 16:] << 4)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2),
                          packed], axis=1)
    return dequantize(raw.reshape(-1), "Q4_1").reshape(rows, dim)


def test_q4_1_checkpoint_rows_are_reproduced_exactly():
    w = _random_q4_1_rows(np.random.default_rng(0), 6, 192)
    q, dm = nibble_rows.quantize(w)
    assert q.shape == (6, 3 * 32) and q.dtype == np.uint8 and dm.shape == (6, 12)
    np.testing.assert_array_equal(np.asarray(nibble_rows.dequantize(q, dm, 192)), w)


@pytest.mark.slow
@pytest.mark.parametrize("dim", [32, 64, 100, 576])
def test_round_trip_error_is_within_half_a_step(dim):
    w = np.random.default_rng(1).standard_normal((5, dim)).astype(np.float32)
    q, dm = nibble_rows.quantize(w)
    back = np.asarray(nibble_rows.dequantize(q, dm, dim))
    p = nibble_rows.num_pairs(dim)
    step = np.repeat(dm[:, :2 * p].astype(np.float32), 32, axis=1)[:, :dim]
    # half a step, plus the fp16 rounding of the stored minimum
    assert np.all(np.abs(back - w) <= 0.5 * step + 1e-3 * np.abs(w).max())


def _numpy_scores(x, w_gate, w_up, b_up=None, *, signed=False):
    """An independent estimate: Q8 activations by hand (numpy), the dequantized 4-bit rows.
    |a| (the predictor's scores), or a itself with signed=True."""
    t, d = x.shape
    nb = -(-d // 32)
    xb = np.zeros((t, nb * 32), np.float32)
    xb[:, :d] = x
    xb = xb.reshape(t, nb, 32)
    s = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), 0).astype(np.float32)
    xq = (np.clip(np.rint(xb * inv), -127, 127) * s).reshape(t, -1)[:, :d]
    deq = lambda w: np.asarray(nibble_rows.dequantize(*nibble_rows.quantize(w), d), np.float64)
    up = xq @ deq(w_up).T + (0 if b_up is None else b_up)
    a = up if w_gate is None else _silu(xq @ deq(w_gate).T) * up
    return a if signed else np.abs(a)


def _operands(seed, *, t=3, d=100, f=37, gated=True, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    gate = (rng.standard_normal((f, d)) / np.sqrt(d)).astype(np.float32)
    up = (rng.standard_normal((f, d)) / np.sqrt(d)).astype(np.float32)
    b = (0.1 * rng.standard_normal(f)).astype(np.float32) if bias else None
    q, dm = nibble_rows.quantize(np.stack([gate, up], 1) if gated else up[:, None])
    return x, gate if gated else None, up, b, q, dm


@pytest.mark.slow
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("t,d,f", [(1, 576, 1536), (3, 100, 37), (5, 64, 8), (2, 33, 300)])
def test_kernel_matches_reference_and_numpy(gated, bias, t, d, f):
    x, gate, up, b, q, dm = _operands(0, t=t, d=d, f=f, gated=gated, bias=bias)
    act = "silu" if gated else "relu"
    got = np.asarray(jax.jit(lambda x: ops.q4_scores(x, q, dm, b, activation=act))(x))
    ref = np.asarray(ops.q4_scores(x, q, dm, b, activation=act, impl="reference"))
    assert got.shape == (t, f) and got.dtype == np.float32
    assert_close(got, ref, "dot_products")
    if gated:  # the numpy twin knows only silu
        assert_close(got, _numpy_scores(x, gate, up, b), "dot_products")


def test_vmap_and_thread_count_do_not_change_scores():
    x, _, _, b, q, dm = _operands(1, t=4, d=576, f=3000)
    runs = []
    for n in (1, 2, 1):
        ops.set_num_threads(n)
        runs.append(np.asarray(ops.q4_scores(x, q, dm, b)))
    ops.set_num_threads(2)
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    batched = jax.vmap(lambda xi: ops.q4_scores(xi, q, dm, b))(x.reshape(2, 2, 576))
    np.testing.assert_array_equal(np.asarray(batched).reshape(4, 3000), runs[0])


def test_estimate_ranks_neurons_like_the_exact_contribution():
    """At 50% sparsity the estimate keeps >= 0.9 of the exact top-|a_i| set (random weights are
    the hard case: no Q4_1 grid to reproduce)."""
    x, gate, up, _, q, dm = _operands(2, t=64, d=576, f=1536, bias=False)
    exact = np.abs(_silu(x @ gate.T) * (x @ up.T))
    est = np.asarray(ops.q4_scores(x, q, dm))
    oracle = exact > np.quantile(exact, 0.5)
    chosen = est > np.quantile(est, 0.5)
    assert (oracle & chosen).sum() / oracle.sum() > 0.9


def _tiny_model(seed=0, **cfg):
    model = Transformer(tiny_llama_config(d_model=64, d_ff=96, **cfg), rngs=nnx.Rngs(seed))
    return model


def _ffn_with_q4(seed, layer):
    """An FFN of a tiny model with its q4 predictor, and its (gate, up, down_t) as float64."""
    model = _tiny_model(seed=seed)
    ffn = model.layers[layer].ffn
    return ffn, tuple(np.asarray(w[...], np.float64)
                      for w in (ffn.gate.weight, ffn.up.weight, ffn.down_t.weight))


@pytest.mark.slow
def test_predictor_mode_matches_a_numpy_ffn():
    """Predictor mode with the q4 predictor: y = sum over neurons whose numpy estimate clears the
    threshold of the exact a_i * down_i, computed here without the project's kernels."""
    ffn, (g, u, down_t) = _ffn_with_q4(0, 0)
    x = np.random.default_rng(3).standard_normal((1, 5, 64)).astype(np.float32)
    est = _numpy_scores(x[0], g, u)
    thr = float(np.quantile(est, 0.5))
    a = _silu(x[0] @ g.T) * (x[0] @ u.T)
    want = (a * (est > thr)) @ down_t
    sel = q4_selector(ffn, thr)
    for impl in ("ffi", "reference"):
        ffn.set_selector(sel, impl=impl)
        y, n_active = ffn_run(ffn, jnp.asarray(x))
        assert_close(np.asarray(y)[0], want, "other_path")
        np.testing.assert_array_equal(np.asarray(n_active)[0], (est > thr).sum(-1))


@pytest.mark.slow
def test_signed_estimates_match_numpy_and_the_magnitudes():
    x, gate, up, b, q, dm = _operands(10, t=3, d=576, f=300)
    got = np.asarray(ops.q4_scores(x, q, dm, b, signed=True))
    assert_close(got, _numpy_scores(x, gate, up, b, signed=True), "dot_products")
    assert_close(ops.q4_scores(x, q, dm, b, signed=True, impl="reference"), got, "dot_products")
    np.testing.assert_array_equal(np.abs(got), np.asarray(ops.q4_scores(x, q, dm, b)))
    assert (got < 0).any() and (got > 0).any()


@pytest.mark.parametrize("placed", [False, True])
def test_gate_up_q4_mode_matches_a_numpy_ffn(placed):
    """gate_up="q4": each active neuron contributes its numpy *estimate* a_i (4-bit rows, Q8
    activations) times its down row; inactive neurons nothing. Placed FFNs (hot rows with XLA,
    cold rows through the custom call) give the same output."""
    ffn, (g, u, down_t) = _ffn_with_q4(4, 1)
    x = np.random.default_rng(11).standard_normal((1, 5, 64)).astype(np.float32)
    est = _numpy_scores(x[0], g, u, signed=True)
    thr = float(np.quantile(np.abs(est), 0.6))
    want = (est * (np.abs(est) > thr)) @ down_t
    sel = q4_selector(ffn, thr, gate_up="q4")
    ffn.set_selector(sel)
    if placed:
        ffn.permute(np.random.default_rng(12).permutation(96))
        ffn.split(40)
    for impl in ("ffi", "reference"):
        ffn.set_selector(sel, impl=impl)
        y, n_active = ffn_run(ffn, jnp.asarray(x))
        assert_close(np.asarray(y)[0], want, "other_path")
        np.testing.assert_array_equal(np.asarray(n_active)[0], (np.abs(est) > thr).sum(-1))


def test_gate_up_q4_is_close_to_full_rows_on_a_q4_1_checkpoint():
    """When the weights are a Q4_1 checkpoint's (exact on the 4-bit grid), gate_up="q4" differs
    from reading the full gate/up rows only by the 8-bit activations: same active set at these
    thresholds, outputs within 2% of the output's scale."""
    model = _tiny_model(seed=5)
    rng = np.random.default_rng(13)
    ffn = model.layers[0].ffn
    for w in (ffn.gate.weight, ffn.up.weight):
        w.set_value(jnp.asarray(_random_q4_1_rows(rng, 96, 64), jnp.float32))
    x = jnp.asarray(rng.standard_normal((1, 7, 64)), jnp.float32)
    thr = float(np.quantile(np.asarray(npred.NibblePredictor.from_ffn(ffn)(x)), 0.5))
    ffn.set_selector(q4_selector(ffn, thr))
    full, n_full = ffn_run(ffn, x)
    ffn.set_selector(q4_selector(ffn, thr, gate_up="q4"))
    est, n_est = ffn_run(ffn, x)
    np.testing.assert_array_equal(np.asarray(n_est), np.asarray(n_full))
    assert_close(est, full, "q4_estimate")
    assert not np.array_equal(np.asarray(est), np.asarray(full))  # the estimate really is used


@pytest.mark.parametrize("kw", [dict(mode="dense"), dict(mode="oracle"),
                                dict(mode="predictor", predictor="lowrank")])
def test_gate_up_q4_needs_the_q4_predictor(kw):
    with pytest.raises(ValueError, match=r"gate_up: expected 'full' unless sparsity "
                                         r"is 'predictor' with predictor 'q4'"):
        SparsityConfig(gate_up="q4", **kw)
    with pytest.raises(ValueError, match=r"gate_up: expected one of"):
        SparsityConfig(mode="predictor", gate_up="int4")


def test_activations_criterion_needs_scores_and_rejects_bad_names():
    x, gate, up, b, q, dm = _operands(14, t=2, d=64, f=16)
    down = up.copy()
    with pytest.raises(ValueError, match=r"scores: expected an array \[\.\.\., T, F\] when "
                                         r"criterion='activations'"):
        ops.sparse_ffn(x, up, down, w_gate=gate, criterion="activations")
    a = np.ones((2, 16), np.float32)
    with pytest.raises(Exception, match=r"sparse_ffn: criterion: expected one of scores, oracle, "
                                        r"activations"):
        jax.block_until_ready(_ffi.sparse_ffn(x, up, down, w_gate=gate, b_up=None, b_down=None,
                                              scores=a, threshold=0.0, activation="silu",
                                              criterion="bogus")[0])
    with pytest.raises(Exception, match=r"sparse_ffn: scores shape"):
        jax.block_until_ready(_ffi.sparse_ffn(x, up, down, w_gate=gate, b_up=None, b_down=None,
                                              scores=a[:, :3], threshold=0.0, activation="silu",
                                              criterion="activations")[0])
    with pytest.raises(Exception, match=r"q4_scores: output: expected one of magnitude, signed"):
        jax.block_until_ready(jax.ffi.ffi_call(_ffi.Q4_SCORES_TARGET, jax.ShapeDtypeStruct(
            (2, 16), jnp.float32))(x, q, dm, b, activation="silu", output="sign"))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,d,f,bias", [(1, 576, 1536, False), (5, 100, 37, True),
                                        (3, 64, 300, True), (1, 100, 300, True)])
def test_fused_q4_ffn_matches_the_two_call_path_and_numpy(dtype, t, d, f, bias):
    """ops.q4_sparse_ffn (estimate + select + down rows in one call) against the estimate call
    followed by the sparse FFN's activations criterion, and against numpy."""
    x, gate, up, b, q, dm = _operands(15, t=t, d=d, f=f, bias=bias)
    rng = np.random.default_rng(16)
    down = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), dtype)
    b_down = jnp.asarray(rng.standard_normal(d), jnp.float32) if bias else None
    a = np.asarray(ops.q4_scores(x, q, dm, b, signed=True))
    thr = float(np.quantile(np.abs(a), 0.55))
    y, n = jax.jit(lambda x: ops.q4_sparse_ffn(x, q, dm, down, b, b_down, threshold=thr))(x)
    y2, n2 = ops.sparse_ffn(x, down, down, scores=a, b_down=b_down, threshold=thr,
                            criterion="activations")
    yr, nr = ops.q4_sparse_ffn(x, q, dm, down, b, b_down, threshold=thr, impl="reference")
    want = (a * (np.abs(a) > thr)) @ np.asarray(down, np.float64) + (
        0 if b_down is None else np.asarray(b_down))
    np.testing.assert_array_equal(np.asarray(n), (np.abs(a) > thr).sum(-1))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n2))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(nr))
    for got in (y2, yr):
        assert_close(y, got, "regrouped")
    assert_close(y, want, "other_path")


def test_fused_q4_ffn_is_deterministic_and_vmaps():
    x, _, _, b, q, dm = _operands(17, t=4, d=576, f=1536)
    down = jnp.asarray(np.random.default_rng(18).standard_normal((1536, 576)) / 40, jnp.bfloat16)
    runs = {}
    for n in (1, 2, 2, 1):
        ops.set_num_threads(n)
        y, _ = ops.q4_sparse_ffn(x, q, dm, down, b, threshold=0.01)
        runs.setdefault(n, []).append(np.asarray(y))
    ops.set_num_threads(2)
    for ys in runs.values():  # bitwise identical for a given thread count
        np.testing.assert_array_equal(ys[0], ys[1])
    assert_close(runs[1][0], runs[2][0], "dot_products")
    yv, nv = jax.vmap(lambda xi: ops.q4_sparse_ffn(xi, q, dm, down, b, threshold=0.01))(
        x.reshape(2, 2, 576))
    np.testing.assert_array_equal(np.asarray(yv).reshape(4, 576), runs[2][0])


def test_fused_q4_ffn_bad_input():
    x, _, _, b, q, dm = _operands(19, t=2, d=64, f=16)
    down = np.zeros((16, 64), np.float32)
    with pytest.raises(ValueError, match=r"w_down_t shape: expected \[F, D\] = \(16, 64\)"):
        ops.q4_sparse_ffn(x, q, dm, down[:, :32], b, threshold=0.1)
    with pytest.raises(ValueError, match=r"threshold: expected a finite float >= 0"):
        ops.q4_sparse_ffn(x, q, dm, down, b, threshold=-1.0)
    with pytest.raises(ValueError, match=r"b_down shape: expected \[64\]"):
        ops.q4_sparse_ffn(x, q, dm, down, b, np.zeros(3, np.float32), threshold=0.1)
    # The handler checks again when called without the Python layer.
    with pytest.raises(Exception, match=r"q4_sparse_ffn: down_t: expected "
                                        r"float32/bfloat16/float16 \[16, 64\]"):
        jax.block_until_ready(_ffi.q4_sparse_ffn(x, q, dm, down[:8], b, None, threshold=0.1,
                                                 activation="silu")[0])
    with pytest.raises(Exception, match=r"q4_sparse_ffn: threshold: expected a finite number"):
        jax.block_until_ready(_ffi.q4_sparse_ffn(x, q, dm, down, b, None, threshold=-1.0,
                                                 activation="silu")[0])
    with pytest.raises(Exception,
                       match=r"q4_sparse_ffn: b_down: expected float32 \[64\] or absent"):
        jax.block_until_ready(_ffi.q4_sparse_ffn(x, q, dm, down, b, np.zeros(3), threshold=0.1,
                                                 activation="silu")[0])
    with pytest.raises(Exception, match=r"q4_sparse_ffn: q: expected uint8"):
        jax.block_until_ready(_ffi.q4_sparse_ffn(x, q[:, :, :16], dm, down, b, None,
                                                 threshold=0.1, activation="silu")[0])


@pytest.mark.slow
def test_permuted_ffn_keeps_its_output():
    model = _tiny_model(seed=1)
    ffn = model.layers[1].ffn
    x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 3, 64)), jnp.float32)
    ffn.set_selector(q4_selector(ffn, 0.05))
    before = np.asarray(ffn(x))
    ffn.permute(np.random.default_rng(5).permutation(96))
    assert_close(ffn(x), before, "regrouped")


def test_calibrated_thresholds_hit_the_target_on_held_out_tokens():
    model = _tiny_model(seed=2)
    chunks = np.random.default_rng(6).integers(0, model.config.vocab_size, (8, 64))
    x = P.collect_ffn_inputs(model, chunks.astype(np.int32), progress=False)
    base = P.profile_activations(model, x, progress=False)
    for target in (0.3, 0.7):
        arts, _ = A.build_for_target(model, x, base, target, train=None, progress=False)
        rep = arts.meta["q4"]
        assert len(arts.thresholds_q4) == model.config.n_layers
        assert rep["mean_predicted_sparsity"] == pytest.approx(target, abs=0.02)
        assert rep["mean_recall"] > 0.9
        assert 0 < rep["cost"]["bytes_fraction"] < 0.25


def test_from_placed_ffn_is_an_error():
    model = _tiny_model()
    model.layers[0].ffn.split(48)
    with pytest.raises(ValueError, match="expected an unsplit FFN"):
        npred.NibblePredictor.from_ffn(model.layers[0].ffn)


@pytest.mark.parametrize("change,match", [
    (lambda q, dm: (q[:, :, :-1], dm), r"q: expected uint8 \[F, G in \(1, 2\), 64\] for D = 100"),
    (lambda q, dm: (q.astype(np.int8), dm), r"q: expected uint8"),
    (lambda q, dm: (q, dm[:5]), r"dm: expected float16 \[37, 2, 8\]"),
    (lambda q, dm: (q, dm.astype(np.float32)), r"dm: expected float16"),
])
def test_bad_input_is_a_clear_error(change, match):
    x, _, _, b, q, dm = _operands(7)
    q, dm = change(q, dm)
    with pytest.raises(ValueError, match=match):
        ops.q4_scores(x, q, dm, b)


def test_bad_bias_and_activation():
    x, _, _, b, q, dm = _operands(8)
    with pytest.raises(ValueError, match=r"b_up shape: expected \[F\] = \(37,\)"):
        ops.q4_scores(x, q, dm, b[:3])
    with pytest.raises(ValueError, match="activation"):
        ops.q4_scores(x, q, dm, b, activation="tanh")


def test_handler_validates_too():
    """The FFI layer called directly (no Python checks) fails cleanly, never crashes."""
    x, _, _, b, q, dm = _operands(9)
    with pytest.raises(Exception, match=r"q4_scores: q: expected uint8 \[F, G in \{1, 2\}, 64\]"):
        jax.block_until_ready(_ffi.q4_scores(x, q[:, :, :32], dm, b, activation="silu"))
    with pytest.raises(Exception, match=r"q4_scores: dm: expected float16 \[37, 2, 8\]"):
        jax.block_until_ready(_ffi.q4_scores(x, q, dm[:, :, :4], b, activation="silu"))
    with pytest.raises(Exception, match=r"q4_scores: b_up: expected float32 \[37\] or absent"):
        jax.block_until_ready(_ffi.q4_scores(x, q, dm, b[:2], activation="silu"))
    with pytest.raises(Exception, match=r"q4_scores: activation: expected one of silu"):
        jax.block_until_ready(_ffi.q4_scores(x, q, dm, b, activation="tanh"))
