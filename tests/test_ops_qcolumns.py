"""The columns layout (cpu_backend/qcolumns.h): a quantized matrix stored input-channel-major, read
by ops.qlinear only where its input's 8-bit activation is nonzero. Arranging keeps every value of
the file; the product equals the rows kernel and the jnp reference on any mask, the vector path
equals the portable one bitwise, and bad operands are one-line errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.models.qweights import COLUMNS, columns
from powerinfer_jax.ops import _ffi

TYPES = list(quants.COLUMNS_BASE_TYPES)


def _case(qtype, seed, *, o=192, t=3, zero=0.5):
    """A random matrix (o rows: a pair of tiles and a single one) and t tokens with about
    `zero` of their channels zeroed (per token, independently)."""
    rng = np.random.default_rng(seed)
    d = 512 if quants.block_size(qtype)[0] == 256 else 160
    blocks = random_blocks(qtype, o, d, rng)
    x = rng.standard_normal((t, d), dtype=np.float32)
    x[rng.random((t, d)) < zero] = 0.0
    return blocks, x, d


@pytest.mark.parametrize("qtype", TYPES)
def test_arranging_keeps_the_files_values(qtype):
    blocks, _, d = _case(qtype, 0)
    w = columns(blocks, qtype)
    assert w.layout == COLUMNS and w.kernel_qtype == qtype + quants.COLUMNS_SUFFIX
    want = np.zeros((blocks.shape[0], d), np.float32)
    _ffi._pij_ext.dequantize_into(blocks, quants.type_id(qtype), want)
    np.testing.assert_array_equal(quants.columns_to_float(np.asarray(w.blocks), qtype, d), want)
    got = np.zeros_like(want)
    _ffi._pij_ext.dequantize_columns(np.asarray(w.blocks), quants.type_id(qtype), got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, pytest.param(2, marks=pytest.mark.slow), 5])
def test_product_equals_rows_kernel_reference_and_portable(qtype, t):
    blocks, x, d = _case(qtype, t, t=t)
    w = columns(blocks, qtype)
    name = w.kernel_qtype
    got = np.asarray(jax.jit(lambda x, b: ops.qlinear(x, b, name, d))(x, w.blocks))
    rows = np.asarray(ops.qlinear(x, blocks, qtype, d))
    ref = np.asarray(ops.qlinear(x, w.blocks, name, d, impl="reference"))
    assert_close(got, rows, "quantized")
    assert_close(got, ref, "quantized")
    portable = np.zeros_like(got)
    _ffi._pij_ext.qlinear_columns_portable(x, np.asarray(w.blocks), quants.type_id(qtype),
                                           portable)
    if t > 1:  # rows split over the pool: the portable loops' bits
        np.testing.assert_array_equal(got, portable)
    else:  # decode splits the input per thread: one thread, one range, the same bits
        with _one_thread():
            one = np.asarray(ops.qlinear(x, w.blocks, name, d))
        np.testing.assert_array_equal(one, portable)


@pytest.mark.parametrize("qtype", [q if q in ("Q4_0", "Q6_K") else pytest.param(
    q, marks=pytest.mark.slow) for q in TYPES])
@pytest.mark.parametrize("o", [2048, 2112])
def test_one_token_short_and_long_ranges_equal_portable(qtype, o):
    """One token reads a range of at most 2048 rows channel after channel (its sums in memory
    between channel groups) and a longer one line after line: either way the portable loops'
    bits, and the dense rows kernel's values."""
    blocks, x, d = _case(qtype, o, o=o, t=1, zero=0.4)
    w = columns(blocks, qtype)
    portable = np.zeros((1, o), np.float32)
    _ffi._pij_ext.qlinear_columns_portable(x, np.asarray(w.blocks), quants.type_id(qtype),
                                           portable)
    with _one_thread():
        one = np.asarray(ops.qlinear(x, w.blocks, w.kernel_qtype, d))
    np.testing.assert_array_equal(one, portable)
    assert_close(one, np.asarray(ops.qlinear(x, blocks, qtype, d)), "quantized")


