"""The Python API (powerinfer_jax.load / LLM), batched decoding and the sparsity-mode registry, on
a tiny model saved to disk."""
import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import save_hf_llama
from helpers_rows import assert_our_decode_row
from powerinfer_jax import config
from powerinfer_jax.runtime.decode import Request
from powerinfer_jax.sparsity import modes

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "hello", "it's 2024 and we're testing tokenizers: 3.14",
           "the dog sleeps", "a b c"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_relu")
    save_hf_llama(d, hidden_act="relu")
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return pij.load(str(tiny_dir), max_batch=4, max_seq_len=96, progress=False)


@pytest.mark.slow
def test_generate_stream_and_ids_agree(llm):
    out = llm.generate(PROMPTS[0], max_new_tokens=12)
    assert isinstance(out, pij.Completion) and 1 <= len(out.token_ids) <= 12
    assert out.finish_reason in ("stop", "length") and out.prompt_tokens > 0
    assert "".join(llm.stream(PROMPTS[0], max_new_tokens=12)) == out.text
    ids = llm.encode(PROMPTS[0])
    assert llm.generate(ids, max_new_tokens=12).token_ids == out.token_ids


@pytest.mark.slow
# each dtype and each mode once: all four pairs cost ~100 s of the suite's time on 2 cores
@pytest.mark.parametrize("dtype,mode", [("float32", "dense"), ("bfloat16", "oracle")])
def test_batched_greedy_equals_single_sequences(tiny_dir, mode, dtype):
    """Every sequence of a batch (ragged prompts, more prompts than slots, each stopping at its own
    length) gets exactly the tokens it gets alone."""
    llm = pij.load(str(tiny_dir), dtype=dtype, sparsity=mode, max_batch=4, max_seq_len=96,
                   progress=False)
    eng = llm.session.engine
    prompts = [llm.encode(p) for p in PROMPTS]
    lengths = [9, 3, 14, 1, 7]
    alone = [eng.generate(p, max_new_tokens=n).tokens for p, n in zip(prompts, lengths)]
    together = eng.run([Request(p, n) for p, n in zip(prompts, lengths)])
    assert [r.tokens for r in together] == alone
    assert all(len(t) == n for t, n in zip(alone, lengths))


@pytest.mark.slow
def test_sampled_batch_rows_keep_their_own_seed(llm):
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.95)
    alone = llm.generate(PROMPTS[1], seed=5, **kw).token_ids
    batch = llm.generate([PROMPTS[2], PROMPTS[1]], seed=4, **kw)  # prompt i takes seed + i
    assert batch[1].token_ids == alone


@pytest.mark.slow
def test_stop_strings_end_the_text(llm):
    full = llm.generate(PROMPTS[0], max_new_tokens=16)
    if len(full.text) < 3:
        pytest.skip("the tiny model's continuation is too short to cut")
    stop = full.text[1:3]
    out = llm.generate(PROMPTS[0], max_new_tokens=16, stop=[stop])
    assert out.text == full.text[:full.text.find(stop)] and out.finish_reason == "stop"
    assert stop not in "".join(llm.stream(PROMPTS[0], max_new_tokens=16, stop=[stop]))


def test_logits_and_hooks(llm):
    ids = llm.encode(PROMPTS[0])
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), llm.config.vocab_size) and np.isfinite(logits).all()
    assert int(np.argmax(logits[-1])) == llm.generate(ids, max_new_tokens=1).token_ids[0]
    acts = llm.ffn_activations(ids)
    masks = llm.active_masks(ids)
    assert acts.shape == masks.shape == (llm.config.n_layers, len(ids), llm.config.d_ff)
    np.testing.assert_array_equal(masks, acts != 0)  # dense mode: the non-zero (ReLU) neurons
    assert 0 < masks.mean() < 1
    ppl = llm.perplexity(" ".join(PROMPTS * 4), ctx=16)
    assert ppl["ppl"] > 1 and ppl["ffn_sparsity"] == 0.0


@pytest.mark.parametrize("call,match", [
    (lambda m: m.generate("", max_new_tokens=4), "prompt: expected non-empty text"),
    (lambda m: m.generate("x", max_new_tokens=0), "max_new_tokens: expected an integer >= 1"),
    (lambda m: m.generate("x " * 200, max_new_tokens=4), "prompt: expected fewer than 96"),
    (lambda m: m.generate("x " * 40, max_new_tokens=80), r"prompt tokens \+ new tokens <= 96"),
    (lambda m: m.generate("x", temperature=-1), "temperature: expected"),
    (lambda m: m.generate("x", seed=2 ** 40), "seed: expected an integer in"),
    (lambda m: m.generate("x", stop=[""]), "stop: expected non-empty strings"),
    (lambda m: m.logits([10 ** 6]), "token ids: expected"),
])
def test_bad_calls_are_clear_errors(llm, call, match):
    with pytest.raises(pij.UserError, match=match):
        call(llm)


