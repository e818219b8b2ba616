"""Tokenizer: ids equal to transformers' GGUF tokenizer, streaming decode, chat templates."""
import re
import shutil

import numpy as np
import pytest

from helpers_models import (SAMPLE_TEXTS, gpt2_tokenizer_meta, real_gguf_path, spm_tokenizer_meta,
                            tiny_llama_config, trained_bpe, write_tiny_gguf)
from powerinfer_jax.checkpoint.gguf import _open, read_metadata
from powerinfer_jax.errors import UserError
from powerinfer_jax.tokenizer import (CHATML_TEMPLATE, StreamDecoder, Tokenizer, check_text,
                                      resolve_chat_template)

REAL_TEXTS = SAMPLE_TEXTS + [
    "Hello world 12345 héllo 日本語 🙂 <|im_start|>user\n  hi  there\t\n\nit's",
    "def f(x):\n    return x**2  # comment", "ΑΒΓ привет مرحبا", "<|im_end|><|endoftext|>a"]


def _tiny_gguf(tmp_path, meta):
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, tiny_llama_config(vocab_size=len(meta["tokens"])), tokenizer_meta=meta)
    return path


def _ours_and_hf(path):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_metadata(read_metadata(_open(path)))
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _assert_same(ours, hf, texts):
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids), text


@pytest.mark.parametrize("meta", [gpt2_tokenizer_meta(), spm_tokenizer_meta()], ids=["gpt2", "llama"])
def test_tiny_gguf_matches_transformers(tmp_path, meta):
    pytest.importorskip("transformers")
    ours, hf = _ours_and_hf(_tiny_gguf(tmp_path, meta))
    texts = SAMPLE_TEXTS + ["hello world and the fox", " Hello  is\n!x"]
    if meta["model"] != "llama":
        _assert_same(ours, hf, texts)
        return
    # SentencePiece's dummy prefix: sentencepiece and llama.cpp prepend "\u2581" to every text
    # (tests/test_families.py checks both on real vocabularies); transformers 5's GGUF
    # conversion skips it where the text starts with a space: there ours has one "\u2581" more
    _assert_same(ours, hf, [t for t in texts if not t[0].isspace()])
    sp = ours.token_to_id("\u2581")
    for text in (t for t in texts if t[0].isspace()):
        want = hf(text)["input_ids"]
        assert ours.encode(text) == want[:1] + [sp] + want[1:], text


def test_spm_conventions(tmp_path):
    tok = Tokenizer.from_gguf_metadata(read_metadata(_open(_tiny_gguf(tmp_path, spm_tokenizer_meta()))))
    ids = tok.encode("hello world")
    assert ids[0] == 1 and tok.add_bos  # llama vocabularies add BOS by default
    assert [tok.id_to_token(i) for i in ids[1:]] == ["\u2581hello", "\u2581world"]
    assert tok.decode(ids, skip_special=True) == "hello world"
    sp = tok.token_to_id("\u2581")
    assert tok.encode("é", add_bos=False) == [sp, 3 + 0xC3, 3 + 0xA9]  # "▁" + byte fallback


@pytest.fixture(scope="module")
def real_gguf():
    path = real_gguf_path()
    if path is None:
        pytest.skip("no SmolLM2 GGUF: set PIJ_TEST_GGUF or fetch smollm2-135m into the cache")
    return path


@pytest.mark.slow
def test_real_smollm2_matches_transformers(real_gguf, tmp_path):
    pytest.importorskip("transformers")
    ours, hf = _ours_and_hf(real_gguf)
    assert ours.bos_id == 1 and ours.eos_ids == (2,) and not ours.add_bos
    _assert_same(ours, hf, REAL_TEXTS)


