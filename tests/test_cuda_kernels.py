"""CUDA sparse FFN handler vs the jnp reference. Needs a GPU and a PIJ_CUDA=ON build; skips
otherwise (this suite's CI machines have no GPU: run it on one, see BUILD.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_cuda import cuda_device, needs_cuda
from helpers_tolerances import assert_close
from powerinfer_jax import ops


pytestmark = needs_cuda


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("criterion", ["scores", "oracle"])
@pytest.mark.parametrize("d", [96, 100])  # 100: bf16/f16 rows not a multiple of 16 bytes
def test_cuda_matches_reference(dtype, gated, t, criterion, d):
    rng = np.random.default_rng(0)
    f = 301  # two chunks of the down kernel, the second partial
    w = lambda: jnp.asarray(rng.standard_normal((f, d), np.float32) / np.sqrt(d), dtype)
    args = dict(w_gate=w() if gated else None, b_up=None, b_down=None,
                activation="silu" if gated else "relu", criterion=criterion)
    x = jnp.asarray(rng.standard_normal((t, d), np.float32))
    w_up, w_down_t = w(), w()
    if criterion == "scores":
        args.update(scores=jnp.asarray((rng.random((t, f)) < 0.3).astype(np.float32)),
                    threshold=0.5)
    else:
        args.update(threshold=0.05)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        want_y, want_n = ops.sparse_ffn(x, w_up, w_down_t, impl="reference", **args)
    gpu = cuda_device()
    put = lambda a: None if a is None else jax.device_put(a, gpu)
    got_y, got_n = jax.jit(lambda x, u, dn, g, s: ops.sparse_ffn(
        x, u, dn, **{**args, "w_gate": g, "scores": s}))(
        put(x), put(w_up), put(w_down_t), put(args["w_gate"]), put(args.get("scores")))
    assert_close(got_y, want_y, "other_path")
    np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))
