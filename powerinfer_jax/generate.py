"""Generate text: `python -m powerinfer_jax.generate --prompt "..." [--model NAME] [--json]`.

Streams the continuation to stdout as it is produced. With --json, the last stdout line is one JSON
object: text, tokens, prompt_tokens, prefill_tok_s, decode_tok_s (plus stop_reason and the config).
"""
from __future__ import annotations

import argparse
import sys

from powerinfer_jax import _cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_common_flags(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="wrap the prompt in the model's chat template as a user message")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)
    from powerinfer_jax.runtime.sampling import SamplingParams
    from powerinfer_jax.tokenizer import StreamDecoder
    from powerinfer_jax.runtime.session import (configs_from_args, open_session,
                                                placement_from_args)

    runtime, sparsity = configs_from_args(
        args, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if not args.prompt:
        raise ValueError("--prompt: expected non-empty text, got ''")
    s = open_session(args.model, runtime, sparsity, placement=placement_from_args(args))
    tok = s.tokenizer
    text = tok.apply_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text)
    s.engine.check_prompt(len(ids))
    stream = StreamDecoder(tok)

    def on_token(t: int) -> None:
        if args.stream and t not in tok.eos_ids:
            sys.stdout.write(stream.feed(t))
            sys.stdout.flush()

    res = s.engine.generate(ids, max_new_tokens=runtime.max_new_tokens,
                            sampling=SamplingParams(runtime.temperature, runtime.top_k,
                                                    runtime.top_p),
                            seed=runtime.seed, stop_ids=tok.eos_ids, on_token=on_token)
    if args.stream:
        sys.stdout.write(stream.flush() + "\n")
    body = [t for t in res.tokens if t not in tok.eos_ids]
    text_out = tok.decode(body)
    if not args.stream:
        print(text_out)
    if args.json:
        _cli.print_json({
            "text": text_out, "tokens": res.tokens, "prompt_tokens": res.prompt_tokens,
            "prefill_tok_s": res.prefill_tok_s, "decode_tok_s": res.decode_tok_s,
            "first_token_s": res.first_token_s, "compile_s": res.compile_s, "stop_reason": res.stop_reason,
            "model": args.model, "dtype": runtime.dtype, "threads": threads,
            "sparsity": sparsity.mode})


if __name__ == "__main__":
    _cli.run_main(main)
