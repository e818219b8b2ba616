"""Dense linear custom call (the decode matvec) vs its pure-jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.ops import _ffi

WEIGHT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def operands(seed, *, lead=(3,), d=12, o=37, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, d), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((o, d), dtype=np.float32) / np.sqrt(d), dtype)
    b = jnp.asarray(rng.standard_normal(o, dtype=np.float32))
    return x, w, b


@pytest.mark.slow
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), ()])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, lead, bias):
    x, w, b = operands(0, lead=lead, dtype=dtype)
    b = b if bias else None
    got = jax.jit(lambda x, w, b: ops.linear(x, w, b))(x, w, b)
    want = ops.linear(x, w, b, impl="reference")
    assert got.shape == lead + (37,) and got.dtype == jnp.float32
    assert_close(got, want, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("d,o", [(576, 1536), (64, 3000), (33, 1)])
def test_larger_and_odd_shapes_use_the_pool_correctly(d, o):
    x, w, b = operands(1, lead=(4,), d=d, o=o, dtype=jnp.bfloat16)
    assert_close(ops.linear(x, w, b), ops.linear(x, w, b, impl="reference"), "other_path")


def test_vmap_does_not_need_batched_weights():
    x, w, b = operands(2, lead=(6, 2))
    got = jax.vmap(lambda xi: ops.linear(xi, w, b))(x)
    assert_close(got, ops.linear(x, w, b, impl="reference"))


def test_result_does_not_depend_on_thread_count():
    x, w, _ = operands(3, lead=(3,), d=256, o=4096, dtype=jnp.bfloat16)
    results = []
    for n in (1, 2, 1):
        ops.set_num_threads(n)
        results.append(np.asarray(ops.linear(x, w)))
    ops.set_num_threads(2)
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("bad,match", [
    (dict(w=jnp.zeros((37, 11))), r"w shape: expected \[O, D\] with D = 12"),
    (dict(w=jnp.zeros((37,))), r"w shape"),
    (dict(w=jnp.zeros((37, 12), jnp.int32)), r"w dtype: expected float32, bfloat16 or float16"),
    (dict(b=jnp.zeros(36)), r"b shape: expected \[O\] = \(37,\)"),
    (dict(x=jnp.zeros((3, 12), jnp.int32)), r"x dtype: expected a floating dtype"),
])
def test_bad_input_is_a_clear_error(bad, match):
    x, w, b = operands(4)
    args = {**dict(x=x, w=w, b=b), **bad}
    with pytest.raises(ValueError, match=match):
        ops.linear(args["x"], args["w"], args["b"])


def test_handler_validates_too():
    """Calling the FFI layer directly (bypassing Python checks) still fails cleanly."""
    x, w, _ = operands(5)
    with pytest.raises(Exception, match=r"linear: w shape: expected \[O, 12\]"):
        jax.block_until_ready(_ffi.linear(x, jnp.zeros((37, 11)), None))
    with pytest.raises(Exception, match=r"linear: bias: expected float32 \[37\] or absent"):
        jax.block_until_ready(_ffi.linear(x, w, jnp.zeros((5,))))
    # a scalar bias has no last dim to compare: the same clean error, not a read out of bounds
    with pytest.raises(Exception, match=r"linear: bias: expected float32 \[37\] or absent "
                                        r"\(zero-size\), got float32 \[\]"):
        jax.block_until_ready(_ffi.linear(x, w, jnp.ones(())))


# ------------------------------------------------------------------------------------------------
# linear_many: several products of one x in one call (attention's q, k, v at decode)
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("lead", [(1,), (5,), (1, 1)])
def test_linear_many_equals_separate_linear_calls(dtype, lead):
    rng = np.random.default_rng(6)
    d = 576
    x = jnp.asarray(rng.standard_normal((*lead, d), dtype=np.float32))
    ws = [jnp.asarray(rng.standard_normal((o, d), dtype=np.float32) / np.sqrt(d), dtype)
          for o in (576, 192, 192)]
    bs = [None, jnp.asarray(rng.standard_normal(192), jnp.float32), None]
    got = jax.jit(lambda x, ws, bs: ops.linear_many(x, ws, bs))(x, ws, bs)
    assert len(got) == 3
    for g, w, b in zip(got, ws, bs):
        # the same rows in the same order as the single-product call: bitwise equal
        np.testing.assert_array_equal(np.asarray(g), np.asarray(ops.linear(x, w, b)))
        assert_close(g, ops.linear(x, w, b, impl="reference"), "other_path")


def test_linear_many_does_not_depend_on_thread_count():
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, 256), dtype=np.float32))
    ws = [jnp.asarray(rng.standard_normal((o, 256), dtype=np.float32), jnp.bfloat16)
          for o in (1000, 7, 300)]
    results = []
    for n in (1, 2, 3, 1):
        ops.set_num_threads(n)
        results.append([np.asarray(y) for y in ops.linear_many(x, ws)])
    ops.set_num_threads(2)
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], r))


def test_linear_many_bad_input_is_a_clear_error():
    x, w, b = operands(8)
    with pytest.raises(ValueError, match="one dtype for every weight"):
        ops.linear_many(x, [w, w.astype(jnp.bfloat16)])
    with pytest.raises(ValueError, match="as many biases"):
        ops.linear_many(x, [w, w], [b])
    with pytest.raises(ValueError, match="one or more weights"):
        ops.linear_many(x, [])
    with pytest.raises(ValueError, match=r"w shape: expected \[O, D\] with D = 12"):
        ops.linear_many(x, [w, jnp.zeros((5, 11))])
    # the handler checks too, naming the operand's index
    with pytest.raises(Exception, match=r"linear: \[1\] bias: expected float32 \[37\]"):
        jax.block_until_ready(_ffi.linear_many(x, [w, w], [None, jnp.zeros((5,))]))
    with pytest.raises(Exception,
                       match=r"linear: \[1\] w dtype: expected float32 \(w\[0\].s\), got bfloat16"):
        jax.block_until_ready(_ffi.linear_many(x, [w, w.astype(jnp.bfloat16)], [None, None]))
