"""A built model kept across processes (runtime/snapshot.py): a later build of the same request
runs from the snapshot with the tokens of a built model, and never from one that is truncated,
edited, unreadable, for another model file or for a mode that was replaced."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import spm_tokenizer_meta, write_tiny_gguf
from powerinfer_jax.runtime import snapshot

REPO = Path(__file__).resolve().parents[1]
# quantized matrices (the snapshot keeps their interleaved copies) and float ones
TYPES = {"tok_embed": "Q8_0", "lm_head": "Q8_0",
         **{f"layers.{i}.{m}.weight": "Q4_1" for i in range(2)
            for m in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate", "ffn.up")},
         **{f"layers.{i}.ffn.down_t.weight": "Q4_0" for i in range(2)}}
PROMPT = "hello world"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "tiny.gguf"
    write_tiny_gguf(path, tensor_types=TYPES)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _load(path, **kw):
    return pij.load(str(path), max_seq_len=64, progress=False, **kw)


def _tokens(llm, prompt=PROMPT, n=6):
    return llm.generate(prompt, max_new_tokens=n).token_ids


def _file(llm) -> Path:
    return llm.session.store.dir / snapshot.FILE


def test_a_second_build_runs_from_the_snapshot_with_the_same_tokens(gguf, cache):
    first = _load(gguf)
    tokens = _tokens(first)
    assert first.session.snapshot is None and _file(first).is_file()
    again = _load(gguf)
    s = again.session
    assert s.snapshot is not None and s._model is None  # nothing built
    assert _tokens(again) == tokens and s._model is None
    assert (s.engine.compile_count, s.engine.loaded_count) == (0, 2)
    assert s.describe() == first.session.describe() and s.plan == first.session.plan
    assert s.config == first.session.config and s.source == first.session.source
    text = "Hello, world! <s> 12345 the quick brown fox"  # the tokenizer made again, not loaded
    assert s.tokenizer is not first.session.tokenizer
    assert s.tokenizer.encode(text) == first.session.tokenizer.encode(text)
    assert (s.tokenizer.eos_ids, s.tokenizer.bos_id, s.tokenizer.chat_template) == (
        first.session.tokenizer.eos_ids, first.session.tokenizer.bos_id,
        first.session.tokenizer.chat_template)
    # the weights are the built model's, array for array
    built = first.session.engine._state
    assert len(s.engine._state) == len(built)
    for a, b in zip(s.engine._state, built):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_sentencepiece_vocabulary_is_made_again_from_its_recipe(cache, tmp_path):
    """A llama-type (SentencePiece) GGUF vocabulary: the snapshot keeps its scored merges, and
    the tokenizer it makes encodes and decodes as the built one."""
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, tensor_types=TYPES, tokenizer_meta=spm_tokenizer_meta())
    built = _load(path).session.tokenizer
    again = _load(path).session
    assert again.snapshot is not None
    for text in ["Hello world, and the fox!", " hello", "is a\n\tthing x"]:
        ids = built.encode(text)
        assert again.tokenizer.encode(text) == ids and again.tokenizer.decode(ids) == \
            built.decode(ids)
    assert (again.tokenizer.bos_id, again.tokenizer.eos_ids, again.tokenizer.add_bos) == (
        built.bos_id, built.eos_ids, built.add_bos)


def test_a_step_to_compile_builds_the_model(gguf, cache):
    """A prompt of another length needs a prefill step the store does not hold: the engine
    builds the model (thaw) to compile it, and gives the built model's tokens."""
    long_prompt = " ".join(["hello world"] * 4)
    built = _load(gguf)
    _tokens(built)  # the store holds the short prompt's steps
    llm = _load(gguf)
    assert llm.session.snapshot is not None
    tokens = _tokens(llm, long_prompt)
    assert llm.session._model is not None and llm.session.engine.compile_count == 1
    assert tokens == _tokens(built, long_prompt)
    llm = _load(gguf)  # the long prompt's prefill step is in the store now
    assert _tokens(llm, long_prompt) == tokens and llm.session._model is None


def test_the_api_builds_the_model_when_asked_for_it(gguf, cache):
    first = _load(gguf)
    logits = first.logits([3, 5, 7])
    llm = _load(gguf)
    assert llm.session._model is None
    np.testing.assert_allclose(llm.logits([3, 5, 7]), logits, rtol=1e-6, atol=1e-6)
    assert llm.model is llm.session._model is not None


