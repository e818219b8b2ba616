"""CUDA hybrid handler (hot rows on the GPU, cold rows on the host pool via cudaLaunchHostFunc) vs
the jnp reference over all rows, and placed models on the GPU vs unplaced ones. Needs a GPU and a
PIJ_CUDA=ON build; skips otherwise (run benchmarks/gpu/build_and_test.sh on a GPU machine)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_cuda import needs_cuda
from helpers_tolerances import assert_close
from powerinfer_jax.ops import reference


pytestmark = needs_cuda


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("criterion", ["scores", "oracle"])
@pytest.mark.parametrize("n_hot", [0, 1, 150, 300])
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
    assert_close(y, want_y, "gpu_kernel")
    np.testing.assert_array_equal(np.asarray(n), np.asarray(want_n))
    assert _ffi._pij_cuda.release_cold_rows(handle)


# ------------------------------------------------------------------------------------------------
# Placed models on the GPU: cold rows in the CUDA module's host store, one hybrid call per layer
# ------------------------------------------------------------------------------------------------

def _tiny(activation, gated, bias):
    from powerinfer_jax.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=53, d_model=64, n_layers=3, n_heads=4,
                      n_kv_heads=2, head_dim=16, d_ff=97, max_seq_len=32, activation=activation)
    if not gated:
        cfg = cfg.replace(arch="opt", gated=False, bias=bias, norm="layer", positions="learned",
                          position_offset=2)
    return cfg


@pytest.mark.parametrize("kind", ["silu-gated", "relu-bias"])
@pytest.mark.parametrize("frac", [0.0, 0.3, 1.0])
def test_gpu_placed_model_equals_unplaced(kind, frac):
    from flax import nnx

    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.models.hybrid import apply_placement
    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.runtime.decode import Engine
    from powerinfer_jax.sparsity import placement as pl
    from powerinfer_jax.sparsity.predictor import Predictor

    cfg = _tiny("silu", True, False) if kind == "silu-gated" else _tiny("relu", False, True)
    from helpers_models import with_mode

    m = Transformer(cfg, rngs=nnx.Rngs(0), kernels="xla")
    preds = [Predictor(cfg.d_model, 8, cfg.d_ff, rngs=nnx.Rngs(10 + i))
             for i in range(cfg.n_layers)]

    def run(s):  # the model in mode s (predictor mode with these predictors)
        return with_mode(m, s, predictors=preds if s.mode == "predictor" else None)
    sizes = pl.model_bytes(m, kv_len=cfg.max_seq_len)
    freqs = [np.random.default_rng(l).random(cfg.d_ff) for l in range(cfg.n_layers)]
    p = pl.place("hybrid", freqs, sizes, sizes.dense + int(frac * sizes.ffn))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 53, size=(2, 7)))
    modes = {"dense": SparsityConfig(), "oracle": SparsityConfig(mode="oracle", threshold=0.05),
             "predictor": SparsityConfig(mode="predictor", threshold=0.0)}
    prompt = [3, 17, 5, 42, 8]
    with jax.default_matmul_precision("float32"):
        want = {k: np.asarray(run(s)(tokens)) for k, s in modes.items()}
        want_tokens = Engine(run(modes["oracle"]), max_seq_len=32).generate(
            prompt, max_new_tokens=8).tokens
        run(modes["predictor"])  # predictors are permuted with the neurons while placing
        apply_placement(m, p)
        for layer, h in zip(m.layers, p.hot):
            ffn = layer.ffn
            assert ffn.n_hot == h and ffn.cold is None  # no cold row is an XLA operand
            assert (ffn.cold_handle is None) == (h == cfg.d_ff)
            assert ffn.n_cold == (cfg.d_ff - h if h < cfg.d_ff else 0)
        for k, s in modes.items():  # the predictors were permuted with the neurons in place
            assert_close(run(s)(tokens), want[k], "other_path", err_msg=k)
        got = Engine(run(modes["oracle"]), max_seq_len=32).generate(prompt, max_new_tokens=8)
    assert got.tokens == want_tokens
    if frac < 1.0:
        with pytest.raises(ValueError, match="host store"):
            with_mode(m, SparsityConfig(mode="threshold"), thresholds=(0.1,) * cfg.n_layers)(
                tokens)


def test_gpu_cold_rows_reject_mismatched_dtypes():
    from powerinfer_jax.ops import _ffi

    up = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="every weight in float32"):
        _ffi.register_cold_rows(up, up.astype(np.float16))
    with pytest.raises(ValueError, match="expected float32, bfloat16 or float16"):
        _ffi.register_cold_rows(up.astype(np.int8), up.astype(np.int8))
    with pytest.raises(ValueError, match=r"down_t: expected \[4, 8\]"):
        _ffi.register_cold_rows(up, np.zeros((3, 8), np.float32))