def test_real_smollm2_splits_numbers_like_llama_cpp(real_gguf):
    """tokenizer.ggml.pre == "smollm": every numeric character is its own pre-token (llama.cpp and
    SmolLM2's tokenizer.json do this; transformers' GGUF converter does not, so " ½" differs)."""
    tok = Tokenizer.from_gguf_metadata(read_metadata(_open(real_gguf)))
    assert [tok.decode([i]) for i in tok.encode("x 42½")] == ["x", " ", "4", "2", "½"]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat(msgs).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_stream_decoder_matches_full_decode():
    tok = Tokenizer(trained_bpe(), bos_id=1, eos_ids=[2])
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text)
        stream = StreamDecoder(tok, skip_special=False)
        pieces = [stream.feed(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)
    # 🙂 is 4 UTF-8 bytes; byte-level tokens split it, so nothing is emitted until it completes
    ids = tok.encode("🙂")
    assert len(ids) > 1
    stream = StreamDecoder(tok)
    assert [stream.feed(i) for i in ids][:-1] == [""] * (len(ids) - 1)


def test_stream_decoder_sentencepiece(tmp_path):
    tok = Tokenizer.from_gguf_metadata(read_metadata(_open(_tiny_gguf(tmp_path, spm_tokenizer_meta()))))
    ids = tok.encode("hello world é and")
    stream = StreamDecoder(tok)
    text = "".join(stream.feed(i) for i in ids) + stream.flush()
    assert text == tok.decode(ids, skip_special=True) == "hello world é and"


def test_chat_template_and_fallback():
    backend = trained_bpe()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = Tokenizer(backend, bos_id=1, eos_ids=[2])
    # a base model (no template) is refused, never silently given ChatML...
    with pytest.raises(UserError, match=r"^chat: expected a model with a chat template .*got a "
                       r"model without one \(a base model: leave chat off, or name a template"):
        plain.apply_chat(msgs)
    # ...unless ChatML is named (the sparsify samples' fallback, or chat_template="chatml")
    chatml = ("<|im_start|>system\nbe brief<|im_end|>\n"
              "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert plain.apply_chat(msgs, fallback=CHATML_TEMPLATE) == chatml
    named = Tokenizer(backend, bos_id=1, eos_ids=[2],
                      chat_template=resolve_chat_template("chatml"))
    assert named.apply_chat(msgs) == chatml
    custom = Tokenizer(backend, bos_id=1, eos_ids=[2],
                       chat_template="{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                     "{% endfor %}{{ eos_token }}")
    assert custom.apply_chat(msgs) == "<|im_start|>[system]be brief[user]hi<|im_end|>"


def test_from_file(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=trained_bpe(), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")
    fast.save_pretrained(tmp_path)
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.vocab_size == 300
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLE_TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model: expected one of \['gpt2', 'llama'\], got 't5'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    meta = {f"tokenizer.ggml.{k}": v for k, v in gpt2_tokenizer_meta().items()}
    for merges in (["ab"], ["a b c"], ["a \u00ff\u00fe"]):  # no space, two, an unknown token
        with pytest.raises(ValueError, match=r'tokenizer.ggml.merges: expected "left right" pairs'):
            Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.merges": merges})
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens: expected a non-empty token list"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="expected an existing tokenizer.json, got .*missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_respelling_outside_the_byte_alphabet_matches_the_per_token_rule():
    """The one-regex-pass search for tokens outside GPT-2's byte alphabet respells exactly the
    tokens a per-token set check finds, wherever they sit (first, last, after empty tokens)."""
    from powerinfer_jax.tokenizer import _bytes_to_unicode, _respell_outside_alphabet

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def per_token(tokens):
        return [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())
                for t in tokens]

    rng = np.random.default_rng(0)
    inside = sorted(alphabet)
    for _ in range(20):
        tokens = ["".join(rng.choice(inside, size=rng.integers(0, 5))) for _ in range(50)]
        for i in rng.choice(50, size=rng.integers(0, 4), replace=False):
            tokens[i] = rng.choice(["<a b>", " ", "x\n", "\t", "é ", "中"])
        tokens[0] = rng.choice([tokens[0], "<s> </s>"])
        assert _respell_outside_alphabet(tokens) == per_token(tokens)
    clean = ["a", "Ġb", ""]
    assert _respell_outside_alphabet(clean) is clean


def test_a_named_chat_template_is_checked(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert resolve_chat_template(str(good)) == good.read_text()
    with pytest.raises(UserError, match=r"^chat_template: expected \"chatml\" or an existing "
                       r"jinja file, got 'chatlm'$"):
        resolve_chat_template("chatlm")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(UserError, match=r"^chat_template: expected a jinja template, got .*bad"
                       r"\.jinja' \(line 1: "):
        resolve_chat_template(str(bad))


@pytest.mark.parametrize("text,got", [
    ("ab" + b"\xff\xfe".decode("utf-8", "surrogateescape") + "cd", "byte 0xff at character 2"),
    ("x\ud83d", "a lone surrogate U+D83D at character 1"),
])
def test_invalid_utf8_is_refused_naming_the_position(text, got):
    """A command line's invalid bytes reach Python as surrogate escapes; the tokenizer would
    raise a TypeError from inside the tokenizers library (issue 53)."""
    tok = Tokenizer(trained_bpe(), bos_id=1, eos_ids=[2])
    with pytest.raises(UserError, match=rf"^prompt: expected valid UTF-8 text, got "
                       rf"{re.escape(got)} \(invalid UTF-8 cannot be tokenized"):
        tok.encode(text, what="prompt")
    with pytest.raises(UserError, match=r"^text: expected text \(a str\), got bytes b'ab'$"):
        check_text(b"ab")
    assert tok.encode("fine \u00e9\U0001f642") == tok.encode("fine \u00e9\U0001f642")
