"""Tensor parallel over a JAX mesh (runtime/mesh.py) on 4 CPU devices.

XLA makes several host devices only when told before JAX starts
(XLA_FLAGS=--xla_force_host_platform_device_count=4), so `test_cases_on_4_host_devices` runs this
module again in a subprocess with the flag (started when the suite's collection ends, beside the
other tests: helpers_background); there every other test runs, here they skip.

Invariants: a model sharded over the devices gives the unsharded model's logits (float
tolerance: the partial sums are added in another order) and greedy tokens, dense and sparse
(oracle, q4 predictor scores, q4 activations), with XLA's kernels and with the custom calls run
per shard, unplaced and placed hot/cold (CPU hybrid); the active counts `capture` reports are the
unsharded ones; shapes that do not divide fail with one clear error.
"""
import os
import sys

import numpy as np
import pytest

import helpers_background

N = 4
CHILD = os.environ.get("PIJ_MESH_CHILD") == "1"
child_only = pytest.mark.skipif(not CHILD, reason="runs in test_cases_on_4_host_devices' child")


def _start_child():
    """This module's child cases, in the background from the suite's start (helpers_background)."""
    env = {**os.environ, "PIJ_MESH_CHILD": "1",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={N}".strip()}
    helpers_background.start("mesh", [sys.executable, "-m", "pytest", "-q", "-p",
                                      "no:cacheprovider", "-rs", __file__],
                             env=env, cwd=os.path.dirname(os.path.dirname(__file__)))


if not CHILD:  # the child's own session must not start another child
    BACKGROUND = {"test_cases_on_4_host_devices": _start_child}


@pytest.mark.slow
def test_cases_on_4_host_devices():
    if CHILD:
        pytest.skip("this is the child")
    r = helpers_background.finish("mesh", timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-3000:]


# ------------------------------------------------------------------------ the child's cases
if CHILD:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from helpers_models import q4_selector, tiny_llama_config, with_mode
    from helpers_tolerances import assert_close
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.errors import UserError
    from powerinfer_jax.models.hybrid import apply_placement
    from powerinfer_jax.models.transformer import Transformer, capture
    from powerinfer_jax.runtime import mesh
    from powerinfer_jax.runtime.decode import Engine
    from powerinfer_jax.sparsity import placement as pl

    # 8 query heads over 4 KV heads, F = 4 * 13: all divide by 4; D, H, V do not need to
    CFG = tiny_llama_config(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=6,
                            d_ff=52, max_seq_len=64)
    OPT = CFG.replace(arch="opt", gated=False, bias=True, norm="layer", positions="learned",
                      position_offset=2, activation="relu", tie_embeddings=True)
    TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 9)))
    PROMPT = [5, 17, 42, 7, 99, 3]
    ORACLE = SparsityConfig(mode="oracle", threshold=0.3)


def pair(cfg, kernels, dtype="float32", setup=None, frac=None, seed=0):
    """Two identical models (same seed), `setup(model)` applied to both, placed at `frac` of
    the FFN bytes when given; the second sharded over N devices."""
    models = []
    for _ in range(2):
        m = Transformer(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed), kernels=kernels)
        if setup is not None:
            setup(m)
        if frac is not None:
            s = pl.model_bytes(m, kv_len=cfg.max_seq_len)
            freqs = [np.random.default_rng(seed + l).random(cfg.d_ff) for l in range(cfg.n_layers)]
            p = mesh.round_placement(pl.place("hybrid", freqs, s, s.dense + int(frac * s.ffn)),
                                     N, freqs)
            assert any(0 < h < cfg.d_ff for h in p.hot) and all(h % N == 0 for h in p.hot)
            apply_placement(m, p)
        models.append(m)
    mesh.shard_model(models[1], N)
    return models