class _one_thread:
    def __enter__(self):
        self.before = _ffi.get_num_threads()
        ops.set_num_threads(1)

    def __exit__(self, *exc):
        ops.set_num_threads(self.before)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_skipped_channels_change_no_bit(qtype):
    """A token's result does not depend on the other tokens of the call (their union of channels
    is read: the same bits as alone, on one thread) nor, for several tokens, on the thread
    count; decode with the same threads gives the same bits every time."""
    blocks, x, d = _case(qtype, 7, t=4, zero=0.6)
    w = columns(blocks, qtype)
    f = jax.jit(lambda x: ops.qlinear(x, w.blocks, w.kernel_qtype, d))
    batch = np.asarray(f(x))
    with _one_thread():
        for i in range(4):
            np.testing.assert_array_equal(np.asarray(f(x[i:i + 1]))[0], batch[i])
    first = np.asarray(f(x[:1]))
    np.testing.assert_array_equal(np.asarray(f(x[:1])), first)
    before = _ffi.get_num_threads()
    try:
        for n in (1, 3):
            ops.set_num_threads(n)
            np.testing.assert_array_equal(np.asarray(f(x)), batch)
    finally:
        ops.set_num_threads(before)


def test_all_zero_input_gives_the_bias():
    blocks, x, d = _case("Q4_0", 3, t=2, zero=1.0)
    w = columns(blocks, "Q4_0")
    b = np.arange(blocks.shape[0], dtype=np.float32)
    got = np.asarray(ops.qlinear(x, w.blocks, w.kernel_qtype, d, b))
    np.testing.assert_array_equal(got, np.broadcast_to(b, got.shape))


def test_no_columns_layout_is_left_to_the_caller():
    rng = np.random.default_rng(1)
    assert columns(random_blocks("Q4_0", 96, 64, rng), "Q4_0") is None  # 96 rows: not tiles
    assert columns(random_blocks("Q5_0", 64, 64, rng), "Q5_0") is None  # no such layout


def test_bad_operands_are_one_line_errors():
    blocks, x, d = _case("Q4_0", 2)
    w = columns(blocks, "Q4_0")
    with pytest.raises(ValueError, match="blocks"):
        ops.qlinear(x, np.asarray(w.blocks)[:, :-1], w.kernel_qtype, d)
    with pytest.raises(ValueError, match="multiple of 64 rows"):
        ops.qlinear(x, np.asarray(w.blocks)[:100], w.kernel_qtype, d)
    with pytest.raises(ValueError, match="arrange_columns"):
        _ffi._pij_ext.arrange_columns(blocks[:100], quants.type_id("Q4_0"), d,
                                      np.zeros((100, 10), np.uint8))


def test_runs_sum_reads_the_kept_runs_only():
    """benchmarks/columns_access.py times this read: it must sum the kept runs and nothing
    else (a run read short, or a skipped one read, would time the wrong bytes)."""
    rng = np.random.default_rng(0)
    run, stride, n = 48, 64, 37
    data = rng.standard_normal(n * stride).astype(np.float32)
    keep = (rng.random(n) < 0.6).astype(np.uint8)
    want = data.reshape(n, stride)[keep.astype(bool), :run].astype(np.float64).sum()
    got = _ffi._pij_ext.runs_sum(data, run, stride, keep)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="runs_sum: expected run a positive multiple of 16"):
        _ffi._pij_ext.runs_sum(data, 40, stride, keep)
    with pytest.raises(ValueError, match="one keep flag per stride"):
        _ffi._pij_ext.runs_sum(data, run, stride, keep[:-1])


def test_columns_access_refuses_bad_arguments(capsys):
    """The ceiling benchmark's inputs: a fraction outside (0, 1] or a count below its minimum is
    a one-line error, before anything is allocated or timed."""
    from benchmarks import columns_access
    from powerinfer_jax._bench_ops import runs_bandwidth_gbs

    with pytest.raises(ValueError, match=r"keep: expected a fraction in \(0, 1\], got 0"):
        runs_bandwidth_gbs(384, 448, 0.0)
    for argv in (["--threads", "0"], ["--rounds", "0"], ["--mib", "8"]):
        with pytest.raises(SystemExit) as e:
            columns_access.main(argv)
        assert e.value.code == 2
        assert "expected --threads >= 1, --rounds >= 1, --mib >= 16" in capsys.readouterr().err
