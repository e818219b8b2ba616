"""ops/qblocks.py: the one block dequantizer against the gguf package (an implementation nobody
here wrote) bit for bit, and the one activation rounding against numpy written from its rule.
The C++ twins (QuantizeActs, QuantizeQ8, the kernels' unpacking) are checked against these in
test_ops_qsparse_ffn.py, test_sparsity_q4.py and test_checkpoint_quants.py."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers_quant import random_blocks
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.ops.qblocks import JNP_FORMATS, dequantize_rows, round_activations


@pytest.mark.parametrize("qtype", [*JNP_FORMATS, "Q5_1", "Q4_K", "Q6_K"])
def test_dequantize_rows_is_the_gguf_packages_values(qtype):
    """Rows with leading axes, eager and under jit: the gguf package's floats, bit for bit (for
    the jnp formats also on raw random bytes, whose f16 scales may be NaN or infinite)."""
    rng = np.random.default_rng(7)
    cols = 512
    sets = [random_blocks(qtype, 12, cols, rng)]
    if qtype in JNP_FORMATS:
        sets.append(rng.integers(0, 256, (12, quants.row_bytes(qtype, cols)), dtype=np.uint8))
    for b in sets:
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales in raw bytes
            want = quants.dequantize(b, qtype).reshape(3, 4, cols)
        b3 = b.reshape(3, 4, -1)
        got = np.asarray(dequantize_rows(b3, qtype, cols))
        got_jit = np.asarray(jax.jit(lambda v: dequantize_rows(v, qtype, cols))(b3))
        for g in (got, got_jit):
            assert g.dtype == np.float32 and g.shape == want.shape
            np.testing.assert_array_equal(g, want)


def _numpy_rounding(x, block):
    """The rule in numpy: zero-pad to whole blocks; scale = max|x| / 127; round-half-even of
    x * (1 / scale), clipped to [-127, 127], times scale; a non-finite block is NaN. The division
    is max|x| * float32(1 / 127): XLA rewrites a division by a constant so (see qblocks)."""
    d = x.shape[-1]
    nb = -(-d // block)
    xb = np.zeros(x.shape[:-1] + (nb * block,), np.float32)
    xb[..., :d] = x
    xb = xb.reshape(x.shape[:-1] + (nb, block))
    scale = np.max(np.abs(xb), axis=-1, keepdims=True) * np.float32(1 / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(
            np.float32)
        out = np.clip(np.rint(xb * inv), -127, 127) * scale
    out = np.where(np.all(np.isfinite(xb), axis=-1, keepdims=True), out, np.nan)
    return out.reshape(x.shape[:-1] + (nb * block,))[..., :d].astype(np.float32)


@pytest.mark.parametrize("d, block", [(64, 32), (40, 32), (5, 32), (512, 256), (512, 32)])
def test_round_activations_follows_its_rule(d, block):
    """Whole and short last blocks (the q4 predictor's rows), zeros, a NaN and an infinity
    (their block only turns NaN), eager and under jit."""
    rng = np.random.default_rng(d + block)
    x = (rng.standard_normal((4, d)) * 3).astype(np.float32)
    x[1] = 0.0
    x[2, d // 2] = np.nan
    x[3, 0] = -np.inf
    want = _numpy_rounding(x, block)
    for got in (round_activations(x, block), jax.jit(lambda v: round_activations(v, block))(x)):
        got = np.asarray(got)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got, want)
    assert np.isnan(want[2]).sum() == min(block, d - d // 2 // block * block)
    assert np.all(want[1] == 0) and np.all(np.isfinite(want[0]))