def forward(m):
    """(logits, n_active [L, B, T] or None) of one jitted uncached pass (eager calls of a
    sharded model re-trace shard_map on every op: slow)."""
    graphdef, state = nnx.split(m)

    @jax.jit
    def run(state):
        logits, sown = capture(lambda mm: mm(TOKENS), nnx.merge(graphdef, state))
        return logits, sown.get("n_active")

    logits, n_active = run(state)
    return np.asarray(logits), None if n_active is None else np.asarray(n_active)


def check_equal(ref, tp, dtype="float32", *, expect_sparse=False, tokens=False):
    (want, n_want), (got, n_got) = forward(ref), forward(tp)
    assert_close(got, want, f"sharded_{dtype}")
    if n_want is not None:
        np.testing.assert_array_equal(n_got, n_want)
        if expect_sparse:
            assert 0 < n_want.mean() < ref.config.d_ff, n_want.mean()
    if tokens:
        out = [Engine(m, max_seq_len=32).generate(PROMPT, max_new_tokens=8).tokens
               for m in (ref, tp)]
        assert out[0] == out[1]


@child_only
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_dense_equals_one_device(kernels):
    ref, tp = pair(CFG, kernels)
    leaf = tp.layers[0].ffn.up.weight[...]
    assert len(leaf.sharding.device_set) == N and leaf.addressable_shards[0].data.shape == (13, 64)
    check_equal(ref, tp, tokens=kernels == "ffi")


@child_only
def test_oracle_equals_one_device():
    ref, tp = pair(CFG, "ffi", setup=lambda m: with_mode(m, ORACLE))
    check_equal(ref, tp, expect_sparse=True)


@child_only
@pytest.mark.parametrize("gate_up", ["full", "q4"])
def test_q4_predictor_equals_one_device(gate_up):
    """The predictor's packed rows (per-neuron state) are split with the neurons."""
    def setup(m):
        for layer in m.layers:
            layer.ffn.set_selector(q4_selector(layer.ffn, 0.3, gate_up=gate_up))
    ref, tp = pair(CFG, "ffi", setup=setup)
    q = tp.layers[1].ffn.selector.predictor.q[...]
    assert q.addressable_shards[0].data.shape[0] == CFG.d_ff // N
    check_equal(ref, tp, expect_sparse=True)


@child_only
def test_bfloat16_equals_one_device():
    ref, tp = pair(CFG, "ffi", dtype="bfloat16", setup=lambda m: with_mode(m, ORACLE))
    check_equal(ref, tp, "bfloat16")


@child_only
@pytest.mark.parametrize("mode", ["oracle", "q4"])
def test_placed_hot_cold_equals_one_device(mode):
    """CPU hybrid: hot and cold rows each split over the devices; a predictor's rows are
    reordered so each shard holds its hot rows, then its cold rows."""
    def setup(m):
        if mode == "oracle":
            with_mode(m, ORACLE)
        elif mode == "q4":
            for layer in m.layers:
                layer.ffn.set_selector(q4_selector(layer.ffn, 0.3))
    ref, tp = pair(CFG, "ffi", setup=setup, frac=0.4)
    cold = tp.layers[0].ffn.cold["up"][...]
    assert cold.addressable_shards[0].data.shape[0] == cold.shape[0] // N
    check_equal(ref, tp, expect_sparse=mode != "dense", tokens=mode == "q4")


def random_biases(m):
    """Biases start at zero; give every one a value (seeded by its place) so each counts."""
    rng = np.random.default_rng(7)
    for layer in m.layers:
        for lin in (layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, layer.ffn.up,
                    layer.ffn.down_t):
            lin.bias.set_value(jnp.asarray(rng.normal(0, 0.5, lin.bias.shape), jnp.float32))


@child_only
def test_opt_biases_count_once():
    """o and down biases follow a partial sum: added once, not once per device."""
    ref, tp = pair(OPT, "ffi", setup=lambda m: with_mode(random_biases(m) or m, ORACLE))
    check_equal(ref, tp, tokens=True)


