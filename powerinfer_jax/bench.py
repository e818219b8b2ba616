"""Benchmarks: `python -m powerinfer_jax.bench [--prompt-tokens 64] [--new-tokens 128] [--out FILE]`.

Model mode (default): prefill and decode tokens/s, median of --repeats after a cold run (whose first
token time, compile included, is reported as first_token_s). EOS is ignored so every run decodes
exactly --new-tokens. `--op sparse_ffn` benchmarks the sparse FFN custom call alone instead.
With --out, one JSONL row (config, commit, machine, threads, dtype) is appended.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics

from powerinfer_jax import _cli

# A fixed, license-free passage used to build benchmark prompts of any length.
_PROMPT_TEXT = ("The history of computing is a story of ideas that made machines faster, smaller and "
                "easier to program. Early engineers built circuits by hand, and every new design "
                "taught them how memory, arithmetic and control fit together. ")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_common_flags(p)
    p.add_argument("--op", default=None, choices=["sparse_ffn"],
                   help="benchmark one op instead of the whole model")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the cold one")
    p.add_argument("--out", default=None, help="append the result as a JSONL row to this file")
    p.add_argument("--tag", default="", help="free-form label stored in the row")
    # --op sparse_ffn
    p.add_argument("--d", type=int, default=4096, help="op: model width D")
    p.add_argument("--f", type=int, default=11008, help="op: FFN neurons F")
    p.add_argument("--t", type=int, default=1, help="op: tokens T")
    p.add_argument("--active", type=float, default=0.1, help="op: fraction of active neurons")
    p.add_argument("--gated", action=argparse.BooleanOptionalAction, default=True)
    return p


def prompt_ids(tokenizer, n: int) -> list[int]:
    if n < 1:
        raise ValueError(f"--prompt-tokens: expected a positive integer, got {n}")
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(_PROMPT_TEXT, add_bos=False)
    return ids[:n]


def bench_model(session, *, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    if new_tokens < 2:
        raise ValueError(f"--new-tokens: expected an integer >= 2, got {new_tokens}")
    if repeats < 1:
        raise ValueError(f"--repeats: expected a positive integer, got {repeats}")
    eng = session.engine
    ids = prompt_ids(session.tokenizer, prompt_tokens)
    eng.check_prompt(len(ids))
    if len(ids) + new_tokens > eng.max_seq_len:
        raise ValueError(f"--prompt-tokens + --new-tokens: expected at most {eng.max_seq_len} "
                         f"(--max-seq-len), got {len(ids) + new_tokens}")
    cold = eng.generate(ids, max_new_tokens=new_tokens)
    offload = getattr(session, "offload", None)
    if offload is not None and offload.store is not None:
        offload.store.reset_stats()  # --ram-budget: the store's counts cover the timed runs
    read0 = _proc_read_bytes()
    runs = [eng.generate(ids, max_new_tokens=new_tokens) for _ in range(repeats)]
    read1 = _proc_read_bytes()
    return {
        "prefill_tok_s": statistics.median(r.prefill_tok_s for r in runs),
        "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
        "first_token_s": cold.first_token_s, "compile_s": cold.compile_s,
        "decode_tok_s_runs": [r.decode_tok_s for r in runs],
        "prompt_tokens": len(ids), "new_tokens": new_tokens, "repeats": repeats,
        "compiles": eng.compile_count,
        "tokens": runs[-1].tokens,  # greedy: equal across runs; compared between configurations
        # what this process read from the disk during the timed runs (the kernel's count,
        # /proc/self/io; None off Linux): a cross-check of a neuron store's own count
        "proc_read_bytes_timed": None if read0 is None else read1 - read0,
    }


def _proc_read_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def row_header(args, threads: int, session=None) -> dict:
    """The row's provenance and config (the built session's own description when there is one)."""
    import jax

    row = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": _cli.git_commit(), "machine": _cli.machine_info(), "threads": threads,
           "dtype": args.dtype, "model": args.model, "sparsity": args.sparsity,
           "threshold": args.threshold, "kernels": args.kernels,
           "target_sparsity": args.target_sparsity, "jax": jax.__version__,
           "backend": jax.default_backend(), "tag": args.tag}
    if session is not None:
        row.update(session.describe(), threads=threads)
    return row


@_cli.speaks_flags(build_parser)
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    threads = _cli.setup(args)
    if args.out:
        _cli.check_writable(args.out, "--out")
    session = None
    if args.op == "sparse_ffn":
        from powerinfer_jax._bench_ops import bench_sparse_ffn  # lazy: start-up (bench CLI)

        res = {"bench": "op", "op": "sparse_ffn",
               **bench_sparse_ffn(d=args.d, f=args.f, t=args.t, active=args.active,
                                  dtype=args.dtype, gated=args.gated, repeats=args.repeats)}
    else:
        session = _cli.build_from_args(args)
        res = {"bench": "model", **bench_model(session, prompt_tokens=args.prompt_tokens,
                                               new_tokens=args.new_tokens, repeats=args.repeats)}
    row = {**row_header(args, threads, session), **res}
    summary = {k: v for k, v in res.items() if isinstance(v, (int, float, str))}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in summary.items()))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    if args.json:
        _cli.print_json(row)


if __name__ == "__main__":
    _cli.run_main(main)
