"""dReLU (a = relu(gate . x) * relu(up . x + b)) in every kernel that switches on the activation:
the sparse FFN custom call (all criteria, decode and token groups, weight dtypes), the q4
estimate and the placed (hybrid) FFN, each against the jnp reference and a numpy twin."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.ops import nibble_rows, reference
from powerinfer_jax.ops.qblocks import round_activations

D, F = 12, 37


def _operands(seed, *, t, d=D, f=F, dtype=jnp.float32, bias=True):
    rng = np.random.default_rng(seed)
    w = lambda: (rng.standard_normal((f, d)) / math.sqrt(d)).astype(np.float32)
    gate, up, down = w(), w(), w()
    return dict(x=rng.standard_normal((t, d)).astype(np.float32),
                gate=np.asarray(jnp.asarray(gate, dtype).astype(jnp.float32)),
                up=np.asarray(jnp.asarray(up, dtype).astype(jnp.float32)),
                down=np.asarray(jnp.asarray(down, dtype).astype(jnp.float32)),
                b_up=(0.1 * rng.standard_normal(f)).astype(np.float32) if bias else None,
                b_down=(0.1 * rng.standard_normal(d)).astype(np.float32) if bias else None,
                mask=(rng.random((t, f)) < 0.5).astype(np.float32), dtype=dtype)


def _numpy_drelu(p, keep=None):
    """numpy: a = max(g, 0) * max(u + b, 0); y = a[keep] @ down (+ b_down)."""
    x = p["x"].astype(np.float64)
    u = x @ p["up"].T + (0 if p["b_up"] is None else p["b_up"])
    a = np.maximum(x @ p["gate"].T, 0) * np.maximum(u, 0)
    if keep is not None:
        a = np.where(keep, a, 0)
    return a @ p["down"] + (0 if p["b_down"] is None else p["b_down"]), a


def _call(p, impl, **kw):
    dt = p["dtype"]
    return ops.sparse_ffn(jnp.asarray(p["x"]), jnp.asarray(p["up"], dt), jnp.asarray(p["down"], dt),
                          w_gate=jnp.asarray(p["gate"], dt),
                          b_up=None if p["b_up"] is None else jnp.asarray(p["b_up"]),
                          b_down=None if p["b_down"] is None else jnp.asarray(p["b_down"]),
                          activation="drelu", impl=impl, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t", [1, 3, 6])  # 1: the decode path; 6: a token group and a tail
@pytest.mark.parametrize("bias", [True, False])
def test_sparse_ffn_oracle_is_the_dense_drelu_ffn(dtype, t, bias):
    p = _operands(t, t=t, dtype=dtype, bias=bias)
    y, n = _call(p, "ffi", criterion="oracle", threshold=0.0)
    y_ref, n_ref = _call(p, "reference", criterion="oracle", threshold=0.0)
    y_np, a = _numpy_drelu(p)
    assert_close(y, y_ref)
    assert_close(y, y_np)
    # a neuron is active only when gate AND up are positive: dReLU's sparsity is their overlap
    np.testing.assert_array_equal(np.asarray(n), (a > 0).sum(-1))
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    assert 0 < (a > 0).mean() < 0.5


@pytest.mark.parametrize("t", [1, 4])
def test_sparse_ffn_scores_criterion(t):
    p = _operands(10 + t, t=t)
    y, n = _call(p, "ffi", scores=jnp.asarray(p["mask"]), threshold=0.5)
    y_ref, _ = _call(p, "reference", scores=jnp.asarray(p["mask"]), threshold=0.5)
    y_np, _ = _numpy_drelu(p, keep=p["mask"] > 0.5)
    assert_close(y, y_ref)
    assert_close(y, y_np)
    np.testing.assert_array_equal(np.asarray(n), (p["mask"] > 0.5).sum(-1))


def test_non_gated_drelu_is_relu():
    p = _operands(3, t=3)
    args = (jnp.asarray(p["x"]), jnp.asarray(p["up"]), jnp.asarray(p["down"]))
    kw = dict(criterion="oracle", threshold=0.0, b_up=jnp.asarray(p["b_up"]))
    y_d, _ = ops.sparse_ffn(*args, activation="drelu", **kw)
    y_r, _ = ops.sparse_ffn(*args, activation="relu", **kw)
    np.testing.assert_array_equal(np.asarray(y_d), np.asarray(y_r))


@pytest.mark.slow
@pytest.mark.parametrize("t,d,f", [(1, 576, 300), (3, 100, 37)])
def test_q4_estimate(t, d, f):
    """The q4 estimate's dReLU path vs the reference and numpy on the dequantized 4-bit rows
    with Q8 activations (the one Python rounding, qblocks.round_activations)."""
    p = _operands(20 + t, t=t, d=d, f=f)
    qq, dm = nibble_rows.quantize(np.stack([p["gate"], p["up"]], 1))
    got = np.asarray(jax.jit(lambda x: ops.q4_scores(x, qq, dm, p["b_up"], activation="drelu",
                                                     signed=True))(p["x"]))
    ref = np.asarray(ops.q4_scores(p["x"], qq, dm, p["b_up"], activation="drelu", signed=True,
                                   impl="reference"))
    assert_close(got, ref, "dot_products")
    xq = np.asarray(round_activations(jnp.asarray(p["x"]), 32), np.float64)
    w = np.asarray(nibble_rows.dequantize(qq, dm, d), np.float64)  # [F, 2, D]
    a = np.maximum(xq @ w[:, 0].T, 0) * np.maximum(xq @ w[:, 1].T + p["b_up"], 0)
    assert_close(got, a, "dot_products")
    assert np.all(got >= 0)


def test_placed_ffn_matches_unplaced():
    """The hybrid FFN (hot rows through XLA, cold through the call) computes dReLU the same."""
    from flax import nnx

    from powerinfer_jax.models.ffn import FFN
    from powerinfer_jax.sparsity.selectors import Oracle

    p = _operands(30, t=4)
    ffn = FFN(d_model=D, d_ff=F, activation="drelu", gated=True, bias=False, dtype=jnp.float32,
              rngs=nnx.Rngs(0))
    x = jnp.asarray(p["x"])[None]
    want = np.asarray(ffn(x))  # dense, XLA
    g, u, dn = (np.asarray(m.weight[...], np.float64) for m in (ffn.gate, ffn.up, ffn.down_t))
    xn = p["x"].astype(np.float64)
    assert_close(want[0], (np.maximum(xn @ g.T, 0) * np.maximum(xn @ u.T, 0)) @ dn)
    ffn.set_selector(Oracle(0.0))
    ffn.split(F // 3, store="operands")
    got, sown = nnx.capture(lambda f, v: f(v), nnx.Intermediate)(ffn, x)
    assert_close(got, want)
    n = [v.get_value()[-1] for path, v in nnx.to_flat_state(sown) if path[-1] == "n_active"][0]
    assert 0 < np.asarray(n).max() < F