@pytest.mark.slow
def test_one_compile_per_bucket_not_per_step(llm):
    eng = llm.session.engine
    eng.run([Request(llm.encode(p), 12) for p in PROMPTS])
    before = eng.compile_count
    eng.run([Request(llm.encode(p), 12) for p in PROMPTS])
    llm.generate(PROMPTS[:3], max_new_tokens=12)
    assert eng.compile_count == before


# ------------------------------------------------------------------ a new mode in one class
@pytest.mark.slow
def test_a_toy_mode_is_one_selector_class_and_one_register_call(tiny_dir, tmp_path, capsys):
    """top-k: the k largest |a_i| per token. Written here, in the test, as one Selector subclass and
    one `register` call; then generate, evaluate and bench run it by name."""
    from powerinfer_jax import bench, evaluate, generate
    from powerinfer_jax.models.ffn import Selection, Selector
    from powerinfer_jax.sparsity import modes

    class TopK(Selector):
        def __init__(self, k: int):
            self.k = k

        def select(self, ffn, x_btd):
            import jax

            a = jnp.abs(ffn.activations(x_btd))
            kth = jax.lax.top_k(a, self.k)[0][..., -1:]
            return Selection("scores", 0.5, (a >= kth).astype(jnp.float32))

    modes.register("topk", modes.Mode(lambda model, cfg, arts: [TopK(8) for _ in model.layers],
                                      "the 8 largest |a_i| per token"))
    try:
        common = ["--model", str(tiny_dir), "--sparsity", "topk", "--json", "--threads", "1"]
        generate.main([*common, "--prompt", "the quick brown fox", "--max-new-tokens", "5"])
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["sparsity"] == "topk" and row["plan"]["selector"] == "TopK"
        text = tmp_path / "t.txt"
        text.write_text(" ".join(PROMPTS) * 20)
        evaluate.main([*common, "--text", str(text), "--ctx", "16", "--max-chunks", "2",
                       "--no-progress"])
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["ffn_sparsity"] == pytest.approx(1 - 8 / 96, abs=0.02)  # ties aside
        bench.main([*common, "--prompt-tokens", "4", "--new-tokens", "3", "--repeats", "1"])
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["sparsity"] == "topk" and row["prompt_tokens"] == 4
        assert_our_decode_row(row, repeats=1, new_tokens=3)
    finally:
        modes._MODES.pop("topk")
        config._SPARSITY_MODES.remove("topk")


def test_configs_accept_exactly_the_registered_modes():
    """config.py keeps the mode names a SparsityConfig accepts without importing the sparsity
    layer: they are sparsity/modes.py's registered modes, no more, no fewer."""
    assert set(config.sparsity_modes()) == set(modes.names())
    with pytest.raises(pij.UserError, match="topk"):
        pij.SparsityConfig(mode="topk")


# ------------------------------------------------------------------ threads
def _pool_workers() -> int:
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pij-pool"
               for t in os.listdir("/proc/self/task"))


@pytest.mark.slow
@pytest.mark.parametrize("threads,workers", [(1, 0), (2, 1)])
def test_generate_threads_sizes_the_kernel_pool_in_dense_mode(tiny_dir, capsys, threads,
                                                                workers):
    """The pool runs dense decode too, so --threads sizes it in every mode: --threads 1 runs the
    kernels on the calling thread alone (no pool worker)."""
    from powerinfer_jax import generate

    if len(os.sched_getaffinity(0)) < threads:
        pytest.skip(f"needs {threads} CPUs")
    affinity = os.sched_getaffinity(0)
    try:
        generate.main(["--model", str(tiny_dir), "--prompt", "hello", "--max-new-tokens", "2",
                       "--threads", str(threads)])
        assert _pool_workers() == workers
    finally:
        os.sched_setaffinity(0, affinity)


@pytest.mark.slow
def test_readme_python_snippet_runs(tiny_dir):
    """The README's Python example, run as written with the tiny model in place of the default."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    assert block, "README.md: expected a ```python example"
    code = block.group(1).replace('"smollm2-135m"', repr(str(tiny_dir)))
    exec(compile(code, "README.md", "exec"), {})
