"""Perplexity of a built model over non-overlapping chunks of a token stream (the library part of
`python -m powerinfer_jax.evaluate` and `LLM.perplexity`); with a sparse mode also the measured
FFN sparsity, and with the oracle's thresholds the predictor's recall of the oracle active set.

Two scoring protocols (`SCORES`), both honouring the model's BOS flag (`bos_id`: the token a
model whose tokenizer adds BOS, e.g. a GGUF with tokenizer.ggml.add_bos_token, sees first; None:
none), and the result says which it used:
- "all": chunks of ctx tokens (BOS and ctx-1 tokens of the text where the model takes a BOS, so
  every text token is scored; else ctx tokens of the text, every one but the first scored):
  ctx-1 tokens scored per chunk, the most a chunk of ctx positions can score.
- "second-half": as llama.cpp's llama-perplexity scores: the text's tokens (BOS first where the
  model takes one) cut into chunks of ctx, the first token of each chunk replaced by BOS where
  the model takes one, and only the tokens after the first ctx/2 scored, each with at least ctx/2
  tokens before it: ctx-1-ctx/2 tokens per chunk. The figure users compare with llama.cpp's.
"""
from __future__ import annotations

import math

import numpy as np

from powerinfer_jax.errors import check, check_choice, check_positive_int, raw

SCORES = ("all", "second-half")


def scored_per_chunk(ctx: int, score: str) -> int:
    """Tokens each chunk of ctx positions scores under `score`."""
    return ctx - 1 if score == "all" else ctx - 1 - ctx // 2


def check_scoring(ctx, max_chunks, score: str = "all") -> None:
    """The protocol's arguments, checked before any model is loaded (the evaluate CLI)."""
    check_choice("score", score, SCORES)
    least, why = (2, "") if score == "all" else (3, " after its first half")
    check(isinstance(ctx, int) and not isinstance(ctx, bool) and ctx >= least, "ctx",
          f"an integer >= {least} (a chunk must score at least one token{why})", ctx)
    if max_chunks is not None:
        check_positive_int("max_chunks", max_chunks)


def chunk_tokens(ids, ctx: int, max_chunks: int | None, *, bos_id: int | None = None,
                 score: str = "all") -> np.ndarray:
    """[n, ctx] chunks of the token stream `ids` (text tokens, no BOS) as `score` scores them,
    with `bos_id` where the model takes a BOS (module docstring); the ragged tail is dropped."""
    check_scoring(ctx, max_chunks, score)
    ids = np.asarray(ids, np.int32).reshape(-1)
    if bos_id is not None and score == "all":
        body = ctx - 1
    else:
        body = ctx
        if bos_id is not None:  # second-half: BOS starts the stream, as llama.cpp tokenizes
            ids = np.concatenate([np.asarray([bos_id], np.int32), ids])
    n = len(ids) // body
    if max_chunks is not None:
        n = min(n, max_chunks)
    check(n > 0, "text", f"at least {body} tokens (one chunk of ctx={ctx})",
          raw(f"{len(ids)} tokens"), "pass a longer text or a smaller ctx")
    chunks = ids[: n * body].reshape(n, body)
    if bos_id is None:
        return chunks
    if score == "all":
        return np.concatenate([np.full((n, 1), bos_id, np.int32), chunks], axis=1)
    chunks = chunks.copy()
    chunks[:, 0] = bos_id
    return chunks


def make_scorer(model, oracle_thresholds=None, *, first: int = 0):
    """A jitted function chunk [1, T] -> (sum of NLL of tokens first+1..T-1, mean active
    fraction, per-layer [true positives, oracle positives] [L, 2] or None). The model runs its
    configured sparsity mode (sparsity.modes.configure).

    first: the first position whose logits are scored (0: every token but the first; T//2:
    llama-perplexity's second half). oracle_thresholds: per-layer contribution thresholds
    defining the oracle active set; with them, each layer's selection is compared with it (the
    predictor's recall).
    """
    import jax  # lazy: start-up (check_scoring runs before the model loads)
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.transformer import block_residuals, capture  # lazy: start-up

    graphdef, state = nnx.split(model)
    d_ff = model.config.d_ff

    @jax.jit
    def score(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        (h, _), sown = capture(lambda m: m.hidden(tokens_bt, positions), m)
        logp = jax.nn.log_softmax(m.logits(h[:, first:-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens_bt[:, first + 1:, None], axis=-1).sum()
        n_active = sown.get("n_active")
        frac = jnp.float32(1.0) if n_active is None else n_active.mean() / d_ff
        hits = None
        if oracle_thresholds is not None:
            hits = jnp.stack([_recall_counts(layer.ffn, x, r, oracle_thresholds[i])
                              for i, (layer, x, r) in enumerate(zip(
                                  m.layers, sown["ffn_in"], block_residuals(sown, len(m.layers))))])
        return nll, frac, hits

    return lambda tokens: score(state, tokens)


def _recall_counts(ffn, x_btd, residual, oracle_threshold):
    """[true positives, oracle positives] of the layer's selection vs the oracle's active set."""
    import jax.numpy as jnp

    a = ffn.activations(x_btd)
    oracle = jnp.abs(a) > oracle_threshold
    chosen = ffn.selector.select_in_block(ffn, x_btd, residual).active(a)
    return jnp.stack([jnp.sum(oracle & chosen), jnp.sum(oracle)]).astype(jnp.float32)


def perplexity(model, ids, *, ctx: int, max_chunks: int | None, oracle_thresholds=None,
               progress: bool = False, bos_id: int | None = None, score: str = "all") -> dict:
    """Perplexity of the (configured) model over non-overlapping ctx-token chunks of ids (text
    tokens, no BOS), scored as `score` says with `bos_id` where the model takes a BOS (module
    docstring). The result names both ("score", "bos")."""
    chunks = chunk_tokens(ids, ctx, max_chunks, bos_id=bos_id, score=score)
    check(ctx <= model.config.max_seq_len, "ctx",
          f"at most {model.config.max_seq_len} (the model's context)", ctx)
    first = 0 if score == "all" else ctx // 2
    scorer = make_scorer(model, oracle_thresholds, first=first)
    total, fracs, hits = 0.0, [], 0.0
    it = chunks
    if progress:
        from tqdm import tqdm

        it = tqdm(chunks, desc="perplexity", unit="chunk")
    for chunk in it:
        nll, frac, h = scorer(chunk[None])
        total += float(nll)
        fracs.append(float(frac))
        if h is not None:
            hits = hits + np.asarray(h, np.float64)
    scored = chunks.shape[0] * scored_per_chunk(ctx, score)
    res = {"ppl": math.exp(total / scored), "tokens_scored": scored,
           "chunks": int(chunks.shape[0]), "ffn_sparsity": 1.0 - float(np.mean(fracs)),
           "score": score, "bos": bos_id is not None}
    if isinstance(hits, np.ndarray):
        res["predictor_recall"] = float(np.mean(hits[:, 0] / np.maximum(hits[:, 1], 1)))
    return res