def family_configs():
    """CFG with each new family's features (issue 34): q/k/v biases (Qwen2); q/k norms and a
    YaRN scaling (Qwen3); GeGLU, post-norms, embedding and query scales, both soft-caps and a
    sliding window (Gemma-2); q/k norms, post-norms, a window with its own RoPE base and a
    linear-scaled global RoPE, tied head (Gemma-3). Windows of 4 < the positions run."""
    from powerinfer_jax.config import RopeScaling

    gemma = dict(activation="gelu", post_norms=True, embed_scale=8.0, layer_windows=(4, 0))
    return {
        "qwen2": CFG.replace(qkv_bias=True),
        "qwen3": CFG.replace(qk_norm=True, rope_scaling=RopeScaling(
            "yarn", factor=4.0, original_max_position=16)),
        "gemma2": CFG.replace(**gemma, query_scale=0.3, attn_softcap=5.0, final_softcap=8.0),
        "gemma3": CFG.replace(**gemma, qk_norm=True, rope_local_theta=10.0,
                              rope_scaling=RopeScaling("linear", factor=4.0),
                              tie_embeddings=True),
    }


def random_family_params(m):
    """q/k norms, post-norms and q/k/v biases start at 1 or 0: give each a value."""
    rng = np.random.default_rng(11)
    for layer in m.layers:
        vs = [layer.attn.q.bias, layer.attn.k.bias, layer.attn.v.bias]
        for norm in (layer.attn.q_norm, layer.attn.k_norm, layer.attn_post_norm,
                     layer.ffn_post_norm):
            if norm is not None:
                vs.append(norm.scale)
        for v in vs:
            if v is not None:
                v.set_value(jnp.asarray(rng.normal(1.0, 0.3, v.shape), jnp.float32))
    return m


@child_only
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_family_features_equal_one_device(family):
    """Each shard runs its heads with the family's norms, biases, soft-caps and windows (the
    decode custom call per shard for the tokens); the post-norms see the summed shards."""
    ref, tp = pair(family_configs()[family], "ffi",
                   setup=lambda m: with_mode(random_family_params(m), ORACLE))
    check_equal(ref, tp, expect_sparse=True, tokens=True)


MOE = dict(n_experts=8, n_experts_used=2, d_ff=24)  # 2 of the 8 experts on each device


@child_only
@pytest.mark.parametrize("shared", [0, 16])
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_moe_experts_split_equal_one_device(shared, kernels):
    """Float experts, 2 of 8 on each device (expert parallelism) beside the split heads: the
    unsharded logits, tokens and routing (capture's expert ids, every shard's the same)."""
    cfg = CFG.replace(**MOE, d_ff_shared=shared)
    ref, tp = pair(cfg, kernels)
    leaf = tp.layers[0].ffn.experts.up.weight[...]
    assert leaf.addressable_shards[0].data.shape == (2, 24, 64)
    check_equal(ref, tp, tokens=kernels == "ffi")
    ids = [capture(lambda mm: mm(TOKENS), m)[1]["expert_ids"] for m in (ref, tp)]
    np.testing.assert_array_equal(np.asarray(ids[1]), np.asarray(ids[0]))


@child_only
@pytest.mark.parametrize("activation", ["silu", "relu"])
def test_moe_file_experts_split_equal_one_device(tmp_path, activation):
    """A synthetic Qwen3-MoE file (16 experts, 4 per token), dequantized: its experts split 4
    to a device. Its quantized blocks (attention split by heads) and OLMoE's q/k norms over the
    whole projection are refused with one line each. (ops.moe_ffn's -1 ids, how a shard passes
    the others' experts to the quantized call: test_ops_moe_ffn.)"""
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.synthetic.moe import main

    extra = ["--activation", "relu", "--sparsity", "0.7"] if activation == "relu" else []
    main(["--shape", "qwen3-30b-a3b", "--vocab-size", "0", "--d-model", "128", "--n-layers",
          "2", "--n-heads", "4", "--n-kv-heads", "4",
          "--head-dim", "32", "--d-ff", "64", "--n-experts", "16", "--top-k", "4",
          "--calib-tokens", "512", "--verify-tokens", "0", *extra, "--out", str(tmp_path)])
    path = next(tmp_path.glob("*.gguf"))
    models = []
    for _ in range(2):
        ck = load_checkpoint(path)
        models.append(from_params(ck.config, ck.params, dtype=jnp.float32, kernels="ffi"))
    mesh.shard_model(models[1], N)
    check_equal(*models, tokens=True)
    ck = load_checkpoint(path, keep_quantized=True)
    q4 = from_params(ck.config, ck.params, dtype=jnp.float32, kernels="ffi")
    with pytest.raises(UserError, match=r"devices=4: expected float attention weights"):
        mesh.shard_model(q4, N)
    olmoe = CFG.replace(**MOE, qk_norm_full=True)
    with pytest.raises(UserError, match=r"devices=4: expected 1 for q/k norms over the whole"):
        mesh.shard_model(Transformer(olmoe, rngs=nnx.Rngs(0), kernels="xla"), N)


