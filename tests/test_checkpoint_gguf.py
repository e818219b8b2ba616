"""GGUF reading: round trips through our writer, HF transformers' own GGUF loader, bad files."""
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants as ref

from helpers_models import gpt2_tokenizer_meta, random_params, tiny_llama_config, write_tiny_gguf
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import QuantTensor, load_checkpoint
from powerinfer_jax.checkpoint.base import rope_permute, rope_unpermute
from powerinfer_jax.checkpoint.gguf import load_gguf, read_config, write_gguf
from powerinfer_jax.checkpoint.quants import dequantize

TYPES = {
    "tok_embed": "Q8_0",
    "layers.0.attn.q.weight": "Q4_0",
    "layers.0.attn.k.weight": "Q4_1",
    "layers.0.attn.v.weight": "Q8_0",
    "layers.0.ffn.up.weight": "Q4_1",
    "layers.0.ffn.down_t.weight": "Q4_0",  # stored [D, F]: blocks along F=96
    "layers.1.attn.q.weight": "F16",
    "layers.1.attn.k.weight": "BF16",
    "layers.1.ffn.gate.weight": "Q4_1",
    "lm_head": "Q8_0",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    config, params = write_tiny_gguf(path, tensor_types=TYPES)
    return path, config, params, load_gguf(path)


def _quant_roundtrip(x, qtype):
    kind = GGMLQuantizationType[qtype]
    return ref.dequantize(ref.quantize(np.ascontiguousarray(x), kind), kind).astype(np.float32)


def test_config_round_trip(tiny):
    path, config, _, ck = tiny
    assert ck.config.replace(norm_eps=config.norm_eps) == config
    assert ck.config.norm_eps == pytest.approx(config.norm_eps)
    assert ck.source == str(path)
    assert read_config(path) == ck.config  # the header alone gives the load's config


def test_params_round_trip(tiny):
    _, config, params, ck = tiny
    assert set(ck.params) == set(params)
    for name, want in params.items():
        got = ck.params[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        qtype = TYPES.get(name, "F32")
        if qtype == "F32":  # Q/K permutation undone exactly
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:  # exactly what quantize -> dequantize of the file's layout gives
            stored = want.T if name.endswith("down_t.weight") else want
            expected = _quant_roundtrip(stored, qtype)
            expected = expected.T if name.endswith("down_t.weight") else expected
            np.testing.assert_array_equal(got, expected, err_msg=name)
            bound = {"Q8_0": 0.02, "Q4_0": 0.3, "Q4_1": 0.3}.get(qtype, 0.01)
            assert np.abs(got - want).max() < bound * np.abs(want).max(), name


def test_kept_blocks_dequantize_to_params(tiny):
    path, _, _, ck = tiny
    kept = load_gguf(path, keep_quantized=True).params
    quantized = {n for n, v in kept.items() if isinstance(v, QuantTensor)}
    assert quantized == {n for n, t in TYPES.items() if t.startswith("Q")}
    for name in quantized:
        t = kept[name]
        assert t.qtype == TYPES[name] and t.blocks.dtype == np.uint8
        values = dequantize(t.blocks, t.qtype).reshape(t.stored_shape)
        np.testing.assert_array_equal(values.T if t.transposed else values, ck.params[name])
        np.testing.assert_array_equal(t.dequantize(), ck.params[name])
    assert kept["layers.0.ffn.down_t.weight"].transposed


def _rope_halves(x, pos, theta=10000.0):  # HF rotate_half convention, x [..., H]
    h = x.shape[-1]
    freq = pos * theta ** (-np.arange(h // 2) * 2.0 / h)
    a, b = x[..., : h // 2], x[..., h // 2:]
    return np.concatenate([a * np.cos(freq) - b * np.sin(freq), b * np.cos(freq) + a * np.sin(freq)], -1)


def _rope_interleaved(x, pos, theta=10000.0):  # llama.cpp's convention: pairs (2i, 2i+1)
    h = x.shape[-1]
    freq = pos * theta ** (-np.arange(h // 2) * 2.0 / h)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(freq) - b * np.sin(freq)
    out[..., 1::2] = b * np.cos(freq) + a * np.sin(freq)
    return out


def test_rope_permutation_maps_conventions():
    """llama.cpp's interleaved RoPE on the permuted weights == HF's rotate-half RoPE on ours."""
    rng = np.random.default_rng(0)
    n_heads, h, d = 3, 8, 10
    w_hf = rng.standard_normal((n_heads * h, d))
    x = rng.standard_normal(d)
    np.testing.assert_array_equal(rope_unpermute(rope_permute(w_hf, n_heads), n_heads), w_hf)
    for pos in (0, 1, 7):
        ours = _rope_halves((w_hf @ x).reshape(n_heads, h), pos)
        theirs = _rope_interleaved((rope_permute(w_hf, n_heads) @ x).reshape(n_heads, h), pos)
        assert_close(rope_permute(ours.reshape(-1, 1), n_heads).ravel(), theirs.ravel(), "float64")


def test_tied_embeddings(tmp_path):
    config = tiny_llama_config(tie_embeddings=True)
    _, params = write_tiny_gguf(tmp_path / "tied.gguf", config)
    ck = load_checkpoint(tmp_path / "tied.gguf")
    assert ck.config.tie_embeddings and "lm_head" not in ck.params
    np.testing.assert_array_equal(ck.params["tok_embed"], params["tok_embed"])


def _hf_to_canonical(name):
    name = name.removeprefix("model.")
    table = {"embed_tokens.weight": "tok_embed", "norm.weight": "final_norm.scale",
             "lm_head.weight": "lm_head"}
    if name in table:
        return table[name]
    _, i, rest = name.split(".", 2)
    layer = {"input_layernorm.weight": "attn_norm.scale",
             "post_attention_layernorm.weight": "ffn_norm.scale",
             "self_attn.q_proj.weight": "attn.q.weight", "self_attn.k_proj.weight": "attn.k.weight",
             "self_attn.v_proj.weight": "attn.v.weight", "self_attn.o_proj.weight": "attn.o.weight",
             "mlp.gate_proj.weight": "ffn.gate.weight", "mlp.up_proj.weight": "ffn.up.weight",
             "mlp.down_proj.weight": "ffn.down_t.weight"}[rest]
    return f"layers.{i}.{layer}"


def test_matches_transformers_gguf_loader(tiny, tmp_path):
    """transformers dequantizes and un-permutes GGUF itself; its state_dict must equal our params."""
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path, config, _, ck = tiny
    shutil.copy(path, tmp_path / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert model.config.num_key_value_heads == config.n_kv_heads
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert len(state) == len(ck.params)
    for hf_name, value in state.items():
        name = _hf_to_canonical(hf_name)
        ours = ck.params[name].T if name.endswith("down_t.weight") else ck.params[name]
        assert_close(ours, value, "loaded_weights", err_msg=hf_name)


# ------------------------------------------------------------------------------- bad input
def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="expected an existing file, got .*nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_truncated_file(tiny, tmp_path):
    data = tiny[0].read_bytes()
    for cut in (len(data) // 2, 40):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\d+\.gguf.*truncated"):
            load_checkpoint(bad)


def test_garbage_bytes(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="garbage.gguf.*expected a complete GGUF"):
        load_checkpoint(bad)


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture: expected one of .*llama.*got 'gpt2'"):
        load_gguf(tmp_path / "g.gguf")
    with pytest.raises(ValueError, match=r"architecture: expected one of .*got 'gpt2'"):
        read_config(tmp_path / "g.gguf")


def test_unsupported_tensor_type(tmp_path):
    write_tiny_gguf(tmp_path / "mx.gguf", tensor_types={"layers.1.ffn.up.weight": "MXFP4"})
    with pytest.raises(ValueError, match=r"tensor 'blk.1.ffn_up.weight': expected type one of .*got MXFP4"):
        load_gguf(tmp_path / "mx.gguf")


def test_missing_tensor(tmp_path):
    config = tiny_llama_config()
    write_gguf(tmp_path / "m.gguf", config, random_params(config), gpt2_tokenizer_meta(),
               overrides={"block_count": 3})
    with pytest.raises(ValueError, match=r"expected tensor 'blk.2.attn_norm.weight'.*got none"):
        load_gguf(tmp_path / "m.gguf")


def test_wrong_shape_vs_metadata(tmp_path):
    config = tiny_llama_config()
    write_gguf(tmp_path / "s.gguf", config, random_params(config), gpt2_tokenizer_meta(),
               overrides={"feed_forward_length": 128})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_gate.weight': expected shape \(128, 64\).*got \(96, 64\)"):
        load_gguf(tmp_path / "s.gguf")


@pytest.mark.slow
def test_real_smollm2_matches_transformers(tmp_path):
    """The real Q4_1 SmolLM2 (GQA 9/3, tied): every tensor equals transformers' dequantization."""
    from helpers_models import real_gguf_path

    path = real_gguf_path()
    if path is None:
        pytest.skip("no SmolLM2 GGUF: set PIJ_TEST_GGUF or fetch smollm2-135m into the cache")
    pytest.importorskip("torch")
    from helpers_models import hf_smollm2

    ck = load_checkpoint(path)
    c = ck.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (c.tie_embeddings, c.max_seq_len, c.rope_theta, c.eos_token_ids) == (True, 8192, 100000.0, (2,))
    kept = load_checkpoint(path, keep_quantized=True).params
    assert kept["layers.0.attn.q.weight"].qtype == "Q4_1" and kept["tok_embed"].qtype == "Q8_0"
    model = hf_smollm2(path)
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight":  # tied
            continue
        name = _hf_to_canonical(hf_name)
        ours = ck.params[name].T if name.endswith("down_t.weight") else ck.params[name]
        np.testing.assert_array_equal(ours, value.float().numpy(), err_msg=hf_name)


# ------------------------------------------------------------ our header reader vs gguf's own
def _assert_same_as_gguf_reader(path):
    """Every metadata value and every tensor header and byte equal `gguf.GGUFReader`'s."""
    from gguf import GGUFReader

    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    ours, theirs = GGUFFile(path), GGUFReader(path)
    want = {}
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            want[key] = value.tolist() if isinstance(value, np.ndarray) else value
    assert ours.metadata == want
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.shape.tolist(), int(b.n_bytes), int(b.data_offset)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))


def test_header_reader_matches_gguf_package(tiny):
    _assert_same_as_gguf_reader(tiny[0])


@pytest.mark.slow
def test_header_reader_matches_gguf_package_on_real_file():
    from helpers_models import real_gguf_path

    path = real_gguf_path()
    if path is None:
        pytest.skip("no SmolLM2 GGUF: set PIJ_TEST_GGUF or fetch smollm2-135m into the cache")
    _assert_same_as_gguf_reader(path)


def test_header_reader_corrupt_bytes_give_one_error(tiny, tmp_path):
    """Flipped bytes in the header and every truncation point of it: a GGUFFormatError (the
    loader's one-line error), or a parse; never another exception or a hang."""
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile, GGUFFormatError

    data = tiny[0].read_bytes()
    header_end = GGUFFile(tiny[0]).tensors[0].data_offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    cases = [data[:cut] for cut in range(0, header_end, max(1, header_end // 97))]
    for _ in range(150):
        b = bytearray(data)
        for pos in rng.integers(0, header_end, size=rng.integers(1, 4)):
            b[pos] = int(rng.integers(0, 256))
        cases.append(bytes(b))
    for case in cases:
        bad.write_bytes(case)
        try:
            GGUFFile(bad)
        except GGUFFormatError as e:
            assert "\n" not in str(e)


def test_string_arrays_read_alike_compiled_and_in_python(tiny, tmp_path, monkeypatch):
    """The compiled string-array loop and the Python one give the same metadata on good files
    and the same one-line error on truncated ones and on bytes that are not UTF-8."""
    from powerinfer_jax.checkpoint import gguf_file
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile, GGUFFormatError

    if gguf_file._compiled_strings() is None:
        pytest.skip("the compiled extension is not built")
    data = tiny[0].read_bytes()
    tokens_at = data.index(b"tokenizer.ggml.tokens")
    header_end = GGUFFile(tiny[0]).tensors[0].data_offset
    rng = np.random.default_rng(1)
    cases = [data, *(data[:cut] for cut in rng.integers(tokens_at, header_end, 40))]
    for _ in range(40):  # a byte of a token string made 0xff (never valid UTF-8), or a length
        b = bytearray(data)
        b[int(rng.integers(tokens_at + 40, header_end))] = 0xFF
        cases.append(bytes(b))
    bad = tmp_path / "case.gguf"

    def outcome():
        try:
            return GGUFFile(bad).metadata
        except GGUFFormatError as e:
            return str(e)

    errors = 0
    for case in cases:
        bad.write_bytes(case)
        compiled = outcome()
        with monkeypatch.context() as m:
            m.setattr(gguf_file, "_compiled_strings", lambda: None)
            assert outcome() == compiled
        errors += isinstance(compiled, str)
    assert errors >= 40  # the cases reach the error paths, not only good parses


def test_string_array_reader_bounds():
    """Offsets past the end, lengths past the end and a zero count, straight into both readers:
    a status naming the item, never a read outside the buffer."""
    import struct

    from powerinfer_jax.checkpoint import gguf_file

    readers = [gguf_file._python_strings]
    if gguf_file._compiled_strings() is not None:
        readers.append(gguf_file._compiled_strings())
    ok = struct.pack("<Q", 2) + b"hi"
    huge = struct.pack("<Q", 2**64 - 1) + b"x"
    for read in readers:
        assert read(ok, 0, 1) == (["hi"], 10, 0)
        assert read(ok, 0, 0) == ([], 0, 0)
        assert read(ok, 10, 1) == (0, 10, 1)   # at the end
        assert read(ok, 11, 1) == (0, 11, 1)   # past it
        assert read(ok, 0, 2) == (1, 10, 1)    # the second item is missing
        assert read(ok + huge, 0, 2) == (1, 10, 1)  # a length that runs past the end
        assert read(struct.pack("<Q", 1) + b"\xff", 0, 1) == (0, 8, 2)


def _mapping_rss(address: int) -> int:
    """Resident bytes of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                begin, end = (int(x, 16) for x in head[0].split("-"))
                inside = begin <= address < end
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux madvise")
def test_release_mapped_pages_drops_only_a_read_only_files_pages(tmp_path):
    """The file's whole pages under a view leave the resident set and read back unchanged; memory
    that is not a read-only shared file mapping (anonymous, or a private copy) is never touched."""
    import mmap

    from powerinfer_jax.checkpoint.gguf_file import mapping_at, release_mapped_pages

    page = mmap.PAGESIZE
    data = np.random.default_rng(0).integers(0, 256, 16 * page, dtype=np.uint8)
    path = tmp_path / "bytes.bin"
    data.tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = np.frombuffer(mm, np.uint8)
    assert int(whole.astype(np.int64).sum()) == int(data.astype(np.int64).sum())  # all resident
    resident = _mapping_rss(whole.ctypes.data)
    view = whole[100:100 + 10 * page]  # 9 whole pages inside it, partial ones at both ends
    assert release_mapped_pages(view) == 9 * page
    assert _mapping_rss(whole.ctypes.data) <= resident - 9 * page
    np.testing.assert_array_equal(whole, data)  # faulted back in from the file, unchanged

    with open(path, "r+b") as f:
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    copy = np.frombuffer(private, np.uint8)
    copy[:] = 7  # a private copy's pages hold what was written, not the file's bytes
    anonymous = np.full(16 * page, 9, np.uint8)
    for arr, value in ((copy, 7), (anonymous, 9)):
        assert release_mapped_pages(arr) == 0
        assert (arr == value).all()
    assert release_mapped_pages(whole[:10]) == 0  # no whole page: nothing to release
    assert mapping_at(0) is None  # an address no mapping holds
    m = mapping_at(whole.ctypes.data)
    assert m.path == str(path.resolve()) and m.perms.startswith("r-") and m.perms[3] == "s" and m.inode
    del whole, view, copy
    mm.close()
    private.close()


def test_tied_check_compares_chunks_up_to_the_first_difference():
    """Tied embeddings are found byte for byte, a difference anywhere (the last byte of a later
    chunk too) refuses them, and the check stops at the first differing chunk."""
    from powerinfer_jax.checkpoint.gguf import _same_bytes

    a = np.arange(5000, dtype=np.uint16).reshape(50, 100)
    assert _same_bytes(a, a.copy(), chunk=1024)
    b = a.copy()
    b.reshape(-1)[-1] ^= 1
    assert not _same_bytes(a, b, chunk=1024)
    assert not _same_bytes(a, a[:49], chunk=1024)
    seen = []

    class Spy(np.ndarray):
        def __getitem__(self, key):
            seen.append(key)
            return super().__getitem__(key)

    c = a.copy()
    c.reshape(-1)[0] ^= 1
    assert not _same_bytes(a, c, chunk=1024)
    assert not _same_bytes(a.view(np.uint8).reshape(-1).view(Spy), c.view(np.uint8).reshape(-1),
                           chunk=1024)
    assert len(seen) == 1  # one chunk read: the first differs
