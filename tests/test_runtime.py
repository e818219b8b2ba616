"""The jitted runtime: compile once per shape, cache == no cache, sampling, stop rules, bad input."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_tolerances import assert_close
from powerinfer_jax.config import ModelConfig, RuntimeConfig
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.runtime.decode import Engine, prefill_bucket
from powerinfer_jax.runtime.sampling import SamplingParams, sample

TINY = ModelConfig(arch="llama", vocab_size=53, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=6, d_ff=37, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    return Transformer(TINY, rngs=nnx.Rngs(0))


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def greedy_no_cache(model, prompt, n):
    """Reference: re-run the whole sequence without a cache for every new token. The sequence is
    padded to one fixed length (one compile, not one per length; run eagerly this took a minute):
    under causal attention the padding after position i cannot change position i's logits."""
    ids = list(prompt)
    width = len(prompt) + n
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (width - len(ids))])
        logits = _forward(model, padded)
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


@pytest.mark.slow
def test_cached_generation_equals_uncached(model):
    prompt = [3, 17, 5, 42, 8]
    eng = Engine(model, max_seq_len=64)
    res = eng.generate(prompt, max_new_tokens=10)
    assert res.tokens == greedy_no_cache(model, prompt, 10)
    assert res.stop_reason == "length"


def test_compiles_once_per_bucket_not_per_token(model):
    eng = Engine(model, max_seq_len=64)
    eng.generate([1, 2, 3], max_new_tokens=20)
    assert eng.compile_count == 2  # one prefill bucket + decode
    eng.generate([4, 5, 6, 7], max_new_tokens=30)  # same bucket (4), more tokens
    assert eng.compile_count == 2
    eng.generate(list(range(1, 20)), max_new_tokens=3)  # bucket 32: one more prefill
    assert eng.compile_count == 3


@pytest.mark.slow
def test_bf16_model_runs_and_mostly_agrees(model):
    state = nnx.state(model)
    bf = nnx.merge(nnx.graphdef(model), jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if x.ndim == 2 else x, state))
    tokens = jnp.asarray([[3, 17, 5, 42, 8, 9]])
    a, b = model(tokens), bf(tokens)
    assert b.dtype == jnp.float32
    assert_close(a, b, "bf16_model")


