"""Sparse FFN custom call vs its pure-jnp reference, plus the invariants it must keep."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.ops import _ffi, reference

WEIGHT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
D, F = 12, 37  # unequal, prime-ish: catches transposed axes and vector tails


def make_ffn(seed, *, t=3, d=D, f=F, dtype=jnp.float32, gated=True, bias=False, lead=()):
    """Random FFN operands, drawn with numpy: eager jax.random would compile per new shape."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(d)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    w = lambda: jnp.asarray(normal(f, d) * scale, dtype)
    return dict(
        x=jnp.asarray(normal(*lead, t, d)),
        w_up=w(),
        w_down_t=w(),
        w_gate=w() if gated else None,
        b_up=jnp.asarray(normal(f) * 0.1) if bias else None,
        b_down=jnp.asarray(normal(d) * 0.1) if bias else None,
        mask=jnp.asarray((rng.random((*lead, t, f)) < 0.4).astype(np.float32)),
    )


def call(p, impl, **kwargs):
    kwargs.setdefault("scores", p["mask"])
    kwargs.setdefault("threshold", 0.5)
    return ops.sparse_ffn(p["x"], p["w_up"], p["w_down_t"], w_gate=p["w_gate"], b_up=p["b_up"],
                          b_down=p["b_down"], impl=impl, **kwargs)


def dense_ffn(p, activation):
    """Plain dense FFN in float32 (no masking), the all-active oracle."""
    x = p["x"].astype(jnp.float32)
    h = x @ p["w_up"].astype(jnp.float32).T + (0 if p["b_up"] is None else p["b_up"])
    act = reference.activate
    a = act(activation, h) if p["w_gate"] is None else \
        act(activation, x @ p["w_gate"].astype(jnp.float32).T) * h
    return a @ p["w_down_t"].astype(jnp.float32) + (0 if p["b_down"] is None else p["b_down"])


@pytest.fixture
def two_threads():
    before = _ffi.get_num_threads()
    ops.set_num_threads(2)
    yield
    ops.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", "relu", "gelu"])
def test_matches_reference(dtype, gated, bias, activation):
    for t in range(1, 6):
        p = make_ffn(t, t=t, dtype=dtype, gated=gated, bias=bias)
        y, n = call(p, "ffi", activation=activation)
        y_ref, n_ref = call(p, "reference", activation=activation)
        assert y.dtype == jnp.float32 and y.shape == (t, D)
        assert n.dtype == jnp.int32 and n.shape == (t,)
        np.testing.assert_array_equal(n, n_ref)
        np.testing.assert_array_equal(n, p["mask"].sum(-1))
        assert_close(y, y_ref, dtype)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_all_active_equals_dense(dtype, gated):
    p = make_ffn(1, t=5, dtype=dtype, gated=gated, bias=True)
    y, n = call(p, "ffi", scores=jnp.ones((5, F)), activation="gelu")
    np.testing.assert_array_equal(n, F)
    assert_close(y, dense_ffn(p, "gelu"), dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_none_active_is_bias_only(bias):
    p = make_ffn(2, t=4, bias=bias)
    y, n = call(p, "ffi", scores=jnp.zeros((4, F)))
    np.testing.assert_array_equal(n, 0)
    expected = np.zeros((4, D)) if not bias else np.broadcast_to(p["b_down"], (4, D))
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_oracle_relu_threshold_zero_equals_dense(dtype, gated):
    p = make_ffn(3, t=5, dtype=dtype, gated=gated, bias=True)
    y, n = call(p, "ffi", criterion="oracle", scores=None, threshold=0.0, activation="relu")
    assert_close(y, dense_ffn(p, "relu"), dtype)
    _, n_ref = call(p, "reference", criterion="oracle", scores=None, threshold=0.0,
                    activation="relu")
    np.testing.assert_array_equal(n, n_ref)
    assert 0 < int(n.sum()) < 5 * F  # ReLU really is sparse here: the test is not vacuous


def test_oracle_threshold_matches_reference():
    p = make_ffn(4, t=5, bias=True)
    kwargs = dict(criterion="oracle", scores=None, threshold=0.05, activation="silu")
    y, n = call(p, "ffi", **kwargs)
    y_ref, n_ref = call(p, "reference", **kwargs)
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, jnp.float32)


