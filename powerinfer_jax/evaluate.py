"""Perplexity: `python -m powerinfer_jax.evaluate --text FILE [--ctx 512] [--max-chunks N]
[--score {all,second-half}] [--json]`.

The whole file is tokenized once and cut into non-overlapping chunks of --ctx tokens. --score all
(default): every token of a chunk but the first is scored; second-half: only the tokens after the
first ctx/2 of each chunk, as llama.cpp's llama-perplexity scores (the figure to compare with
its). Each chunk starts with BOS where the model's tokenizer adds one (a GGUF's
tokenizer.ggml.add_bos_token; --bos/--no-bos overrides it). The output says which protocol ran
(`score`, `bos`). With a sparse mode, also reports the measured FFN sparsity
(fraction of neurons skipped, averaged over layers and tokens). Modes threshold and predictor (and
oracle with --target-sparsity) use the model's calibrated sparsity artifacts; predictor mode also
reports `predictor_recall`: the fraction of the oracle active set (|a_i| above the calibrated
contribution threshold, on the same FFN inputs) that the predictors selected, averaged over layers.
"""
from __future__ import annotations

import argparse

from powerinfer_jax import _cli
from powerinfer_jax.api import LLM
from powerinfer_jax.runtime.perplexity import SCORES, check_scoring


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_common_flags(p)
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--max-chunks", type=int, default=None, help="score at most N chunks")
    p.add_argument("--score", default="all", choices=SCORES,
                   help="which tokens of each chunk are scored: all (but the first) or "
                        "second-half (after the first ctx/2, as llama-perplexity scores) "
                        "(default: %(default)s)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="start each chunk with the BOS token (default: as the model's "
                        "tokenizer says, e.g. a GGUF's tokenizer.ggml.add_bos_token)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


@_cli.speaks_flags(build_parser)
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)
    check_scoring(args.ctx, args.max_chunks, args.score)  # before the model loads
    _cli.configs_from_args(args)
    text = _cli.read_text_file(args.text, "--text")
    llm = LLM(_cli.build_from_args(args))
    res = llm.perplexity(text, ctx=args.ctx, max_chunks=args.max_chunks, score=args.score,
                         bos=args.bos, progress=args.progress and not args.json)
    recall = f", predictor recall {res['predictor_recall']:.3f}" if "predictor_recall" in res else ""
    scored = ("second half of each chunk scored, as llama-perplexity"
              if res["score"] == "second-half" else "all but each chunk's first token scored")
    print(f"perplexity {res['ppl']:.4f} over {res['tokens_scored']} tokens "
          f"({res['chunks']} chunks of {args.ctx}, {scored}, "
          f"{'BOS first' if res['bos'] else 'no BOS'}), "
          f"FFN sparsity {res['ffn_sparsity']:.3f}{recall}")
    if args.json:
        s = llm.session
        _cli.print_json({**res, **s.describe(), "threads": threads,
                         "threshold": s.sparsity.threshold, "impl": s.sparsity.impl,
                         "ctx": args.ctx})


if __name__ == "__main__":
    _cli.run_main(main)
