"""Perplexity: `python -m powerinfer_jax.evaluate --text FILE [--ctx 512] [--max-chunks N] [--json]`.

The whole file is tokenized once (no BOS) and cut into non-overlapping chunks of --ctx tokens; every
token of a chunk but the first is scored. With a sparse mode, also reports the measured FFN sparsity
(fraction of neurons skipped, averaged over layers and tokens).
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np

from powerinfer_jax import _cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_common_flags(p)
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--max-chunks", type=int, default=None, help="score at most N chunks")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


def chunk_tokens(ids, ctx: int, max_chunks: int | None) -> np.ndarray:
    """Non-overlapping [n, ctx] chunks of the token stream (the ragged tail is dropped)."""
    if ctx < 2:
        raise ValueError(f"--ctx: expected an integer >= 2, got {ctx}")
    n = len(ids) // ctx
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"--max-chunks: expected a positive integer, got {max_chunks}")
        n = min(n, max_chunks)
    if n == 0:
        raise ValueError(f"--text: expected at least --ctx={ctx} tokens, got {len(ids)}")
    return np.asarray(ids[: n * ctx], np.int32).reshape(n, ctx)


def make_scorer(model, sparsity, thresholds=None):
    """A jitted function chunk [1, T] -> (sum of NLL of tokens 1..T-1, mean active fraction)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    d_ff = model.config.d_ff

    @jax.jit
    def score(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        h, _, n_active = m.hidden(tokens_bt, positions, sparsity=sparsity, thresholds=thresholds)
        logp = jax.nn.log_softmax(m.logits(h[:, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1).sum()
        frac = jnp.float32(1.0) if n_active is None else n_active.mean() / d_ff
        return nll, frac

    return lambda tokens: score(state, tokens)


def perplexity(model, ids, *, ctx: int, max_chunks: int | None, sparsity, thresholds=None,
               progress: bool = False) -> dict:
    chunks = chunk_tokens(ids, ctx, max_chunks)
    if ctx > model.config.max_seq_len:
        raise ValueError(f"--ctx: expected at most {model.config.max_seq_len} (the model's "
                         f"context), got {ctx}")
    score = make_scorer(model, sparsity, thresholds)
    total, fracs = 0.0, []
    it = chunks
    if progress:
        from tqdm import tqdm

        it = tqdm(chunks, desc="perplexity", unit="chunk")
    for chunk in it:
        nll, frac = score(chunk[None])
        total += float(nll)
        fracs.append(float(frac))
    scored = chunks.shape[0] * (ctx - 1)
    return {"ppl": math.exp(total / scored), "tokens_scored": scored,
            "chunks": int(chunks.shape[0]), "ffn_sparsity": 1.0 - float(np.mean(fracs))}


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)
    from powerinfer_jax.runtime.session import configs_from_args, open_session

    if not os.path.isfile(args.text):
        raise FileNotFoundError(f"--text: expected an existing file, got {args.text!r}")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    runtime, sparsity = configs_from_args(args)
    s = open_session(args.model, runtime, sparsity)
    ids = s.tokenizer.encode(text, add_bos=False)
    res = perplexity(s.model, ids, ctx=args.ctx, max_chunks=args.max_chunks, sparsity=sparsity,
                     progress=args.progress and not args.json)
    print(f"perplexity {res['ppl']:.4f} over {res['tokens_scored']} tokens "
          f"({res['chunks']} chunks of {args.ctx}), FFN sparsity {res['ffn_sparsity']:.3f}")
    if args.json:
        _cli.print_json({**res, "model": args.model, "dtype": runtime.dtype, "threads": threads,
                         "sparsity": sparsity.mode, "threshold": sparsity.threshold,
                         "ctx": args.ctx})


if __name__ == "__main__":
    _cli.run_main(main)