def test_scores_as_logits():
    p = make_ffn(5, t=3)
    logits = jnp.asarray(np.random.default_rng(9).standard_normal((3, F), dtype=np.float32))
    y, n = call(p, "ffi", scores=logits, threshold=0.3)
    y_ref, n_ref = call(p, "reference", scores=logits, threshold=0.3)
    np.testing.assert_array_equal(n, (logits > 0.3).sum(-1))
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, jnp.float32)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.integers(1, 6), d=st.integers(1, 40), f=st.integers(1, 70),
       density=st.floats(0.0, 1.0), threshold=st.floats(0.0, 0.3),
       dtype=st.sampled_from(WEIGHT_DTYPES), gated=st.booleans(), bias=st.booleans(),
       oracle=st.booleans(), seed=st.integers(0, 2**16))
def test_property_matches_reference(t, d, f, density, threshold, dtype, gated, bias, oracle,
                                    seed):
    p = make_ffn(seed, t=t, d=d, f=f, dtype=dtype, gated=gated, bias=bias)
    scores = np.random.default_rng(seed + 1).random((t, f), dtype=np.float32)
    scores = jnp.asarray(scores * (density + threshold))
    kwargs = dict(criterion="oracle" if oracle else "scores", scores=None if oracle else scores,
                  threshold=threshold, activation="silu")
    if oracle:  # a neuron within rounding of the threshold may legitimately fall either side
        acts = _activations(p, "silu")
        assume(bool(np.all(np.abs(np.abs(acts) - threshold) > 1e-4)))
    y_ref, n_ref = _jit_reference(p, **kwargs)
    y, n = call(p, "ffi", **kwargs)
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, dtype)


def _jit_reference(p, **kwargs):
    """The reference under one jit (eager jnp would compile every op for every new shape)."""
    static = {k: kwargs.pop(k) for k in ("criterion", "threshold", "activation")}
    return jax.jit(lambda p, scores: call(p, "reference", scores=scores, **static))(
        p, kwargs["scores"])


def _activations(p, activation):
    """Activations in numpy float64 (only used to skip threshold ties)."""
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x = as64(p["x"])
    h = x @ as64(p["w_up"]).T + (0 if p["b_up"] is None else as64(p["b_up"]))
    silu = lambda v: v / (1 + np.exp(-v))
    assert activation == "silu"
    return silu(h) if p["w_gate"] is None else silu(x @ as64(p["w_gate"]).T) * h


def test_leading_batch_dims_without_vmap():
    p = make_ffn(6, t=3, lead=(2, 2), bias=True)
    y, n = call(p, "ffi")
    y_ref, n_ref = call(p, "reference")
    assert y.shape == (2, 2, 3, D) and n.shape == (2, 2, 3)
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmap_over_batch(dtype):
    p = make_ffn(7, t=3, lead=(4,), dtype=dtype, bias=True)

    def f(x, scores, impl):
        return ops.sparse_ffn(x, p["w_up"], p["w_down_t"], w_gate=p["w_gate"], b_up=p["b_up"],
                              b_down=p["b_down"], scores=scores, threshold=0.5, impl=impl)

    y, n = jax.vmap(lambda x, s: f(x, s, "ffi"))(p["x"], p["mask"])
    y_ref, n_ref = call(p, "reference")
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, dtype)
    # Only x batched: the shared scores broadcast inside the handler (no per-element copies).
    y2, n2 = jax.vmap(lambda x: f(x, p["mask"][0], "ffi"))(p["x"])
    y2_ref, n2_ref = jax.vmap(lambda x: f(x, p["mask"][0], "reference"))(p["x"])
    np.testing.assert_array_equal(n2, n2_ref)
    assert_close(y2, y2_ref, dtype)
    # Only scores batched: x broadcasts.
    y3, _ = jax.vmap(lambda s: f(p["x"][0], s, "ffi"))(p["mask"])
    y3_ref, _ = jax.vmap(lambda s: f(p["x"][0], s, "reference"))(p["mask"])
    assert_close(y3, y3_ref, dtype)


