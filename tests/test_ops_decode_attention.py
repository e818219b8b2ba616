"""ops.decode_attention (one custom call per layer for a decode token) against the XLA attention
path of models/layers.py, which stays the reference and the prefill path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.ops import _ffi
from powerinfer_jax.models.layers import Attention, cache_storage_dtype, from_cache, to_cache
from powerinfer_jax.models.rope import Rope, base_inv_freq


def _attention(nh, nk, h, *, rope=True, seed=0, **options):
    return Attention(d_model=48, n_heads=nh, n_kv_heads=nk, head_dim=h, bias=False,
                     rope=Rope(tuple(base_inv_freq(h, 10000.0).tolist())) if rope else None,
                     dtype=jnp.float32, rngs=nnx.Rngs(seed), kernels="ffi", **options)


def _cache(rng, s, nk, h, storage, filled):
    """A cache whose first `filled` slots hold earlier tokens' keys/values, the rest zeros."""
    vals = np.zeros((1, s, nk, h), np.float32)
    vals[:, :filled] = rng.standard_normal((1, filled, nk, h))
    return to_cache(jnp.asarray(vals), storage)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("nh,nk,h,rope", [(4, 2, 16, True), (9, 3, 64, True), (2, 2, 8, False)])
@pytest.mark.parametrize("position,kv_len", [(0, 16), (5, 16), (15, 16), (40, 64)])
def test_matches_the_xla_path(cache_dtype, nh, nk, h, rope, position, kv_len):
    attn = _attention(nh, nk, h, rope=rope)
    storage = cache_storage_dtype(cache_dtype)
    rng = np.random.default_rng(position)
    x = jnp.asarray(rng.standard_normal((1, 1, 48)), jnp.float32)
    pos = jnp.full((1, 1), position, jnp.int32)
    outs = {}
    for kernels in ("xla", "ffi"):
        attn.kernels = kernels
        cache = (_cache(np.random.default_rng(1), 64, nk, h, storage, position),
                 _cache(np.random.default_rng(2), 64, nk, h, storage, position))
        step = jax.jit(lambda x, c, i: attn(x, pos, c, i, kv_len), donate_argnums=1)
        outs[kernels] = step(x, cache, jnp.int32(position))
    (y_x, (k_x, v_x)), (y_f, (k_f, v_f)) = outs["xla"], outs["ffi"]
    tol = "regrouped" if cache_dtype == jnp.float32 else "bf16_cache"
    assert_close(y_f, y_x, tol)
    assert_close(from_cache(k_f), from_cache(k_x), tol)
    np.testing.assert_array_equal(np.asarray(v_f), np.asarray(v_x))  # values are not roped
    untouched = np.ones(64, bool)
    untouched[position] = False
    np.testing.assert_array_equal(np.asarray(k_f)[0, untouched], np.asarray(k_x)[0, untouched])


FEATURES = {  # the families' attention features (models/layers.py Attention's arguments)
    "softcap": dict(softcap=5.0),
    "window": dict(window=7),
    "qk_norm": dict(qk_norm_eps=1e-6),
    "scale": dict(scale=0.11),
    "gemma2": dict(softcap=5.0, window=7, scale=0.2),
    "gemma3": dict(qk_norm_eps=1e-6, window=7),
}


def _randomize_norms(attn, seed):
    rng = np.random.default_rng(seed)
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            norm.scale.set_value(jnp.asarray(rng.normal(1.0, 0.4, norm.scale.shape), jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("nh,nk,h", [(4, 2, 16), (8, 2, 64), (3, 1, 32)])
@pytest.mark.parametrize("position", [3, 40])
def test_family_features_match_the_xla_path(feature, nh, nk, h, position):
    """Soft-capped scores, a sliding window (position 40 sees slots 34..40 only), per-head q/k
    RMSNorm before the rotation, a query scale, and scaled RoPE frequencies with a cos/sin
    factor (YaRN's): the custom call equals the XLA path, grouped and per-head kernels."""
    from powerinfer_jax.config import RopeScaling
    from powerinfer_jax.models.rope import scaled_inv_freq

    inv, factor = scaled_inv_freq(h, 10000.0, RopeScaling("yarn", factor=4.0,
                                                          original_max_position=16))
    attn = Attention(d_model=48, n_heads=nh, n_kv_heads=nk, head_dim=h, bias=False,
                     rope=Rope(tuple(inv.tolist()), factor), dtype=jnp.float32,
                     rngs=nnx.Rngs(0), kernels="ffi", **FEATURES[feature])
    _randomize_norms(attn, 1)
    storage = cache_storage_dtype(jnp.float32)
    x = jnp.asarray(np.random.default_rng(position).standard_normal((1, 1, 48)), jnp.float32)
    pos = jnp.full((1, 1), position, jnp.int32)
    outs = {}
    for kernels in ("xla", "ffi"):
        attn.kernels = kernels
        cache = (_cache(np.random.default_rng(1), 64, nk, h, storage, position),
                 _cache(np.random.default_rng(2), 64, nk, h, storage, position))
        step = jax.jit(lambda x, c, i: attn(x, pos, c, i, 64), donate_argnums=1)
        outs[kernels] = step(x, cache, jnp.int32(position))
    (y_x, (k_x, _)), (y_f, (k_f, _)) = outs["xla"], outs["ffi"]
    assert_close(y_f, y_x, "regrouped")
    assert_close(k_f, k_x, "regrouped")


def test_the_window_reads_only_the_last_slots():
    """With a window, slots before it do not change the output (they are not read)."""
    attn = _attention(4, 2, 16, window=5)
    storage = cache_storage_dtype(jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 48)), jnp.float32)
    pos = jnp.full((1, 1), 20, jnp.int32)
    step = jax.jit(lambda x, c, i: attn(x, pos, c, i, 32))
    a = (_cache(np.random.default_rng(1), 32, 2, 16, storage, 20),
         _cache(np.random.default_rng(2), 32, 2, 16, storage, 20))
    b = tuple(c.at[:, :16].set(7.0) for c in a)  # slots 0..15: outside the window 16..20
    np.testing.assert_array_equal(np.asarray(step(x, a, jnp.int32(20))[0]),
                                  np.asarray(step(x, b, jnp.int32(20))[0]))


