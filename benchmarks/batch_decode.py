"""Aggregate decode throughput of batched decoding (issue 15): B sequences sharing each decode
step vs the same B sequences one after another, on one built model, interleaved in rounds.

Every configuration first checks that batched greedy tokens equal each sequence's own (the
engine's guarantee), then times; a mismatch is recorded as a "mismatch" row and not timed.
One JSONL row per (dtype, mode, B) with the config, commit, machine and threads, appended to
benchmarks/batch_decode.jsonl.

  python -m benchmarks.batch_decode [--dtypes bfloat16] [--batches 1 4 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TEXT = ("The history of computing is a story of ideas that made machines faster, smaller and "
        "easier to program. Early engineers built circuits by hand, and every new design taught "
        "them how memory, arithmetic and control fit together.").split()


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens (rotations of one passage)."""
    out = []
    for i in range(n):
        words = TEXT[i % len(TEXT):] + TEXT[:i % len(TEXT)]
        ids = tokenizer.encode(" ".join(words * 4), add_bos=False)[:length]
        out.append(ids)
    return out


def timed(engine, reqs) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = engine.run(reqs)
    return time.perf_counter() - t0, sum(len(r.tokens) for r in res)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--modes", nargs="+", default=["dense"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--weights", choices=["dtype", "auto"], default="dtype",
                   help="dtype: the file dequantized to --dtypes (the earlier rows); auto: a "
                        "quantized file's blocks kept, as users run it")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "batch_decode.jsonl"))
    args = p.parse_args(argv)

    from experiments import _common
    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.runtime.decode import Request

    threads = _cli.configure_threads(args.threads)
    ckpt = load_checkpoint(args.model, keep_quantized=args.weights == "auto")
    max_b = max(args.batches)
    max_len = args.prompt_tokens + args.new_tokens + 8
    rows = []
    for dtype in args.dtypes:
        for mode in args.modes:
            session = _common.build_mode(args.model, mode, dtype=dtype, max_seq_len=max_len,
                                         checkpoint=ckpt, max_batch=max_b)
            eng = session.engine
            ps = prompts(session.tokenizer, max_b, args.prompt_tokens)
            for b in args.batches:
                reqs = [Request(q, args.new_tokens) for q in ps[:b]]
                alone = [eng.run([r])[0].tokens for r in reqs]  # also compiles batch-1 buckets
                together = [r.tokens for r in eng.run(reqs)]  # compiles this batch's buckets
                if together != alone:  # recorded, not timed; the other configurations go on
                    differ = [i for i, (x, y) in enumerate(zip(together, alone)) if x != y]
                    cfg = {"mode": mode, "batch": b, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "tag": args.tag,
                           "weights": args.weights}
                    rows.append({**_common.header("batch_decode", threads=threads, dtype=dtype,
                                                  model=args.model, config=cfg, quick=False),
                                 "batch": b, "mode": mode, "status": "mismatch",
                                 "sequences_differing": differ})
                    print(f"B={b} {dtype} {mode}: batched tokens differ from each sequence's own "
                          f"(sequences {differ}); not timing a wrong result", flush=True)
                    continue
                batched, sequential = [], []
                for _ in range(args.rounds):  # interleaved: the VM drifts between runs
                    s, n = timed(eng, reqs)
                    batched.append(n / s)
                    s_tot = n_tot = 0
                    for r in reqs:
                        s, n = timed(eng, [r])
                        s_tot, n_tot = s_tot + s, n_tot + n
                    sequential.append(n_tot / s_tot)
                ratios = [x / y for x, y in zip(batched, sequential)]
                cfg = {"mode": mode, "batch": b, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "rounds": args.rounds, "tag": args.tag,
                       "weights": args.weights}
                row = {**_common.header("batch_decode", threads=threads, dtype=dtype,
                                        model=args.model, config=cfg, quick=False),
                       "batch": b, "mode": mode, "aggregate_tok_s_rounds": batched,
                       "sequential_tok_s_rounds": sequential,
                       "aggregate_tok_s": statistics.median(batched),
                       "sequential_tok_s": statistics.median(sequential),
                       "ratio_to_sequential": statistics.median(ratios),
                       "compiles": eng.compile_count}
                rows.append(row)
                print(f"threads={threads} {dtype} {mode} B={b:3d}: batched "
                      f"{row['aggregate_tok_s']:7.1f} tok/s, one after another "
                      f"{row['sequential_tok_s']:6.1f} tok/s, x{row['ratio_to_sequential']:.2f}",
                      flush=True)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