def test_nested_vmap_and_jit():
    p = make_ffn(8, t=2, lead=(2, 3))

    @jax.jit
    def f(x, s):
        return ops.sparse_ffn(x, p["w_up"], p["w_down_t"], w_gate=p["w_gate"], scores=s,
                              threshold=0.5)

    y, n = jax.vmap(jax.vmap(f))(p["x"], p["mask"])
    y_ref, n_ref = call(p, "reference")
    np.testing.assert_array_equal(n, n_ref)
    assert_close(y, y_ref, jnp.float32)


def test_under_jit_with_bf16_input():
    p = make_ffn(9, t=4)
    x16 = p["x"].astype(jnp.bfloat16)
    f = jax.jit(lambda x, s: ops.sparse_ffn(x, p["w_up"], p["w_down_t"], w_gate=p["w_gate"],
                                            scores=s, threshold=0.5))
    y, _ = f(x16, p["mask"])
    y_ref, _ = reference.sparse_ffn(x16, p["w_up"], p["w_down_t"], w_gate=p["w_gate"],
                                    scores=p["mask"], threshold=0.5)
    assert_close(y, y_ref, jnp.float32)


BAD_PYTHON_INPUTS = [
    (dict(x=jnp.ones((D,))), "x shape"),
    (dict(x=jnp.ones((3, D + 1))), "w_up shape"),
    (dict(w_down_t=jnp.ones((F, D + 1))), "w_down_t shape"),
    (dict(w_gate=jnp.ones((F, D), jnp.bfloat16)), "w_gate dtype"),
    (dict(scores=jnp.ones((3, F + 1))), "scores shape"),
    (dict(scores=None), "scores"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold=-0.1), "threshold"),
    (dict(criterion="topk"), "criterion"),
    (dict(activation="swish"), "activation"),
    (dict(impl="cuda"), "impl"),
    (dict(b_up=jnp.ones((F + 1,))), "b_up shape"),
    (dict(w_up=jnp.ones((F, D), jnp.int8), w_down_t=jnp.ones((F, D), jnp.int8), w_gate=None),
     "w_up dtype"),
]


@pytest.mark.parametrize("change,what", BAD_PYTHON_INPUTS)
def test_bad_inputs_raise_value_error(change, what):
    p = make_ffn(10, t=3)
    args = dict(x=p["x"], w_up=p["w_up"], w_down_t=p["w_down_t"], w_gate=p["w_gate"],
                scores=p["mask"], threshold=0.5)
    args.update(change)
    x, w_up, w_down_t = args.pop("x"), args.pop("w_up"), args.pop("w_down_t")
    with pytest.raises(ValueError, match=what + ".*expected"):
        ops.sparse_ffn(x, w_up, w_down_t, **args)


def _raw_call(x, w_up, w_down_t, *, w_gate=None, b_up=None, b_down=None, scores=None,
              threshold=0.5, activation="silu", criterion="scores"):
    """Straight to the FFI handler, skipping Python validation: the C++ checks must hold alone."""
    return _ffi.sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, b_up=b_up, b_down=b_down,
                           scores=scores, threshold=threshold, activation=activation,
                           criterion=criterion)


BAD_FFI_INPUTS = [
    (dict(x=jnp.ones((3, D + 1))), "w_up shape"),
    (dict(w_gate=jnp.ones((F, D), jnp.float16)), "w_gate dtype"),
    (dict(scores=jnp.ones((3, F + 1))), "scores shape"),
    (dict(threshold=float("nan")), "threshold"),
    (dict(threshold=-1.0), "threshold"),
    (dict(activation="swish"), "activation"),
    (dict(criterion="topk"), "criterion"),
    (dict(w_up=jnp.ones((F, D), jnp.int8), w_down_t=jnp.ones((F, D), jnp.int8), w_gate=None),
     "w_up dtype"),
    (dict(w_up=jnp.ones((2, F, D)), w_down_t=jnp.ones((2, F, D)), w_gate=None), "w_up shape"),
    (dict(b_up=jnp.ones(F + 1)), "b_up"),
    (dict(b_down=jnp.ones((2, D))), "b_down"),  # a leading dim that is not vmap's size 1
    (dict(b_down=jnp.ones(())), "b_down"),  # rank 0: no last dim to compare
]


