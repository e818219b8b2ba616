"""CUDA hybrid handler (hot rows on the GPU, cold rows on the host pool via cudaLaunchHostFunc) vs
the jnp reference over all rows. Needs a GPU and a PIJ_CUDA=ON build; skips otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerinfer_jax.ops import reference


def _gpu():
    try:
        from powerinfer_jax.ops import _ffi
    except ImportError:
        return None
    if jax.default_backend() != "gpu" or _ffi._pij_cuda is None:
        return None
    return jax.devices()[0]


pytestmark = pytest.mark.skipif(_gpu() is None, reason="needs a GPU and the PIJ_CUDA=ON build")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("criterion", ["scores", "oracle"])
@pytest.mark.parametrize("n_hot", [1, 150, 300])
def test_hybrid_matches_reference(dtype, gated, t, criterion, n_hot):
    from powerinfer_jax.ops import _ffi

    rng = np.random.default_rng(0)
    d, f = 96, 301
    w = lambda: np.asarray(jnp.asarray(rng.standard_normal((f, d), np.float32) / np.sqrt(d), dtype))
    gate, up, down = (w() if gated else None), w(), w()
    b_up = None if gated else rng.standard_normal(f).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((t, d), np.float32))
    scores = jnp.asarray((rng.random((t, f)) < 0.3).astype(np.float32))
    thr = 0.5 if criterion == "scores" else 0.05
    act = "silu" if gated else "relu"
    handle = _ffi.register_cold_rows(up[n_hot:], down[n_hot:],
                                     gate=None if gate is None else gate[n_hot:],
                                     b_up=None if b_up is None else b_up[n_hot:])
    hot = lambda a: None if a is None else jnp.asarray(a[:n_hot])
    y, n = jax.jit(lambda x, s: _ffi.sparse_ffn_hybrid(
        x, hot(up), hot(down), w_gate=hot(gate), b_up=hot(b_up), b_down=None,
        scores=s[:, :n_hot], scores_cold=s[:, n_hot:], threshold=thr, activation=act,
        criterion=criterion, cold_handle=handle))(x, scores)
    want_y, want_n = reference.sparse_ffn(
        x, jnp.asarray(up), jnp.asarray(down), w_gate=None if gate is None else jnp.asarray(gate),
        b_up=None if b_up is None else jnp.asarray(b_up), scores=scores, threshold=thr,
        activation=act, criterion=criterion)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(want_n))
    assert _ffi._pij_cuda.release_cold_rows(handle)
