"""Quantized linear custom calls (GGUF blocks x int8-rounded activations) vs the jnp reference
(the gguf package's dequantization + the same activation rounding), over every block format."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.ops import _ffi

TYPES = list(quants.QUANTIZED_TYPES)


def _dim(qtype, legacy=160, k=512):
    """D for a type: not a multiple of 256 where the format allows (legacy blocks of 32)."""
    return k if quants.block_size(qtype)[0] == 256 else legacy


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert_close(got, want, "quantized")


def operands(qtype, seed, *, t=3, o=37, lead=None):
    rng = np.random.default_rng(seed)
    d = _dim(qtype)
    x = rng.standard_normal(((t,) if lead is None else lead) + (d,), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(random_blocks(qtype, o, d, rng)), d


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, 3, 8, 17])
def test_matches_reference(qtype, t):
    x, blocks, d = operands(qtype, t, t=t)
    got = jax.jit(lambda x, w: ops.qlinear(x, w, qtype, d))(x, blocks)
    _close(got, ops.qlinear(x, blocks, qtype, d, impl="reference"))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bias_type_ids_and_leading_dims(qtype):
    x, blocks, d = operands(qtype, 1, lead=(2, 3))
    b = jnp.asarray(np.random.default_rng(2).standard_normal(37), jnp.float32)
    got = ops.qlinear(x, blocks, quants.type_id(qtype), d, b)
    assert got.shape == (2, 3, 37)
    _close(got, ops.qlinear(x, blocks, qtype, d, b, impl="reference"))
    vm = jax.vmap(lambda xi: ops.qlinear(xi, blocks, qtype, d, b))(x)  # unbatched weights
    np.testing.assert_array_equal(np.asarray(vm), np.asarray(got))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q3_K", "Q5_K"])
def test_quantized_real_values_and_pool_split(qtype):
    """Weights that came from float values (gguf's quantizer where it has one, else random
    blocks), enough rows for the pool to split, prefill beyond one 64-token group."""
    rng = np.random.default_rng(3)
    d, o = _dim(qtype, legacy=576), 1000
    if qtype in quants.QUANTIZABLE_TYPES:
        blocks = quants.quantize(rng.standard_normal((o, d)).astype(np.float32) / 24, qtype)
    else:
        blocks = random_blocks(qtype, o, d, rng)
    for t in (1, 70):
        x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
        _close(ops.qlinear(x, blocks, qtype, d), ops.qlinear(x, blocks, qtype, d, impl="reference"))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("t", [1, 5])
def test_bitwise_deterministic_across_runs_and_thread_counts(qtype, t):
    rng = np.random.default_rng(4)
    d = _dim(qtype)
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    blocks = jnp.asarray(random_blocks(qtype, 700, d, rng))
    results = []
    for n in (1, 2, 2, 1):
        ops.set_num_threads(n)
        results.append(np.asarray(ops.qlinear(x, blocks, qtype, d)))
    ops.set_num_threads(2)
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_one_token_equals_its_row_in_a_prefill(qtype):
    """Decode tiles (2 rows x 1 token) and prefill tiles (2 rows x 4 tokens, a 1-row tail) run
    the same arithmetic per (row, token): bitwise equal. Legacy D = 160 is 5 blocks: the block
    pairs of the AVX-512 path and its odd last block."""
    x, blocks, d = operands(qtype, 5, t=9)
    full = np.asarray(ops.qlinear(x, blocks, qtype, d))
    for t in (0, 4, 8):
        np.testing.assert_array_equal(np.asarray(ops.qlinear(x[t], blocks, qtype, d)), full[t])


@pytest.mark.slow
def test_qlinear_many_mixed_types_equals_separate_calls():
    rng = np.random.default_rng(6)
    d = 512
    x = jnp.asarray(rng.standard_normal((1, d), dtype=np.float32))
    types = ["Q4_K", "Q4_K", "Q6_K", "Q8_0"]
    ws = [jnp.asarray(random_blocks(t, o, d, rng)) for t, o in zip(types, (512, 128, 128, 37))]
    bs = [None, jnp.asarray(rng.standard_normal(128), jnp.float32), None, None]
    got = jax.jit(lambda x, ws, bs: ops.qlinear_many(x, ws, types, d, bs))(x, ws, bs)
    assert len(got) == 4
    for g, w, t, b in zip(got, ws, types, bs):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(ops.qlinear(x, w, t, d, b)))
        _close(g, ops.qlinear(x, w, t, d, b, impl="reference"))
    ref = ops.qlinear_many(x, ws, types, d, bs, impl="reference")
    for g, r in zip(got, ref):
        _close(g, r)


@pytest.mark.slow
def test_real_smollm2_tensor():
    """The real file's Q4_1 q projection and Q8_0 embedding rows (as a product) vs the reference."""
    from helpers_models import real_gguf_path
    from powerinfer_jax.checkpoint import load_checkpoint

    path = real_gguf_path()
    if path is None:
        pytest.skip("no SmolLM2 GGUF: set PIJ_TEST_GGUF or fetch smollm2-135m into the cache")
    ck = load_checkpoint(path, keep_quantized=True)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 576), dtype=np.float32))
    for name in ("layers.3.attn.q.weight", "layers.3.ffn.up.weight", "tok_embed"):
        t = ck.params[name]
        got = ops.qlinear(x, t.blocks, t.qtype, t.shape[1])
        _close(got, ops.qlinear(x, t.blocks, t.qtype, t.shape[1], impl="reference"))
        # and against the float param itself: only the activation rounding differs (~1%)
        want = np.asarray(x) @ t.dequantize().T
        assert np.abs(np.asarray(got) - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.parametrize("bad,match", [
    (dict(qtype="Q7_0"), r"qtype: expected one of \['Q4_0'.*got 'Q7_0'"),
    (dict(qtype="F16"), r"qtype: expected one of .*got 'F16' \(float weights take ops.linear"),
    (dict(qtype=15), r"qtype: expected one of .*got 15"),
    (dict(in_features=100), r"in_features: expected x's last dim \(160\)"),
    (dict(blocks=np.zeros((37, 99), np.uint8)),
     r"blocks: expected uint8 \[R, 100\] \(5 Q4_1 blocks of 20 bytes per row of 160\), got "
     r"'uint8 \(37, 99\)' \(a truncated row, or blocks of another type\)"),
    (dict(blocks=np.zeros((37, 100), np.int8)), r"blocks: expected uint8 \[R, 100\]"),
    (dict(blocks=np.zeros((100,), np.uint8)), r"blocks: expected uint8"),
    (dict(b=np.zeros(36, np.float32)), r"b shape: expected \[O\] = \(37,\)"),
    (dict(x=np.zeros((3, 160), np.int32)), r"x: expected a floating array"),
])
def test_bad_input_is_a_clear_error(bad, match):
    x, blocks, d = operands("Q4_1", 8)
    args = {**dict(x=x, blocks=blocks, qtype="Q4_1", in_features=d, b=None), **bad}
    with pytest.raises(ValueError, match=match):
        ops.qlinear(args["x"], args["blocks"], args["qtype"], args["in_features"], args["b"])


def test_k_quant_needs_whole_super_blocks():
    x = jnp.zeros((1, 160), jnp.float32)
    with pytest.raises(ValueError, match=r"in_features \(x's last dim\): expected a positive "
                                         r"multiple of the Q4_K block \(256\), got 160"):
        ops.qlinear(x, np.zeros((4, 90), np.uint8), "Q4_K", 160)


def test_handler_validates_too():
    """The FFI layer directly (no Python checks) fails cleanly: unknown id, D not a whole number
    of blocks, truncated rows, bias, and qlinear_many's per-operand checks."""
    x, blocks, d = operands("Q4_1", 9)
    with pytest.raises(Exception,
                       match=r"qlinear: blocks qtype: expected a GGML block type id.*got 1"):
        jax.block_until_ready(_ffi.qlinear(x, blocks, "F16", None))
    with pytest.raises(Exception, match=r"qlinear: x's last dim D \(blocks in Q4_K\): expected a "
                                        r"positive multiple of the Q4_K block \(256\), got 160"):
        jax.block_until_ready(_ffi.qlinear(x, blocks, "Q4_K", None))
    with pytest.raises(Exception,
                       match=r"qlinear: blocks: expected uint8 \[R, 100\].*got uint8 \[37, 98\]"):
        jax.block_until_ready(_ffi.qlinear(x, blocks[:, :98], "Q4_1", None))
    with pytest.raises(Exception, match=r"qlinear: bias: expected float32 \[37\] or absent"):
        jax.block_until_ready(_ffi.qlinear(x, blocks, "Q4_1", jnp.zeros(5)))
    with pytest.raises(Exception, match=r"qlinear: \[1\] blocks: expected uint8 \[R, 120\]"):
        jax.block_until_ready(_ffi.qlinear_many(x, [blocks, blocks], ["Q4_1", "Q5_1"],
                                                [None, None]))


def test_qlinear_many_bad_input_is_a_clear_error():
    x, blocks, d = operands("Q4_1", 10)
    with pytest.raises(ValueError, match="as many qtypes and biases"):
        ops.qlinear_many(x, [blocks, blocks], ["Q4_1"], d)
    with pytest.raises(ValueError, match=r"blocks: expected uint8 \[R, 120\]"):
        ops.qlinear_many(x, [blocks, blocks], ["Q4_1", "Q5_1"], d)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_qembedding_rows_dequantized(qtype):
    """An embedding lookup on a quantized table: the rows' values, nothing else expanded."""
    rng = np.random.default_rng(18)
    d = _dim(qtype)
    table = jnp.asarray(random_blocks(qtype, 53, d, rng))
    ids = jnp.asarray([[0, 52, 7], [7, 3, 3]], jnp.int32)
    got = jax.jit(lambda i, t: ops.qembedding(i, t, qtype, d))(ids, table)
    want = quants.dequantize(np.asarray(table), qtype)[np.asarray(ids)]
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(ops.qembedding(ids, table, qtype, d,
                                                            impl="reference")), want)
    with pytest.raises(Exception, match=r"qembedding: ids: expected rows of the table, in "
                                        r"\[0, 53\), got 53"):
        jax.block_until_ready(ops.qembedding(jnp.asarray([1, 53]), table, qtype, d))


@pytest.mark.slow
@pytest.mark.parametrize("qtype,bad", [("Q4_1", np.nan), ("Q8_0", np.inf), ("Q4_K", np.nan)])
def test_non_finite_input_reaches_the_output(qtype, bad):
    """A NaN/inf activation makes its token's outputs NaN (as a float matmul would), never a
    garbage int8 cast; other tokens are untouched."""
    x, blocks, d = operands(qtype, 16, t=2)
    x = x.at[1, 3].set(bad)
    y = np.asarray(ops.qlinear(x, blocks, qtype, d))
    ref = np.asarray(ops.qlinear(x, blocks, qtype, d, impl="reference"))
    assert np.all(np.isnan(y[1])) and np.all(np.isnan(ref[1]))
    _close(y[:1], ref[:1])