def test_sampling_is_seeded_and_respects_top_k(model):
    eng = Engine(model, max_seq_len=64)
    sp = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    a = eng.generate([1, 2, 3], max_new_tokens=12, sampling=sp, seed=7)
    b = eng.generate([1, 2, 3], max_new_tokens=12, sampling=sp, seed=7)
    c = eng.generate([1, 2, 3], max_new_tokens=12, sampling=sp, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens  # 12 draws from >= 2 candidates: equal by chance ~never


@pytest.mark.slow
def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    draw = lambda p: {int(sample(logits, k, p)[0]) for k in keys}
    assert draw(SamplingParams(1.0, top_k=2)) == {0, 1}
    assert draw(SamplingParams(1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7, 0.5+0.3 >= 0.7
    assert draw(SamplingParams(1.0, top_p=0.1)) == {0}
    assert draw(SamplingParams(0.0)) == {0}


def test_stops_at_eos(model):
    eng = Engine(model, max_seq_len=64)
    free = eng.generate([1, 2, 3], max_new_tokens=8)
    stop = free.tokens[2]
    res = eng.generate([1, 2, 3], max_new_tokens=8, stop_ids=[stop])
    assert res.tokens == free.tokens[: free.tokens.index(stop) + 1]
    assert res.stop_reason == "eos"


def test_lookahead_step_past_a_stop_is_discarded(model):
    """generate dispatches step k + 1 before it reads step k's token: after a stop, that extra
    step must leave no trace (streamed tokens, the next call's output)."""
    eng = Engine(model, max_seq_len=64)
    free = eng.generate([1, 2, 3], max_new_tokens=10)
    for k in (0, 1, 4):
        streamed = []
        res = eng.generate([1, 2, 3], max_new_tokens=10, stop_ids=[free.tokens[k]],
                           on_token=streamed.append)
        want = free.tokens[: free.tokens.index(free.tokens[k]) + 1]
        assert res.tokens == streamed == want
        assert eng.generate([1, 2, 3], max_new_tokens=10).tokens == free.tokens
    for budget in (1, 2, 3):
        assert eng.generate([1, 2, 3], max_new_tokens=budget).tokens == free.tokens[:budget]


@pytest.mark.slow
@pytest.mark.parametrize("block,dtype", [(2, "float32"), (3, "float32"), (4, "float32"),
                                         (4, "bfloat16")])
def test_a_block_of_steps_gives_the_tokens_of_single_steps(model, block, dtype):
    """A decode call of `block` steps (a loop on the device; unrolled for a bf16 embedding table)
    against one step per call: the same tokens greedy and sampled, in a batch whose sequences end
    mid-block at different lengths, and up to the end of a short cache, where a block would pass
    it and steps go one at a time."""
    from powerinfer_jax.runtime.decode import Request

    if dtype == "bfloat16":
        model = nnx.merge(nnx.graphdef(model), jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if x.ndim == 2 else x, nnx.state(model)))
        assert model.tok_embed[...].dtype == jnp.bfloat16

    sp = SamplingParams(temperature=0.9, top_k=5)
    reqs = [Request([1, 2, 3], 9), Request([7, 8], 6, sp, seed=3), Request([4] * 5, 11, sp, seed=1),
            Request(list(range(1, 16)), 17), Request(list(range(1, 15)), 18)]  # to the cache end
    one = Engine(model, max_seq_len=32, max_batch=2, decode_block=1).run(reqs)
    eng = Engine(model, max_seq_len=32, max_batch=2, decode_block=block)
    many = eng.run(reqs)
    assert [r.tokens for r in many] == [r.tokens for r in one]
    assert [len(r.tokens) for r in many] == [9, 6, 11, 17, 18]
    if block > 2:  # (two steps never pass the end of a cache that holds prompt + new tokens)
        assert any(k[0] == "decode" and k[-1] == 1 for k in eng._executables)
    assert any(k[0] == "decode" and k[-1] == block for k in eng._executables)
    with pytest.raises(ValueError, match=r"decode_block: expected an integer in \[1, 64\]"):
        Engine(model, max_seq_len=32, decode_block=0)
    from powerinfer_jax.runtime.decode import Scheduler

    with pytest.raises(ValueError, match=r"Scheduler block: expected an integer in \[1, 64\], "
                                         r"got 65"):
        Scheduler(eng, block=65)


def test_more_new_tokens_than_the_context_holds_is_an_error(model):
    """Issue 16: a prompt near the context limit used to get fewer new tokens than asked,
    silently; now the request is refused up front, naming both numbers and the fix."""
    eng = Engine(model, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt tokens \+ new tokens <= 16.*10 \+ 100"):
        eng.generate(list(range(1, 11)), max_new_tokens=100)
    assert len(eng.generate(list(range(1, 11)), max_new_tokens=6).tokens) == 6


def test_prompt_errors(model):
    eng = Engine(model, max_seq_len=16)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"fewer than 16 tokens.*got 16"):
        eng.generate(list(range(16)), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_seq_len: expected 1\.\.64"):
        Engine(model, max_seq_len=65)


def test_prefill_bucket():
    assert [prefill_bucket(n, 64) for n in (1, 4, 5, 16, 17, 33, 64)] == [4, 4, 8, 16, 32, 64, 64]
    assert prefill_bucket(40, 48) == 48


@pytest.mark.parametrize("field,value,match", [
    ("dtype", "float16", r"dtype: expected one of \['float32', 'bfloat16'\], got 'float16'"),
    ("threads", 0, r"threads: expected an integer in \[1, \d+\] \(the CPUs this process may "
                   r"run on\), got 0"),
    ("decode_block", 0, r"decode_block: expected an integer in \[1, 64\], got 0"),
    ("decode_block", 2.0, r"decode_block: expected an integer in \[1, 64\], got 2\.0"),
])
def test_runtime_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**{field: value})


@pytest.mark.parametrize("fields,match", [
    ((-1.0, 0, 1.0), "temperature: expected a finite float >= 0"),
    ((float("nan"), 0, 1.0), "temperature: expected a finite float >= 0"),
    ((0.7, 0, 0.0), r"top_p: expected a float in \(0, 1\]"),
])
def test_sampling_params_reject_bad_values(fields, match):
    """Sampling is per request (SamplingParams; RuntimeConfig holds no sampling fields)."""
    from powerinfer_jax.config import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(*fields)


def test_model_config_rejects_bad_head_split():
    with pytest.raises(ValueError, match="n_heads: expected a multiple of n_kv_heads=3"):
        dataclasses.replace(TINY, n_kv_heads=3)


def test_bf16_cache_is_stored_as_bits_and_round_trips_exactly():
    from powerinfer_jax.models.layers import cache_storage_dtype, from_cache, to_cache
    from powerinfer_jax.models.transformer import init_cache

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 5)) * 100, jnp.float32)
    storage = cache_storage_dtype(jnp.bfloat16)
    assert storage == jnp.uint16 and cache_storage_dtype(jnp.float32) == jnp.float32
    np.testing.assert_array_equal(np.asarray(from_cache(to_cache(x, storage))),
                                  np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))
    assert init_cache(TINY, batch=1, max_len=8, dtype=jnp.bfloat16)[0][0].dtype == jnp.uint16


def test_the_any_kind_gives_the_tokens_of_the_greedy_and_sample_kinds():
    """The server's one step per shape (kind "any": a branch on whether any row samples) picks
    what the two compiled kinds pick, row by row, for greedy, sampled and mixed batches."""
    import jax
    import jax.numpy as jnp

    from powerinfer_jax.runtime import sampling as smp

    logits = jax.random.normal(jax.random.key(0), (3, 97)) * 3
    keys = smp.row_keys(jnp.asarray([1, 2, 3], jnp.uint32), jnp.asarray([5, 6, 7], jnp.int32))
    top_k, top_p = jnp.asarray([0, 5, 0], jnp.int32), jnp.asarray([1.0, 1.0, 0.9], jnp.float32)
    run = jax.jit(smp.sample_rows, static_argnames="kind")
    for temps in ([0.0, 0.0, 0.0], [0.8, 1.2, 0.5], [0.0, 1.2, 0.0]):
        t = jnp.asarray(temps, jnp.float32)
        want = run(logits, keys, t, top_k, top_p, kind="sample" if any(temps) else "greedy")
        assert run(logits, keys, t, top_k, top_p, kind="any").tolist() == want.tolist()
    greedy = run(logits, keys, jnp.zeros(3), top_k, top_p, kind="greedy")
    assert greedy.tolist() == jnp.argmax(logits, -1).tolist()
