"""GGML types: our dequantization (the gguf package's) against an independent element-by-element
decoder of llama.cpp's layouts, the kernels' own unpacking, our Q4_K quantizer, QuantTensor, and
tiny GGUF files in every type against transformers' GGUF loader."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants as ref

from helpers_models import gpt2_tokenizer_meta, random_params, tiny_llama_config
from helpers_quant import decode_block, random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import QuantTensor, load_checkpoint, quants
from powerinfer_jax.checkpoint.gguf import write_gguf

QTYPES = list(quants.QUANTIZED_TYPES)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_element_by_element_decoder(qtype):
    """Random (valid) blocks: the gguf package's vectorized dequantizer == a per-element decoder
    written from llama.cpp's dequantize_row_* == the C++ kernels' unpacking."""
    from powerinfer_jax.ops import _ffi

    block, nbytes = quants.block_size(qtype)
    cols = 2 * block
    blocks = random_blocks(qtype, 3, cols, np.random.default_rng(0))
    got = quants.dequantize(blocks, qtype)
    assert got.dtype == np.float32 and got.shape == (3, cols)
    want = np.stack([np.concatenate([decode_block(qtype, row[k * nbytes:(k + 1) * nbytes])
                                     for k in range(2)]) for row in blocks])
    assert_close(got, want, "dequantize")
    kernel = np.zeros((3, cols), np.float32)
    _ffi._pij_ext.dequantize_into(blocks, quants.type_id(qtype), kernel)
    np.testing.assert_array_equal(kernel, got)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16"])
def test_quantize_round_trips_through_gguf(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    x[1] = 0.0  # an all-zero block (scale 0)
    x[2] = 1.0  # a constant block (min == max)
    packed = quants.quantize(x, qtype)
    np.testing.assert_array_equal(
        quants.dequantize(packed, qtype),
        ref.dequantize(packed, GGMLQuantizationType[qtype]).astype(np.float32))
    bound = {"Q8_0": 0.01, "Q5_0": 0.07, "Q5_1": 0.07, "BF16": 0.01, "F16": 0.001}.get(qtype, 0.3)
    assert np.abs(quants.dequantize(packed, qtype) - x).max() < bound * np.abs(x).max()


def test_q4_k_quantizer():
    """Our Q4_K blocks decode (gguf and the per-element decoder) to within a 4-bit step."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1, :256] = 0.0
    x[2] = np.abs(x[2])  # all positive: the minimum clamps to 0
    packed = quants.quantize(x, "Q4_K")
    assert packed.shape == (4, 288)
    got = ref.dequantize(packed, GGMLQuantizationType.Q4_K)
    spec = np.stack([np.concatenate([decode_block("Q4_K", r[k * 144:(k + 1) * 144])
                                     for k in range(2)]) for r in packed])
    assert_close(got, spec, "dequantize")
    step = (x.reshape(4, 16, 32).max(-1) - np.minimum(x.reshape(4, 16, 32).min(-1), 0)) / 15
    err = np.abs(got - x).reshape(4, 16, 32).max(-1)
    assert np.all(err <= 0.6 * step + 0.02 * np.abs(x).max())  # half a step + 6-bit scale rounding
    np.testing.assert_array_equal(got[1, :256], 0.0)


