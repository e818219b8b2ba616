"""models/moe.py: the router and the routed executions against the dense-all-experts reference.

  * route(): softmax, top-k, renormalized or not, as transformers' routers compute (numpy);
  * each token's experts gathered equal every expert on every token weighted by the routing
    (unrouted ones 0) and a numpy loop over tokens, with and without a shared expert, jitted;
  * a token whose router is changed to pick other experts changes only through those experts
    (the routed path reads the routed experts, nothing else);
  * bad input: a top-k larger than the number of experts, a sparsity selector on an MoE FFN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_tolerances import assert_close
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.models.moe import MoE, route

D, F, E = 24, 40, 7


def _moe(k=2, shared=0, normalize=True, seed=0):
    return MoE(d_model=D, d_ff=F, n_experts=E, n_used=k, norm_topk_prob=normalize,
               activation="silu", d_ff_shared=shared, dtype=jnp.float32,
               rngs=nnx.Rngs(seed), kernels="xla")


def _np_route(logits, k, normalize):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return ids, (w / w.sum(-1, keepdims=True) if normalize else w)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_is_softmax_then_top_k(normalize):
    logits = np.random.default_rng(0).normal(size=(11, E)).astype(np.float32)
    ids, w = route(jnp.asarray(logits), 3, normalize)
    want_ids, want_w = _np_route(logits, 3, normalize)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    assert_close(w, want_w, "ulps")


def _numpy_moe(m: MoE, x):
    """Every token through its experts, one by one, in numpy float64."""
    g, u, dn = (np.asarray(s.weight[...], np.float64) for s in
                (m.experts.gate, m.experts.up, m.experts.down_t))
    ids, w = _np_route(x @ np.asarray(m.router.weight[...], np.float64).T, m.n_used,
                       m.normalize)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for e, wt in zip(ids[n], w[n]):
            h = x[n] @ g[e].T
            y[n] += wt * ((h / (1 + np.exp(-h))) * (x[n] @ u[e].T)) @ dn[e]
    if m.shared is not None:
        sg, su, sd = (np.asarray(lin.weight[...], np.float64) for lin in
                      (m.shared.gate, m.shared.up, m.shared.down_t))
        h = x @ sg.T
        s = 1 / (1 + np.exp(-(x @ np.asarray(m.shared_gate.weight[...], np.float64).T)))
        y += s * (((h / (1 + np.exp(-h))) * (x @ su.T)) @ sd)
    return y


@pytest.mark.parametrize("shared", [0, 16])
@pytest.mark.parametrize("tokens", [(1, 1), (1, 3), (2, 9)])
def test_routed_executions_equal_the_dense_reference(shared, tokens):
    m = _moe(k=2, shared=shared)
    x = jax.random.normal(jax.random.key(1), tokens + (D,))
    want = _numpy_moe(m, np.asarray(x, np.float64).reshape(-1, D)).reshape(x.shape)

    def run(model, x):
        return model(x)

    routed = nnx.jit(run)(m, x)
    m.set_execution("dense")
    dense = nnx.jit(run)(m, x)
    assert_close(dense, want, "dot_products")
    assert_close(routed, dense, "regrouped")


def test_unrouted_experts_are_not_read():
    """Poisoning every expert a token is not routed to (NaN rows) leaves its output unchanged
    in both routed paths: their rows are never computed on. The dense reference reads them."""
    m = _moe(k=2)
    x = jax.random.normal(jax.random.key(2), (1, 5, D))
    ids, _ = m.routing(x)
    before = {t: np.asarray(m(x[:, :t])) for t in (1, 5)}
    used = set(np.asarray(ids).ravel().tolist())
    for s in (m.experts.gate, m.experts.up, m.experts.down_t):
        w = s.weight[...]
        s.weight.set_value(w.at[jnp.asarray([e for e in range(E) if e not in used])].set(jnp.nan))
    for t in (1, 5):
        np.testing.assert_array_equal(np.asarray(m(x[:, :t])), before[t])
    m.set_execution("dense")
    assert np.isnan(np.asarray(m(x))).all()


def test_bad_input_is_one_line_errors():
    with pytest.raises(ValueError, match=r"MoE n_used: expected an integer in \[1, "
                                         r"n_experts=7\], got 9"):
        _moe(k=9)
    base = dict(arch="llama", vocab_size=50, d_model=D, n_layers=1, n_heads=2, n_kv_heads=2,
                head_dim=12, d_ff=F, max_seq_len=16)
    with pytest.raises(ValueError, match=r"ModelConfig.n_experts_used: expected an integer in "
                                         r"\[1, n_experts=4\].*got 5"):
        ModelConfig(**base, n_experts=4, n_experts_used=5)
    with pytest.raises(ValueError, match=r"ModelConfig.n_experts_used: expected 0"):
        ModelConfig(**base, n_experts_used=2)
    from powerinfer_jax.models.ffn import Selector

    with pytest.raises(ValueError, match=r"MoE FFN selector: expected None"):
        _moe().set_selector(Selector())
    with pytest.raises(ValueError, match=r"MoE execution: expected one of"):
        _moe().set_execution("fast")


def test_router_shape_mismatch_names_the_tensor():
    from powerinfer_jax.checkpoint.base import expected_shapes
    from powerinfer_jax.models.transformer import from_params

    c = ModelConfig(arch="llama", vocab_size=50, d_model=D, n_layers=1, n_heads=2,
                    n_kv_heads=2, head_dim=12, d_ff=F, max_seq_len=16, n_experts=E,
                    n_experts_used=2)
    params = {k: np.zeros(s, np.float32) for k, s in expected_shapes(c).items()}
    params["layers.0.ffn.router.weight"] = np.zeros((E - 1, D), np.float32)
    with pytest.raises(ValueError, match=r"tensor layers.0.ffn.router.weight: expected shape "
                                         r"\(7, 24\), got \(6, 24\)"):
        from_params(c, params, kernels="xla")