@pytest.mark.parametrize("damage", ["edited", "truncated", "unreadable"])
def test_a_damaged_snapshot_is_rebuilt_with_a_message(gguf, cache, capsys, damage):
    first = _load(gguf)
    tokens = _tokens(first)
    path = _file(first)
    data = bytearray(path.read_bytes())
    if damage == "edited":  # same size, other weights
        data[-100:] = bytes(100)
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    else:  # recorded as it is, but its header is garbage
        path.write_bytes(b"PIJSNAP\0" + bytes(8) + b"garbage" + bytes(data[23:]))
        from powerinfer_jax import cache as C

        C.write_record(path)
    capsys.readouterr()
    again = _load(gguf)
    err = capsys.readouterr().err
    assert again.session.snapshot is None  # built
    assert f"cached model snapshot {path} is" in err and "building the model again" in err
    why = {"edited": "mismatch", "truncated": "truncated or replaced",
           "unreadable": "unreadable"}[damage]
    assert why in err
    assert _tokens(again) == tokens
    third = _load(gguf)  # the build wrote it again
    assert third.session.snapshot is not None and _tokens(third) == tokens


def test_another_model_file_is_another_snapshot(gguf, cache, tmp_path):
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, tensor_types=TYPES, seed=1)
    a, b = _load(gguf), _load(other)
    assert a.session.store.dir != b.session.store.dir
    assert _load(other).session.snapshot is not None
    os.utime(other, ns=(0, 0))  # touched: another identity, whose snapshot is yet to be made
    assert _load(other).session.snapshot is None
    assert _load(other).session.snapshot is not None


def test_a_replaced_mode_never_runs_from_the_snapshot(gguf, cache, monkeypatch):
    from powerinfer_jax.sparsity import modes

    _load(gguf)
    assert _load(gguf).session.snapshot is not None
    monkeypatch.setitem(modes._MODES, "dense", modes.Mode(modes._dense, "a replaced dense"))
    assert not modes.is_builtin("dense")
    assert _load(gguf).session.snapshot is None


def test_a_model_over_the_size_cap_keeps_no_snapshot(gguf, cache, monkeypatch):
    """A snapshot is a second copy of the weights on disk: a model larger than
    snapshot.MAX_BYTES (a 7B file) is built every time instead."""
    monkeypatch.setattr(snapshot, "MAX_BYTES", 1024)
    llm = _load(gguf)
    assert not _file(llm).exists()
    assert _load(gguf).session.snapshot is None


def test_only_modes_without_artifacts_keep_a_snapshot(gguf, cache):
    llm = _load(gguf, sparsity="oracle")  # no target: thresholds from the config, kept
    assert _file(llm).is_file()
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.runtime.session import _keeps_snapshot

    assert _keeps_snapshot(SparsityConfig(mode="dense"))
    assert not _keeps_snapshot(SparsityConfig(mode="oracle", target_sparsity=0.5))
    assert not _keeps_snapshot(SparsityConfig(mode="threshold", target_sparsity=0.5))


@pytest.mark.slow
def test_generate_from_a_snapshot_imports_no_model_code(gguf, tmp_path):
    """Two processes: the second runs from the snapshot without importing flax or the model
    modules, and prints the first one's tokens and report."""
    env = {**os.environ, "POWERINFER_JAX_CACHE": str(tmp_path / "cache")}
    code = ("import sys, runpy; sys.argv = ['generate'] + sys.argv[1:]\n"
            "from powerinfer_jax import _cli\n"
            "def done():\n"
            "    heavy = sorted(m for m in sys.modules if m == 'flax' or\n"
            "                   m.startswith('powerinfer_jax.models.') and m != "
            "'powerinfer_jax.models.kv_cache' and m != 'powerinfer_jax.models.qweights')\n"
            "    print('HEAVY', heavy, file=sys.stderr, flush=True)\n"
            "    exit_now()\n"
            "exit_now, _cli._exit_now = _cli._exit_now, done\n"
            "runpy.run_module('powerinfer_jax.generate', run_name='__main__')\n")
    argv = [sys.executable, "-c", code, "--model", str(gguf), "--prompt", PROMPT,
            "--max-new-tokens", "6", "--json"]
    rows, heavy = [], []
    for _ in range(2):
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        heavy.append([l for l in out.stderr.splitlines() if l.startswith("HEAVY")][0])
    assert "flax" in heavy[0] and heavy[1] == "HEAVY []"
    assert rows[1]["startup"]["build_s"] == 0.0
    assert (rows[0]["startup"]["model"], rows[1]["startup"]["model"]) == ("built", "snapshot")
    for key in ("tokens", "text", "weights", "plan", "kernels", "source"):
        assert rows[0][key] == rows[1][key], key
