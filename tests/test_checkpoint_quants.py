"""Our numpy dequantizers against the gguf package's reference implementation."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants as ref

from powerinfer_jax.checkpoint import quants

TYPES = ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"]


def _inputs(seed):
    rng = np.random.default_rng(seed)
    yield rng.standard_normal((7, 96)).astype(np.float32)
    yield (100 * rng.standard_normal((3, 5, 64))).astype(np.float32)  # 3-D, large values
    x = rng.standard_normal((4, 32)).astype(np.float32)
    x[1] = 0.0  # an all-zero block (scale 0)
    x[2] = 1.0  # a constant block (Q4_1 min == max)
    yield x


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf_reference(qtype, seed):
    kind = GGMLQuantizationType[qtype]
    for x in _inputs(seed):
        packed = ref.quantize(x, kind)
        expected = ref.dequantize(packed, kind).astype(np.float32)
        got = quants.dequantize(packed, qtype)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got, expected)


def test_f32_passthrough_and_unknown_type():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(quants.dequantize(x, "F32"), x)
    with pytest.raises(ValueError, match="tensor type: expected one of .*got 'Q6_K'"):
        quants.dequantize(np.zeros((1, 210), np.uint8), "Q6_K")


def test_partial_block_row_is_rejected():
    with pytest.raises(ValueError, match="Q8_0 row: expected a multiple of 34 bytes, got 35"):
        quants.dequantize(np.zeros((2, 35), np.uint8), "Q8_0")
