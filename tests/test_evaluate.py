"""evaluate and LLM.perplexity: the model's BOS flag honoured, the two scoring protocols
(runtime/perplexity.py) against a sum of log-probabilities computed from the model's own logits,
the protocol named in the output, arguments refused before the model loads, and our
second-half score next to llama.cpp's llama-perplexity on the same file and text."""
import json
import math
import re
import subprocess

import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_llamacpp import binary
from helpers_models import gpt2_tokenizer_meta, real_gguf_path, write_tiny_gguf
from powerinfer_jax import _cli, evaluate
from powerinfer_jax.runtime.perplexity import chunk_tokens

TEXT = "the quick brown fox jumps over the lazy dog. hello world, hello there! " * 30


@pytest.fixture(scope="module")
def bos_gguf(tmp_path_factory):
    """A tiny GGUF whose metadata says tokenizer.ggml.add_bos_token (as Gemma's and Llama's do)."""
    path = tmp_path_factory.mktemp("bos") / "tiny-bos.gguf"
    write_tiny_gguf(path, tokenizer_meta={**gpt2_tokenizer_meta(), "add_bos_token": True})
    return path


@pytest.fixture(scope="module")
def llm(bos_gguf):
    return pij.load(str(bos_gguf), progress=False)


def _reference_nll(llm, chunks, first):
    """The NLL of tokens first+1.. of each chunk from the model's logits over the whole chunk,
    log-softmax in float64 here."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(llm.model)

    @jax.jit
    def logits(state, tokens):
        m = nnx.merge(graphdef, state)
        h, _ = m.hidden(tokens, jnp.arange(tokens.shape[1])[None])
        return m.logits(h)[0]

    total = 0.0
    for chunk in chunks:
        z = np.asarray(logits(state, jnp.asarray(chunk[None])), np.float64)  # [T, V]
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        total -= sum(logp[j, chunk[j + 1]] for j in range(first, len(chunk) - 1))
    return total


def test_chunks_start_with_bos_where_the_model_takes_one():
    ids = list(range(10, 30))
    plain = chunk_tokens(ids, 8, None)
    assert plain.tolist() == [list(range(10, 18)), list(range(18, 26))]
    every = chunk_tokens(ids, 8, None, bos_id=1)  # BOS then 7 text tokens: all of them scored
    assert every.tolist() == [[1, *range(10, 17)], [1, *range(17, 24)]]
    half = chunk_tokens(ids, 8, None, bos_id=1, score="second-half")  # as llama-perplexity
    assert half.tolist() == [[1, *range(10, 17)], [1, *range(18, 25)]]


def test_the_files_bos_flag_is_honoured_and_both_protocols_score_as_stated(llm):
    tok = llm.tokenizer
    assert tok.add_bos and tok.bos_id == 1
    ids = tok.encode(TEXT, add_bos=False)
    for score, first in (("all", 0), ("second-half", 16)):
        res = llm.perplexity(TEXT, ctx=32, max_chunks=2, score=score)
        assert res["bos"] is True and res["score"] == score
        chunks = chunk_tokens(ids, 32, 2, bos_id=1, score=score)
        assert (chunks[:, 0] == 1).all()
        assert res["tokens_scored"] == 2 * (31 - first)
        want = math.exp(_reference_nll(llm, chunks, first) / res["tokens_scored"])
        assert res["ppl"] == pytest.approx(want, rel=1e-4)
    off = llm.perplexity(TEXT, ctx=32, max_chunks=2, bos=False)
    assert off["bos"] is False and off["tokens_scored"] == 2 * 31
    assert off["ppl"] != pytest.approx(res["ppl"])


def test_evaluate_says_which_protocol_it_used(bos_gguf, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    evaluate.main(["--model", str(bos_gguf), "--text", str(text), "--ctx", "32", "--max-chunks",
                   "2", "--score", "second-half", "--json", "--no-progress"])
    out = capsys.readouterr().out.strip().splitlines()
    row = json.loads(out[-1])
    assert row["score"] == "second-half" and row["bos"] is True and row["tokens_scored"] == 30
    assert "second half of each chunk scored, as llama-perplexity" in out[-2]
    assert "BOS first" in out[-2]


@pytest.mark.parametrize("argv,match", [
    (["--ctx", "0"], r"--ctx: expected an integer >= 2"),
    (["--ctx", "2", "--score", "second-half"], r"--ctx: expected an integer >= 3"),
    (["--max-chunks", "0"], r"--max-chunks: expected a positive integer"),
])
def test_bad_arguments_are_refused_before_the_model_loads(tmp_path, monkeypatch, argv, match):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(_cli, "build_from_args", no_load)
    with pytest.raises(pij.UserError, match=match):
        evaluate.main(["--text", str(text), *argv])


@pytest.mark.slow
def test_second_half_matches_llama_perplexity_on_the_default_model(tmp_path):
    """Same GGUF, same text, same context: our second-half score within 1% of llama.cpp's
    (it computes on the same blocks with 8-bit activations; 0.24% apart over 16 chunks of 512 of
    wiki.valid, benchmarks/evaluate_ppl.jsonl)."""
    exe, gguf = binary("llama-perplexity"), real_gguf_path()
    if exe is None or gguf is None:
        pytest.skip("llama-perplexity or the default model's GGUF is not here")
    text = tmp_path / "t.txt"
    text.write_text((TEXT + " The cat sat on the mat, and then it slept. ") * 8)
    ctx, chunks = 128, 2
    out = subprocess.run([str(exe), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
                          "--chunks", str(chunks), "-t", "2"], capture_output=True, text=True,
                         timeout=300)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    assert m, (out.stdout + out.stderr)[-2000:]
    ours = pij.load(str(gguf), progress=False).perplexity(
        text.read_text(), ctx=ctx, max_chunks=chunks, score="second-half")
    assert ours["ppl"] == pytest.approx(float(m.group(1)), rel=0.01)
