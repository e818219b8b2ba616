"""The interleaved copies kept beside a GGUF (checkpoint/interleaved_file.py): a model built from
the file computes what one that interleaved its matrices computes, maps them (no copy, the Q/K
rows never put in RoPE order), and a damaged, truncated or foreign file, or a place that cannot
take one, is said in one line and never read as weights."""
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import write_tiny_gguf
from powerinfer_jax import cache
from powerinfer_jax.checkpoint import interleaved_file, load_checkpoint
from powerinfer_jax.checkpoint.base import DeferredQuantTensor
from powerinfer_jax.checkpoint.gguf_file import mapping_at
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.runtime import snapshot

TYPES = {"tok_embed": "Q8_0", "lm_head": "Q8_0",
         **{f"layers.{i}.{m}.weight": "Q4_0" for i in range(2)
            for m in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate", "ffn.up")},
         **{f"layers.{i}.ffn.down_t.weight": "Q8_0" for i in range(2)}}


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, tensor_types=TYPES)
    return path


def _logits(path, copies=None):
    q = load_checkpoint(path, keep_quantized=True)
    m = from_params(q.config, q.params, kernels="ffi", copies=copies)
    ids = jnp.asarray([[1, 5, 9, 2, 7]], jnp.int32)
    return np.asarray(m(ids)), m, q


def _notes():
    lines = []
    return lines, lines.append


def test_a_model_from_the_file_computes_the_same_logits_and_reads_it(gguf):
    plain, _, _ = _logits(gguf)
    lines, note = _notes()
    first = interleaved_file.InterleavedFile(gguf, note=note)
    made, _, _ = _logits(gguf, first)
    assert first.path is None and first.save(min_bytes=0) == first.places[0]
    assert first.places[0].is_file() and "wrote the interleaved copy" in lines[-1]
    again = interleaved_file.InterleavedFile(gguf, note=note)
    assert again.path == first.places[0]
    mapped, m, q = _logits(gguf, again)
    np.testing.assert_array_equal(made, plain)
    np.testing.assert_array_equal(mapped, plain)
    weight = np.asarray(m.layers[0].attn.q.weight[...])
    # read from the file into anonymous memory (its mapped 4 KiB pages streamed 24% slower)
    assert weight.ctypes.data % 64 == 0
    where = mapping_at(weight.ctypes.data)
    assert where is None or where.path != str(again.path)
    entry = again._tensors[("layers.0.attn.q.weight", interleaved_file.INTERLEAVED)]
    np.testing.assert_array_equal(
        weight.reshape(-1), again._data[entry["offset"]:entry["offset"] + weight.nbytes])
    rope = q.params["layers.0.attn.q.weight"]
    assert isinstance(rope, DeferredQuantTensor) and rope._made is None  # never put in order
    assert again.save(min_bytes=0) is None  # nothing new: left as it is
    assert len(lines) == 1


def test_the_snapshots_limit_is_where_the_file_starts():
    assert interleaved_file.MIN_BYTES == snapshot.MAX_BYTES


@pytest.mark.parametrize("damage", ["truncated", "edited", "foreign", "no record"])
def test_a_damaged_truncated_or_foreign_file_is_written_again(gguf, tmp_path, damage):
    plain, _, _ = _logits(gguf)
    first = interleaved_file.InterleavedFile(gguf, note=lambda _: None)
    _logits(gguf, first)
    path = first.save(min_bytes=0)
    if damage == "truncated":
        os.truncate(path, path.stat().st_size - 4096)
    elif damage == "edited":  # the weights' bytes changed in place (the mtime with them)
        data = bytearray(path.read_bytes())
        data[-4096:] = bytes(4096)
        path.write_bytes(bytes(data))
    elif damage == "foreign":  # another model's file (and its record) under this one's name
        other = tmp_path / "other" / "tiny.gguf"
        other.parent.mkdir()
        write_tiny_gguf(other, tensor_types=TYPES, seed=7)
        theirs = interleaved_file.InterleavedFile(other, note=lambda _: None)
        _logits(other, theirs)
        shutil.copy(theirs.save(min_bytes=0), path)
        shutil.copy(cache.record_path(theirs.places[0]), cache.record_path(path))
    else:
        cache.record_path(path).unlink()
    lines, note = _notes()
    again = interleaved_file.InterleavedFile(gguf, note=note)
    assert again.path is None and len(lines) == 1, lines
    assert lines[0].startswith(f"interleaved copy {path} is ") and "writing it again" in lines[0]
    np.testing.assert_array_equal(_logits(gguf, again)[0], plain)
    assert again.save(min_bytes=0) == path
    assert interleaved_file.InterleavedFile(gguf, note=note).path == path and len(lines) == 2


def test_a_place_that_cannot_take_the_file_is_said_and_the_next_one_used(gguf, tmp_path,
                                                                         monkeypatch):
    """Beside the model fails (here: a directory holds its name; a read-only directory as
    well, which root ignores), so the cache directory takes it; where neither can, the model
    still loads, interleaved at start-up."""
    plain, _, _ = _logits(gguf)
    (gguf.parent / (gguf.name + interleaved_file.SUFFIX)).mkdir()
    lines, note = _notes()
    copies = interleaved_file.InterleavedFile(gguf, note=note)
    _logits(gguf, copies)
    path = copies.save(min_bytes=0)
    assert path == copies.places[1] and path.is_file()
    assert len(lines) == 2 and lines[0].startswith(f"cannot write the interleaved copy in "
                                                   f"{gguf.parent}: ")
    assert lines[0].endswith("; trying the cache directory") and "\n" not in lines[0]
    assert interleaved_file.InterleavedFile(gguf, note=note).path == path

    shutil.rmtree(path.parent)
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "not-a-dir" / "cache"))
    lines.clear()
    copies = interleaved_file.InterleavedFile(gguf, note=note)
    np.testing.assert_array_equal(_logits(gguf, copies)[0], plain)
    assert copies.save(min_bytes=0) is None
    assert len(lines) == 2 and lines[1].endswith("; each load interleaves the model again")


def test_a_session_writes_the_file_then_reads_it_with_the_same_tokens(gguf, monkeypatch):
    """Through pij.load (the snapshot off: it would skip the build): the first load writes the
    file, the second reads it, with the tokens of a load without it."""
    from powerinfer_jax.runtime import session

    monkeypatch.setattr(session, "_keeps_snapshot", lambda sparsity: False)
    monkeypatch.setattr(interleaved_file, "MIN_BYTES", 0)

    def tokens():
        llm = pij.load(str(gguf), max_seq_len=64, progress=False)
        return llm.generate("hello world", max_new_tokens=6).token_ids

    monkeypatch.setenv(interleaved_file.ENV, "0")
    plain = tokens()
    side = gguf.parent / (gguf.name + interleaved_file.SUFFIX)
    assert not side.exists()
    monkeypatch.delenv(interleaved_file.ENV)
    assert tokens() == plain and side.is_file()
    stamp = side.stat().st_mtime_ns
    assert tokens() == plain and side.stat().st_mtime_ns == stamp
