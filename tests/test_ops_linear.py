"""Dense linear custom call (the decode matvec) vs its pure-jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerinfer_jax import ops
from powerinfer_jax.ops import _ffi

WEIGHT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = dict(rtol=2e-5, atol=2e-5)  # both sides widen the same stored weights; only order differs


def operands(seed, *, lead=(3,), d=12, o=37, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, d), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((o, d), dtype=np.float32) / np.sqrt(d), dtype)
    b = jnp.asarray(rng.standard_normal(o, dtype=np.float32))
    return x, w, b


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), ()])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, lead, bias):
    x, w, b = operands(0, lead=lead, dtype=dtype)
    b = b if bias else None
    got = jax.jit(lambda x, w, b: ops.linear(x, w, b))(x, w, b)
    want = ops.linear(x, w, b, impl="reference")
    assert got.shape == lead + (37,) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("d,o", [(576, 1536), (64, 3000), (33, 1)])
def test_larger_and_odd_shapes_use_the_pool_correctly(d, o):
    x, w, b = operands(1, lead=(4,), d=d, o=o, dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(ops.linear(x, w, b)),
                               np.asarray(ops.linear(x, w, b, impl="reference")),
                               rtol=1e-4, atol=1e-4)


def test_vmap_does_not_need_batched_weights():
    x, w, b = operands(2, lead=(6, 2))
    got = jax.vmap(lambda xi: ops.linear(xi, w, b))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ops.linear(x, w, b, impl="reference")),
                               **TOL)


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
