"""Teacher samples: what the dense model itself writes for varied prompts, as training sequences.

Distilling on the teacher's own text keeps the student close to the teacher off the corpus's domain
(chat, lists, code, dialogue), where wiki text alone would leave it unconstrained. Each sequence is
filled to exactly `seq_len` tokens with one or more turns: a prompt (chat-templated instruction or
a plain-text opening), then the teacher's sampled continuation up to its end-of-turn token.
Sampling is seeded, so the samples are reproducible; they are cached by the caller.

Two generators: `generate_samples_engine` drives the runtime's batched Engine (continuous batching
over `max_batch` slots, the CPU's quantized kernels: ~4x the XLA loop's tokens/s on 2 cores) and
packs whole turns (prompt + reply up to its end-of-turn token) into rows; `generate_samples`
steps a float model's jitted decode loop over all rows at once (no compiled extension needed:
an accelerator, or benchmarks/gpu/burst.py; one compiled step serves every position).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from powerinfer_jax.config import SamplingParams
from powerinfer_jax.errors import check_positive_int, fail
from powerinfer_jax.models.transformer import init_cache
from powerinfer_jax.runtime.decode import Request

# Instructions (sent through the model's chat template) and plain openings (continued as text).
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, in simple terms.",
    "Give me three tips for learning a new language as an adult.",
    "What is the difference between weather and climate?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Plan a three-day trip to Kyoto for someone who loves gardens.",
    "Why is the sky blue?",
    "Write a polite email asking a colleague to review a report by Friday.",
    "List the planets of the solar system with one fact about each.",
    "How do I make a simple tomato sauce?",
    "Explain recursion to a ten-year-old.",
    "Compose a haiku about autumn rain.",
    "What are the pros and cons of working from home?",
    "Describe how a bill becomes a law in the United States.",
    "Solve: a train travels 120 km in 1.5 hours. What is its average speed?",
    "Write a dialogue between a cat and a dog arguing about who is the better pet.",
    "What should I consider when buying a used car?",
    "Explain the water cycle step by step.",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "Give a short biography of Marie Curie.",
    "How does a binary search work? Show an example.",
    "Write a limerick about a forgetful robot.",
    "What are some healthy breakfast ideas?",
)
TEXT_PROMPTS = (
    "The history of the printing press begins",
    "In the early morning, the market square",
    "def parse_config(path):\n",
    "Chapter 1\n\nThe rain had not stopped for three days when",
    "The following is a list of common kitchen herbs and their uses:\n1.",
    "Photosynthesis is the process by which",
    "Dear Sir or Madam,\n\nI am writing to",
    "Q: What is the capital of Australia?\nA:",
)
TEMPERATURE = 0.8
TOP_P = 0.95
NUCLEUS_FROM = 64  # generate_samples: nucleus sampling within the 64 most likely tokens


def sample_top(logits_bv, key):
    """One token per row: temperature TEMPERATURE, nucleus TOP_P within the NUCLEUS_FROM most
    likely tokens (lax.top_k instead of sorting the whole vocabulary, which took most of a decode
    step on 2 cores; the tokens beyond rank 64 it leaves out hold a sliver of the mass where
    the nucleus is narrower than 64, as it almost always is at temperature 0.8)."""
    import jax
    import jax.numpy as jnp

    top, ids = jax.lax.top_k(logits_bv.astype(jnp.float32), NUCLEUS_FROM)  # descending
    scaled = top / TEMPERATURE
    probs = jax.nn.softmax(scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = (before < TOP_P).at[:, 0].set(True)
    choice = jax.random.categorical(key, jnp.where(kept, scaled, -jnp.inf), axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]


def prompt_texts(tokenizer) -> list[str]:
    """Every prompt as the text the model sees (chat prompts through the chat template)."""
    # a base model's prompts in ChatML, as they were before base models were refused a chat
    from powerinfer_jax.tokenizer import CHATML_TEMPLATE  # lazy: start-up

    chats = [tokenizer.apply_chat([{"role": "user", "content": p}], fallback=CHATML_TEMPLATE)
             for p in CHAT_PROMPTS]
    return chats + list(TEXT_PROMPTS)


def samples_key(fingerprint_id: str, n: int, seq_len: int, seed: int,
                generator: str = "batched-v2") -> str:
    """A cache key for the samples of one model, count, length, seed and generator (and these
    prompts)."""
    h = hashlib.sha256(json.dumps([generator, fingerprint_id, n, seq_len, seed, CHAT_PROMPTS,
                                   TEXT_PROMPTS, TEMPERATURE, TOP_P]).encode())
    return h.hexdigest()[:16]


def generate_samples_engine(engine, tokenizer, *, n: int, seq_len: int, seed: int,
                            progress: bool = True) -> np.ndarray:
    """[n, seq_len] int32 rows of whole turns written by the model behind `engine` (a
    runtime.decode.Engine with max_seq_len >= seq_len; its max_batch rows decode together).

    Each request is one turn: a random prompt, then the sampled reply up to an end-of-turn token
    or the row's length. Turns are packed into rows in request order (a row starts at a turn; its
    last turn is cut at seq_len). Requests go in waves sized from the turns seen so far, so few
    are generated past what the rows need. Every request has its own seed: the rows do not
    depend on how requests share decode steps."""
    check_positive_int("samples", n)
    if seq_len < 2:
        fail("--seq-len", "at least 2 (a prompt token and a sampled one)", seq_len)
    # a prompt longer than a row is cut to leave one sampled token (rows hold only its start)
    prompts = [tokenizer.encode(t)[:seq_len - 1] for t in prompt_texts(tokenizer)]
    rng = np.random.default_rng([seed, 2])
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    eos = tuple(tokenizer.eos_ids)
    out = np.zeros((n, seq_len), np.int32)
    row, col, turns, turn_tokens = 0, 0, 0, 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n * seq_len, desc="teacher samples", unit="tok")
    while row < n:
        left = (n - row) * seq_len - col
        mean_turn = turn_tokens / turns if turns else seq_len / 2
        wave = max(engine.max_batch, int(1.1 * left / mean_turn) + 1)
        reqs = []
        for _ in range(wave):
            prompt = prompts[int(rng.integers(len(prompts)))]
            reqs.append(Request(prompt, max_new_tokens=seq_len - len(prompt), sampling=params,
                                seed=int(rng.integers(1 << 31)), stop_ids=eos))
        for req, res in zip(reqs, engine.run(reqs)):
            if row == n:
                break
            turn = list(req.prompt_ids) + list(res.tokens)
            turns, turn_tokens = turns + 1, turn_tokens + len(turn)
            take = min(len(turn), seq_len - col)  # a turn cut at the row's end stops there
            out[row, col:col + take] = turn[:take]
            col += take
            if bar is not None:
                bar.update(take)
            if col == seq_len:
                row, col = row + 1, 0
    if bar is not None:
        bar.close()
    return out


def generate_samples(model, tokenizer, *, n: int, seq_len: int, seed: int, batch: int = 32,
                     progress: bool = True, prompts: list | None = None,
                     time_limit: float | None = None) -> np.ndarray:
    """[n, seq_len] int32 sequences written by `model` (a Transformer), `batch` rows at a time.

    All rows of a batch advance together, one position per jitted decode step over a KV cache:
    a row copies its pending prompt tokens, then samples (sample_top); when it samples an
    end-of-turn token, a new random prompt follows. (One row at a time through the runtime's
    Engine measured ~5 tokens/s here, since each turn is a new prompt to prefill; a batch of 32
    rows is one matmul per weight per position.)

    prompts: token-id lists to draw from (default: prompt_texts, encoded). time_limit: seconds
    after which no new batch starts; the rows of the batches done are returned ([m, seq_len],
    m <= n, a multiple of `batch` unless the last batch was the end)."""
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens_b, position, cache, key):
        m = nnx.merge(graphdef, state)
        positions = jnp.full((tokens_b.shape[0], 1), position, jnp.int32)
        h, cache = m.hidden(tokens_b[:, None], positions, cache, position, seq_len)
        return sample_top(m.logits(h)[:, 0], jax.random.fold_in(key, position)), cache

    if prompts is None:
        prompts = [tokenizer.encode(t) for t in prompt_texts(tokenizer)]
    rng = np.random.default_rng([seed, 2])
    eos = set(tokenizer.eos_ids)
    out = np.zeros((n, seq_len), np.int32)
    t0 = time.perf_counter()
    made = 0
    starts = range(0, n, batch)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="teacher samples", unit="batch")
    for start in starts:
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        rows = min(batch, n - start)
        pending = [list(prompts[int(rng.integers(len(prompts)))]) for _ in range(rows)]
        cache = init_cache(model.config, batch=rows, max_len=seq_len, dtype=model.dtype)
        key = jax.random.key(int(rng.integers(1 << 31)))
        seqs = np.zeros((rows, seq_len), np.int32)
        for r in range(rows):
            seqs[r, 0] = pending[r].pop(0)
        for pos in range(seq_len - 1):
            sampled, cache = step(state, jnp.asarray(seqs[:, pos]), np.int32(pos), cache, key)
            sampled = np.asarray(sampled)
            for r in range(rows):
                if pending[r]:
                    seqs[r, pos + 1] = pending[r].pop(0)
                    continue
                seqs[r, pos + 1] = sampled[r]
                if int(sampled[r]) in eos:
                    pending[r] = list(prompts[int(rng.integers(len(prompts)))])
        out[start:start + rows] = seqs
        made = start + rows
    return out[:made]
