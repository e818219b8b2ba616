"""Generate text: `python -m powerinfer_jax.generate --prompt "..." [--model NAME] [--json]`.

Streams the continuation to stdout as it is produced. With --json, the last stdout line is one JSON
object: text, tokens, prompt_tokens, prefill_tok_s, decode_tok_s (plus stop_reason and the config).
"""
from __future__ import annotations

import argparse
import sys

from powerinfer_jax import _cli
from powerinfer_jax.api import LLM
from powerinfer_jax.errors import UserError

KV_MIN = 128  # runtime/decode.py's smallest cache bucket


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_common_flags(p)
    for action in p._actions:
        if "--max-seq-len" in action.option_strings:
            action.help = ("KV cache length (default: the prompt's tokens plus --max-new-tokens, "
                           "rounded up to a power of two >= 128)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    _cli.add_sampling_flags(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable; excluded from the output)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="wrap the prompt in the model's chat template as a user message (a "
                        "model without a template is refused: see --chat-template)")
    _cli.add_chat_template_flag(p)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated")
    return p


@_cli.speaks_flags(build_parser)
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)

    if not args.prompt:
        raise UserError("--prompt: expected non-empty text, got ''")
    # flag errors (prompt, sampling, seed, template) before the model loads
    from powerinfer_jax.tokenizer import check_text  # lazy: start-up

    check_text(args.prompt, "prompt")
    template = _cli.chat_template_from_args(args)
    _cli.check_sampling_flags(args)
    _cli.configs_from_args(args)
    started = _cli.process_age()
    llm = LLM(_cli.build_from_args(args))
    if template is not None:
        llm.tokenizer.chat_template = template
    ids = llm.encode(args.prompt, chat=args.chat)
    if args.max_seq_len is None:  # a cache for this run only: allocated and zeroed faster
        llm.session.kv_limit = kv_for(len(ids) + args.max_new_tokens)
    engine = llm.session.engine
    engine.check_prompt(len(ids), args.max_new_tokens)
    _cli.resume_collector()  # start-up is over (run_main paused the collector)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    before = (_cli.process_age(), engine.compile_s)
    out = llm.generate(ids, on_text=show if args.stream else None, **kw)
    print("" if args.stream else out.text)
    if args.json:
        _cli.print_json({
            "text": out.text, "tokens": out.token_ids, "prompt_tokens": out.prompt_tokens,
            "prefill_tok_s": out.prefill_tok_s, "decode_tok_s": out.decode_tok_s,
            "first_token_s": out.first_token_s, "stop_reason": out.finish_reason,
            **llm.session.describe(), "threads": threads, "plan": llm.session.plan[0],
            "startup": startup(llm.session, started, before, out)})


def kv_for(positions: int) -> int:
    """KV cache positions for a one-shot run: a power of two (a step compiled for it is reused
    by the next run of a similar length), at least the smallest cache bucket. The steps read
    only a bucket of the cache, never its whole length: the tokens are those of a full cache."""
    return max(KV_MIN, 1 << (positions - 1).bit_length())


def startup(session, started: float, before: tuple[float, float], out) -> dict:
    """Where this process's time went, in seconds from its start: import (the interpreter, the
    CLI, argparse), jax (import, the kernels' registration, XLA's client), load (the model code's
    import, the checkpoint and tokenizer; from a model snapshot: reading it), build (modules,
    layouts, sparsity; 0 from a snapshot), executables (the main thread's waits for the compiled
    steps: loaded in the background, or compiled), first token (prefill), decode (the other
    tokens and their text). Process exit is not in it. model: "snapshot" where the run started
    from the model's snapshot (runtime/snapshot.py), else "built"."""
    engine = session.engine
    t = session.timings
    waited = engine.compile_s - before[1]
    generated = _cli.process_age() - before[0] - waited
    first = out.first_token_s  # prefill: a single prompt's steps are ready before it starts
    row = {"import_s": started, "jax_s": t.get("jax_s"), "load_s": t.get("load_s"),
           "build_s": t.get("build_s"),
           "other_s": before[0] - started - sum(t.get(k, 0.0) for k in ("jax_s", "load_s",
                                                                       "build_s")),
           "executables_s": waited, "first_token_s": first, "decode_s": generated - first,
           "total_s": _cli.process_age(),
           "executables": {"loaded": engine.loaded_count, "compiled": engine.compile_count,
                           "background_s": getattr(engine.store, "background_s", 0.0)},
           "model": "snapshot" if session.snapshot is not None else "built"}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


if __name__ == "__main__":
    _cli.run_main(main, pause_collector=True)