@pytest.mark.slow
@pytest.mark.parametrize("nh,nk,h", [(9, 3, 64), (8, 2, 64), (2, 2, 128), (10, 2, 64)])
def test_grouped_heads_and_pool_paths_match_xla_and_each_other(nh, nk, h):
    """Long enough (position 200) for the pool: KV-head tasks for groups of 1-4 with 64- or
    128-dim heads, per-head tasks otherwise (group 5); 1 and 2 threads give the same bits."""
    attn = _attention(nh, nk, h)
    storage = cache_storage_dtype(jnp.bfloat16)
    position, s = 200, 256
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, 1, 48)), jnp.float32)
    pos = jnp.full((1, 1), position, jnp.int32)
    outs, before = {}, _ffi.get_num_threads()
    for kernels, threads in (("xla", 2), ("ffi", 1), ("ffi", 2)):
        attn.kernels = kernels
        ops.set_num_threads(threads)
        cache = (_cache(np.random.default_rng(1), s, nk, h, storage, position),
                 _cache(np.random.default_rng(2), s, nk, h, storage, position))
        step = jax.jit(lambda x, c, i: attn(x, pos, c, i, s), donate_argnums=1)
        outs[kernels, threads] = np.asarray(step(x, cache, jnp.int32(position))[0])
    ops.set_num_threads(before)
    np.testing.assert_array_equal(outs["ffi", 1], outs["ffi", 2])
    assert_close(outs["ffi", 2], outs["xla", 2], "bf16_cache")


def test_engine_tokens_match_the_xla_path():
    """Greedy decode of a tiny model: the custom call and the XLA path pick the same tokens."""
    from helpers_models import tiny_llama_config
    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.runtime.decode import Engine

    tokens = {}
    for kernels in ("xla", "ffi"):
        model = Transformer(tiny_llama_config(), rngs=nnx.Rngs(0), kernels=kernels)
        tokens[kernels] = Engine(model, max_seq_len=64).generate([1, 5, 9, 3],
                                                                 max_new_tokens=20).tokens
    assert tokens["ffi"] == tokens["xla"]


def test_bad_input_is_a_clear_error():
    storage = jnp.float32
    kc = jnp.zeros((1, 16, 2, 8), storage)
    q, kv = jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 16))
    where = jnp.asarray([3, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"kv_len: expected a static int in \[1, S = 16\]"):
        ops.decode_attention(q, kv, kv, kc, kc, where, kv_len=17)
    with pytest.raises(ValueError, match=r"v_cache: expected k_cache's dtype and shape"):
        ops.decode_attention(q, kv, kv, kc, kc[:, :8], where, kv_len=8)
    with pytest.raises(ValueError, match=r"k_new shape: expected one token of NK \* H = 16"):
        ops.decode_attention(q, kv[..., :8], kv, kc, kc, where, kv_len=8)
    with pytest.raises(ValueError, match=r"inv_freq shape: expected \[4\]"):
        ops.decode_attention(q, kv, kv, kc, kc, where, kv_len=8, inv_freq=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"q_norm/k_norm: expected both given or both None"):
        ops.decode_attention(q, kv, kv, kc, kc, where, kv_len=8, q_norm=np.ones(8, np.float32))
    with pytest.raises(ValueError, match=r"softcap: expected >= 0, got -1.0"):
        ops.decode_attention(q, kv, kv, kc, kc, where, kv_len=8, softcap=-1.0)
    with pytest.raises(ValueError, match=r"window: expected an int >= 0"):
        ops.decode_attention(q, kv, kv, kc, kc, where, kv_len=8, window=-2)
    with pytest.raises(ValueError, match=r"q shape: expected one token of NH \* H values"):
        ops.decode_attention(q[..., :24], kv, kv, kc, kc, where, kv_len=8)
    # The slot is data: checked by the handler at run time.
    with pytest.raises(Exception, match=r"decode_attention: slot, position: expected "
                                        r"0 <= slot < kv_len = 8"):
        jax.block_until_ready(ops.decode_attention(q, kv, kv, kc, kc,
                                                   jnp.asarray([8, 8], jnp.int32), kv_len=8)[0])
    # The optional vectors, checked again by the handler called without the Python layer.
    raw = dict(kv_len=8, inv_freq=None, rope_factor=1.0, scale=0.0, softcap=0.0, window=0,
               q_norm=None, k_norm=None, norm_eps=1e-6)
    for change, msg in ((dict(inv_freq=np.ones(3)), r"inv_freq: expected float32 \[4\] or absent"),
                        (dict(q_norm=np.ones(7), k_norm=np.ones(8)),
                         r"q_norm: expected float32 \[8\] or absent"),
                        (dict(q_norm=np.ones(8)), r"q_norm, k_norm: expected both present or "
                                                  r"both absent")):
        with pytest.raises(Exception, match="decode_attention: " + msg):
            jax.block_until_ready(_ffi.decode_attention(q, kv, kv, kc, kc, where.reshape(1, 2),
                                                        **{**raw, **change})[0])