@pytest.mark.parametrize("change,what", BAD_FFI_INPUTS)
def test_bad_inputs_rejected_by_handler(change, what):
    p = make_ffn(11, t=3)
    args = dict(x=p["x"], w_up=p["w_up"], w_down_t=p["w_down_t"], w_gate=p["w_gate"],
                scores=p["mask"])
    args.update(change)
    with pytest.raises(Exception, match=f"sparse_ffn: {what}: expected"):
        jax.block_until_ready(_raw_call(args.pop("x"), args.pop("w_up"), args.pop("w_down_t"),
                                        **args))


def test_deterministic_across_runs(two_threads):
    p = make_ffn(12, t=3, d=256, f=1024, dtype=jnp.bfloat16, bias=True)
    scores = jnp.asarray(np.random.default_rng(13).standard_normal((3, 1024), dtype=np.float32))
    f = jax.jit(lambda x: call(dict(p, x=x), "ffi", scores=scores, threshold=0.2))
    first_y, first_n = (np.asarray(a) for a in f(p["x"]))
    for _ in range(19):
        y, n = f(p["x"])
        np.testing.assert_array_equal(np.asarray(y).view(np.uint32), first_y.view(np.uint32))
        np.testing.assert_array_equal(n, first_n)
    y_ref, _ = call(p, "reference", scores=scores, threshold=0.2)
    assert_close(first_y, y_ref, "other_path")


def test_thread_counts_agree():
    p = make_ffn(14, t=2, d=64, f=300)
    before = _ffi.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            ops.set_num_threads(n)
            assert _ffi.get_num_threads() == n
            results.append(np.asarray(call(p, "ffi")[0]))
    finally:
        ops.set_num_threads(before)
    for r in results[1:]:
        assert_close(r, results[0], jnp.float32)
    with pytest.raises(ValueError, match=r"expected an integer in \[1, \d+\], got 0"):
        ops.set_num_threads(0)


def test_thread_pool_survives_back_to_back_jobs_with_more_threads_than_cores():
    """Many tiny jobs on an oversubscribed pool: workers get descheduled between seeing a job and
    checking in, the race that once lost a check-in count and hung the next job forever. Run in a
    child process so a hang fails the test instead of the suite."""
    import subprocess
    import sys

    code = ("from powerinfer_jax import _pij_ext as e; "
            "print(e.pool_stress(8, 100000, 3), e.pool_stress(3, 100000, 5))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
    except subprocess.TimeoutExpired:
        pytest.fail("thread pool hung: back-to-back jobs did not finish in 120 s")
    assert out == ["300000", "500000"]


@pytest.mark.parametrize("criterion", ["oracle", "scores"])
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(criterion):
    """Batched decoding relies on it: each row of a 16-token call (token groups of 4, a union of
    active neurons) equals, bit for bit, that token computed alone; so does linear's."""
    rng = np.random.default_rng(3)
    t, d, f = 16, 200, 300
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    w = {k: jnp.asarray(rng.standard_normal((f, d), dtype=np.float32) * 0.1, jnp.bfloat16)
         for k in ("w_up", "w_gate", "w_down_t")}
    scores = rng.standard_normal((t, f)).astype(np.float32)
    kw = dict(criterion=criterion, threshold=0.3 if criterion == "scores" else 0.05)
    together, _ = ops.sparse_ffn(x, w["w_up"], w["w_down_t"], w_gate=w["w_gate"],
                                 scores=None if criterion == "oracle" else scores, **kw)
    lin = ops.linear(x, w["w_up"])
    for i in (0, 5, 15):
        alone, _ = ops.sparse_ffn(x[i:i + 1], w["w_up"], w["w_down_t"], w_gate=w["w_gate"],
                                  scores=None if criterion == "oracle" else scores[i:i + 1], **kw)
        np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(together)[i])
        np.testing.assert_array_equal(np.asarray(ops.linear(x[i:i + 1], w["w_up"]))[0],
                                      np.asarray(lin)[i])