def test_float_types_and_errors():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(quants.dequantize(x, "F32"), x)
    with pytest.raises(ValueError, match=r"tensor type: expected one of .*got 'IQ4_NL'"):
        quants.dequantize(np.zeros((1, 18), np.uint8), "IQ4_NL")
    with pytest.raises(ValueError, match=r"Q8_0 row: expected a multiple of 34 bytes, got 35"):
        quants.dequantize(np.zeros((2, 35), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match=r"Q4_K row length: expected a positive multiple of the "
                                         r"block size 256, got 96"):
        quants.quantize(np.zeros((2, 96), np.float32), "Q4_K")
    with pytest.raises(ValueError, match=r"quantize: type: expected one of .*got 'Q6_K'"):
        quants.quantize(np.zeros((2, 256), np.float32), "Q6_K")
    assert quants.type_id("Q4_K") == 12 and quants.row_bytes("Q6_K", 512) == 420


def test_quant_tensor():
    rng = np.random.default_rng(3)
    blocks = random_blocks("Q6_K", 5, 256, rng)
    t = QuantTensor(blocks, "Q6_K", (256, 5), transposed=True)  # like down_t: stored [5, 256]
    assert t.stored_shape == (5, 256) and t.nbytes == 5 * 210
    np.testing.assert_array_equal(t.dequantize(), quants.dequantize(blocks, "Q6_K").T)
    with pytest.raises(ValueError, match=r"Q8_0 row length: expected a positive multiple of the "
                                         r"block size 32, got 5"):
        t.reblocked("Q8_0")  # canonical rows of 5 values cannot be blocked
    with pytest.raises(ValueError, match=r"QuantTensor blocks: expected uint8 \(5, 210\)"):
        QuantTensor(blocks[:, :200], "Q6_K", (5, 256))
    # a JAX pytree: passes through jit with the type static
    f = jax.jit(lambda q: q.blocks.astype(jnp.int32).sum() + len(q.qtype))
    assert int(f(QuantTensor(blocks, "Q6_K", (5, 256)))) == int(blocks.astype(np.int64).sum()) + 4
    leaves = jax.tree.leaves({"w": QuantTensor(blocks, "Q6_K", (5, 256))})
    assert len(leaves) == 1 and leaves[0] is blocks


def test_reblocked_down_rows():
    """down_t [F, D] stored [D, F] blocked along F -> rows blocked along D, one per neuron."""
    rng = np.random.default_rng(4)
    stored = random_blocks("Q4_1", 64, 96, rng)  # [D=64, F=96]
    t = QuantTensor(stored, "Q4_1", (96, 64), transposed=True)
    for qtype, bound in (("Q8_0", 0.01), ("Q4_1", 0.1)):
        rb = t.reblocked(qtype)
        assert rb.shape == (96, 64) and not rb.transposed and rb.qtype == qtype
        assert rb.blocks.shape == (96, quants.row_bytes(qtype, 64))
        w = t.dequantize()
        assert np.abs(rb.dequantize() - w).max() < bound * np.abs(w).max()


# ----------------------------------------------------------------------- GGUF files in every type
def _k_config():
    """Rows of 256 values (D and F multiples of 256) so every tensor can be a K-quant."""
    return tiny_llama_config(d_model=256, d_ff=512, head_dim=64, n_heads=4, n_kv_heads=2)


# One type per tensor (legacy types quantized by the gguf package from float params, K-quants
# random blocks) so that every type is read, including Q/K (row permutation) and down_t.
TYPES = {"tok_embed": "Q8_0", "lm_head": "Q6_K",
         "layers.0.attn.q.weight": "Q4_K", "layers.0.attn.k.weight": "Q5_K",
         "layers.0.attn.v.weight": "Q6_K", "layers.0.attn.o.weight": "Q3_K",
         "layers.0.ffn.gate.weight": "Q2_K", "layers.0.ffn.up.weight": "Q4_0",
         "layers.0.ffn.down_t.weight": "Q4_K",
         "layers.1.attn.q.weight": "Q4_1", "layers.1.attn.k.weight": "Q5_0",
         "layers.1.attn.v.weight": "Q5_1", "layers.1.attn.o.weight": "BF16",
         "layers.1.ffn.gate.weight": "F16", "layers.1.ffn.up.weight": "Q8_0",
         "layers.1.ffn.down_t.weight": "Q6_K"}


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    config = _k_config()
    params = random_params(config)
    rng = np.random.default_rng(5)
    for name, qtype in TYPES.items():
        if qtype.endswith("_K"):  # the gguf package cannot quantize K types: random blocks
            shape = params[name].shape
            down = name.endswith("down_t.weight")
            rows, cols = shape[::-1] if down else shape
            params[name] = QuantTensor(random_blocks(qtype, rows, cols, rng), qtype, shape, down)
    path = tmp_path_factory.mktemp("kq") / "every.gguf"
    write_gguf(path, config, params, gpt2_tokenizer_meta(),
               tensor_types={n: t for n, t in TYPES.items() if not t.endswith("_K")})
    return path, config, params


def test_every_type_loads_float_and_quantized(every_type):
    path, _, params = every_type
    ck = load_checkpoint(path)
    ckq = load_checkpoint(path, keep_quantized=True)
    for name, value in ck.params.items():
        qtype = TYPES.get(name, "F32")
        assert value.dtype == np.float32, name
        if isinstance(params[name], QuantTensor):  # the blocks written, decoded
            np.testing.assert_array_equal(value, params[name].dequantize(), err_msg=name)
        kept = ckq.params[name]
        if qtype in quants.QUANTIZED_TYPES:
            assert isinstance(kept, QuantTensor) and kept.qtype == qtype, name
            assert kept.transposed == name.endswith("down_t.weight")
            np.testing.assert_array_equal(kept.dequantize(), value, err_msg=name)
        else:
            assert isinstance(kept, np.ndarray), name
            np.testing.assert_array_equal(kept, value, err_msg=name)
    q = ckq.params["layers.0.attn.q.weight"]  # Q/K blocks un-permuted with their rows
    np.testing.assert_array_equal(q.blocks, params["layers.0.attn.q.weight"].blocks)


def test_every_type_matches_transformers_gguf_loader(every_type, tmp_path):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    from test_checkpoint_gguf import _hf_to_canonical

    path, config, _ = every_type
    shutil.copy(path, tmp_path / "every.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="every.gguf")
    ck = load_checkpoint(path)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert len(state) == len(ck.params)
    for hf_name, value in state.items():
        name = _hf_to_canonical(hf_name)
        ours = ck.params[name].T if name.endswith("down_t.weight") else ck.params[name]
        assert_close(ours, value, "loaded_weights", err_msg=hf_name)


def test_keep_quantized_memory_is_the_file_size(every_type):
    """Each quantized tensor kept once, as its blocks: the params hold about the file's bytes
    (float tensors stay float32, so F16/BF16 ones count double)."""
    path, _, _ = every_type
    ckq = load_checkpoint(path, keep_quantized=True)
    held = sum(v.nbytes for v in ckq.params.values())
    doubled = sum(v.nbytes // 2 for n, v in ckq.params.items() if TYPES.get(n) in ("F16", "BF16"))
    assert held - doubled <= path.stat().st_size <= 1.15 * (held - doubled)