@child_only
def test_session_build_with_devices(tmp_path):
    from helpers_models import write_tiny_gguf
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, CFG)
    one = build(str(path), RuntimeConfig(), progress=False)
    tp = build(str(path), RuntimeConfig(devices=N), progress=False)
    assert tp.model.parallel.size == N and tp.describe()["devices"] == N
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert_close(forward(tp.model)[0], forward(one.model)[0], "sharded_float32")
    assert (tp.engine.generate(ids, max_new_tokens=6).tokens
            == one.engine.generate(ids, max_new_tokens=6).tokens)


@child_only
def test_shapes_that_do_not_divide_are_rejected():
    bad = CFG.replace(n_heads=6, n_kv_heads=3)
    m = Transformer(bad, rngs=nnx.Rngs(0), kernels="xla")
    with pytest.raises(UserError, match=r"devices=4: expected a divisor of the model's n_heads"):
        mesh.shard_model(m, N)
    m = Transformer(CFG.replace(**dict(MOE, n_experts=6)), rngs=nnx.Rngs(0), kernels="xla")
    with pytest.raises(UserError, match=r"devices=4: expected a divisor of the model's "
                                        r"n_experts \(6\)"):
        mesh.shard_model(m, N)
    m = Transformer(CFG.replace(**dict(MOE, n_experts_used=3)), rngs=nnx.Rngs(0), kernels="xla")
    with pytest.raises(UserError, match=r"devices=4: expected at most n_experts / "
                                        r"n_experts_used = 2"):
        mesh.shard_model(m, N)
    with pytest.raises(UserError, match=r"devices: expected an integer in \[1, 4\]"):
        mesh.make_mesh(5)
    m = Transformer(CFG, rngs=nnx.Rngs(0), kernels="ffi")
    s = pl.model_bytes(m, kv_len=CFG.max_seq_len)
    freqs = [np.arange(CFG.d_ff, dtype=float)] * CFG.n_layers
    p = pl.place("hybrid", freqs, s, s.dense + 7 * s.neuron_bytes[0])  # 7 hot rows in all
    apply_placement(m, p)
    with pytest.raises(UserError, match=r"hot/cold rows: expected multiples of devices=4"):
        mesh.shard_model(m, N)


@child_only
def test_round_placement_moves_hot_rows_to_the_host():
    m = Transformer(CFG, rngs=nnx.Rngs(0), kernels="ffi")
    s = pl.model_bytes(m, kv_len=CFG.max_seq_len)
    freqs = [np.random.default_rng(l).random(CFG.d_ff) for l in range(CFG.n_layers)]
    p = pl.place("hybrid", freqs, s, s.dense + int(0.45 * s.ffn))
    r = mesh.round_placement(p, N, freqs)
    assert all(new % N == 0 and old - N < new <= old for old, new in zip(p.hot, r.hot))
    assert r.hot != p.hot
    assert r.order == p.order and r.served_fraction <= p.served_fraction
    total = sum(f.sum() for f in freqs)
    want = sum(f[list(o[:h])].sum() for f, o, h in zip(freqs, r.order, r.hot)) / total
    assert r.served_fraction == pytest.approx(want)
