"""RMSNorm custom call vs its pure-jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerinfer_jax import ops
from powerinfer_jax.ops import _ffi

TOL = {jnp.float32: dict(rtol=1e-6, atol=1e-6), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 3, dtype)
    scale = jnp.asarray(rng.standard_normal(shape[-1:], dtype=np.float32))
    return x, scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(12,), (5, 12), (2, 3, 37), (64, 1024)])  # last: pool path
def test_matches_reference(dtype, shape):
    x, scale = _inputs(shape, dtype)
    y = ops.rms_norm(x, scale, eps=1e-5)
    y_ref = ops.rms_norm(x, scale, eps=1e-5, impl="reference")
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               **TOL[dtype])


def test_vmap_and_jit():
    x, scale = _inputs((4, 3, 12), jnp.float32)
    f = jax.jit(jax.vmap(lambda x: ops.rms_norm(x, scale, eps=1e-6)))
    y_ref = ops.rms_norm(x, scale, eps=1e-6, impl="reference")
    np.testing.assert_allclose(f(x), y_ref, **TOL[jnp.float32])
    # scale batched too: the handler accepts scale only with leading size-1 dims
    g = jax.vmap(lambda x, s: ops.rms_norm(x, s, eps=1e-6), in_axes=(0, None))
    np.testing.assert_allclose(g(x, scale), y_ref, **TOL[jnp.float32])


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan")])
def test_bad_eps(eps):
    x, scale = _inputs((3, 12), jnp.float32)
    with pytest.raises(ValueError, match="eps: expected"):
        ops.rms_norm(x, scale, eps=eps)
    with pytest.raises(Exception, match="rms_norm: eps: expected"):
        jax.block_until_ready(_ffi.rms_norm(x, scale, eps=eps))


def test_bad_scale_shape():
    x, _ = _inputs((3, 12), jnp.float32)
    with pytest.raises(ValueError, match="scale shape: expected"):
        ops.rms_norm(x, jnp.ones((11,)), eps=1e-5)
    with pytest.raises(Exception, match="rms_norm: scale: expected"):
        jax.block_until_ready(_ffi.rms_norm(x, jnp.ones((11,)), eps=1e-5))
