"""Perplexity of a built model over non-overlapping chunks of a token stream (the library part of
`python -m powerinfer_jax.evaluate` and `LLM.perplexity`): every token of a chunk but the first is
scored; with a sparse mode also the measured FFN sparsity, and with the oracle's thresholds the
predictor's recall of the oracle active set."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.errors import check, check_positive_int, raw
from powerinfer_jax.models.transformer import capture


def chunk_tokens(ids, ctx: int, max_chunks: int | None) -> np.ndarray:
    """Non-overlapping [n, ctx] chunks of the token stream (the ragged tail is dropped)."""
    check(isinstance(ctx, int) and ctx >= 2, "ctx", "an integer >= 2", ctx)
    n = len(ids) // ctx
    if max_chunks is not None:
        check_positive_int("max_chunks", max_chunks)
        n = min(n, max_chunks)
    check(n > 0, "text", f"at least {ctx} tokens (one chunk of ctx={ctx})",
          raw(f"{len(ids)} tokens"), "pass a longer text or a smaller ctx")
    return np.asarray(ids[: n * ctx], np.int32).reshape(n, ctx)


def make_scorer(model, oracle_thresholds=None):
    """A jitted function chunk [1, T] -> (sum of NLL of tokens 1..T-1, mean active fraction,
    per-layer [true positives, oracle positives] [L, 2] or None). The model runs its configured
    sparsity mode (sparsity.modes.configure).

    oracle_thresholds: per-layer contribution thresholds defining the oracle active set; with
    them, each layer's selection is compared with it (the predictor's recall).
    """
    graphdef, state = nnx.split(model)
    d_ff = model.config.d_ff

    @jax.jit
    def score(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        (h, _), sown = capture(lambda m: m.hidden(tokens_bt, positions), m)
        logp = jax.nn.log_softmax(m.logits(h[:, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1).sum()
        n_active = sown.get("n_active")
        frac = jnp.float32(1.0) if n_active is None else n_active.mean() / d_ff
        hits = None
        if oracle_thresholds is not None:
            hits = jnp.stack([_recall_counts(layer.ffn, x, oracle_thresholds[i])
                              for i, (layer, x) in enumerate(zip(m.layers, sown["ffn_in"]))])
        return nll, frac, hits

    return lambda tokens: score(state, tokens)


def _recall_counts(ffn, x_btd, oracle_threshold):
    """[true positives, oracle positives] of the layer's selection vs the oracle's active set."""
    a = ffn.activations(x_btd)
    oracle = jnp.abs(a) > oracle_threshold
    chosen = ffn.selector.select(ffn, x_btd).active(a)
    return jnp.stack([jnp.sum(oracle & chosen), jnp.sum(oracle)]).astype(jnp.float32)


def perplexity(model, ids, *, ctx: int, max_chunks: int | None, oracle_thresholds=None,
               progress: bool = False) -> dict:
    """Perplexity of the (configured) model over non-overlapping ctx-token chunks of ids."""
    chunks = chunk_tokens(ids, ctx, max_chunks)
    check(ctx <= model.config.max_seq_len, "ctx",
          f"at most {model.config.max_seq_len} (the model's context)", ctx)
    score = make_scorer(model, oracle_thresholds)
    total, fracs, hits = 0.0, [], 0.0
    it = chunks
    if progress:
        from tqdm import tqdm

        it = tqdm(chunks, desc="perplexity", unit="chunk")
    for chunk in it:
        nll, frac, h = score(chunk[None])
        total += float(nll)
        fracs.append(float(frac))
        if h is not None:
            hits = hits + np.asarray(h, np.float64)
    scored = chunks.shape[0] * (ctx - 1)
    res = {"ppl": math.exp(total / scored), "tokens_scored": scored,
           "chunks": int(chunks.shape[0]), "ffn_sparsity": 1.0 - float(np.mean(fracs))}
    if isinstance(hits, np.ndarray):
        res["predictor_recall"] = float(np.mean(hits[:, 0] / np.maximum(hits[:, 1], 1)))
    return res
