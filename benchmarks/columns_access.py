"""The read-bandwidth ceiling of input sparsity's access pattern, per matrix shape: what skipping
input channels can save at best on this machine, before any arithmetic.

A matrix in the columns layout (cpu_backend/qcolumns.h) stores each input channel's codes of a
32-channel block as one run of rows / 2 bytes (4-bit formats), runs an odd number of 64-byte
lines apart; a token whose input keeps a fraction `keep` of the channels reads that fraction of
the runs, each whole. This times exactly that read (no arithmetic; `_pij_ext.runs_sum`, the
kernels' thread pool) for the run lengths of the shapes measured elsewhere, at keep 1, 0.6 and
0.5, interleaved per round, next to a plain stream over the same array:

    384 B   a 768-row expert's gate or up (Qwen3-30B-A3B)
    768 B   1536 rows: an expert's gate and up side by side
    1 KiB   2048 rows: an MoE expert's down, a 7B model's o
    2 KiB   4096 rows: a 7B model's down (and q)
    7 KiB   14336 rows: a 7B model's gate / up

One summary row per (run, keep) in benchmarks/columns_access.jsonl: `gbs` (the bytes read per
second), `over_stream` (that over the plain stream's), `time_over_keep1` (the time to read the
kept runs over the time to read all of them), and `time_over_stream` (over the time a plain
stream takes to read all of them: the dense kernels' read; below 1 is what input sparsity at
1 - keep can gain at most on this shape, keep itself being a perfect skip).

    python -m benchmarks.columns_access [--threads 2] [--rounds 5] [--mib 256] [--note ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "columns_access.jsonl"
RUNS = {384: "768-row expert gate/up", 768: "1536 rows: gate and up side by side",
        1024: "2048 rows: MoE down, 7B o", 2048: "4096 rows: 7B down", 7168: "14336 rows: 7B gate/up"}
KEEPS = (1.0, 0.6, 0.5)


def stride_of(run: int) -> int:
    """qcolumns.cc ChannelStride: the run rounded up to an odd number of 64-byte lines."""
    lines = (run + 63) // 64
    return 64 * (lines if lines % 2 else lines + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="array size (far above the caches)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--note", default="", help="what else ran on the machine (kept in each row)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.mib < 16:
        ap.error("expected --threads >= 1, --rounds >= 1, --mib >= 16")
    from benchmarks.q4_vs_llamacpp import machine
    from powerinfer_jax import ops
    from powerinfer_jax._bench_ops import read_bandwidth_gbs, runs_bandwidth_gbs

    ops.set_num_threads(args.threads)
    nbytes = args.mib << 20
    base = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
            "machine": machine(), "threads": args.threads, "mib": args.mib, "note": args.note}
    got: dict = {}
    with open(args.out, "a", encoding="utf-8") as out:
        for rnd in range(args.rounds):
            stream = read_bandwidth_gbs(nbytes=nbytes)
            got.setdefault("stream", []).append(stream)
            out.write(json.dumps({**base, "kind": "run", "round": rnd, "pattern": "stream",
                                  "gbs": stream}) + "\n")
            for run in RUNS:
                for keep in KEEPS:
                    gbs, read = runs_bandwidth_gbs(run, stride_of(run), keep, nbytes=nbytes,
                                                   seed=rnd)
                    got.setdefault((run, keep), []).append((gbs, read))
                    out.write(json.dumps({**base, "kind": "run", "round": rnd, "pattern": "runs",
                                          "run_bytes": run, "stride_bytes": stride_of(run),
                                          "keep": keep, "gbs": gbs, "bytes": read}) + "\n")
        stream = statistics.median(got["stream"])
        for run, what in RUNS.items():
            full = [read / gbs for gbs, read in got[(run, 1.0)]]  # per round: all runs' time
            dense = [read / s for (_, read), s in zip(got[(run, 1.0)], got["stream"])]
            for keep in KEEPS:
                rows = got[(run, keep)]
                gbs = statistics.median(g for g, _ in rows)
                ratio = statistics.median((read / g) / f for (g, read), f in zip(rows, full))
                vs = statistics.median((read / g) / d for (g, read), d in zip(rows, dense))
                row = {**base, "kind": "summary", "run_bytes": run, "stride_bytes": stride_of(run),
                       "shape": what, "keep": keep, "gbs": gbs, "stream_gbs": stream,
                       "over_stream": gbs / stream, "time_over_keep1": ratio,
                       "time_over_stream": vs}
                out.write(json.dumps(row) + "\n")
                print(f"{run:5d} B ({what}), keep {keep}: {gbs:.1f} GB/s "
                      f"({gbs / stream:.2f}x stream), time {ratio:.2f}x keep 1, "
                      f"{vs:.2f}x a stream of all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
