"""The server's first request per prompt-length bucket, against a warm one (issue 37).

Starts `python -m powerinfer_jax.serve` (the default model), waits for /health 200 (timed: the
start-up a user waits for), then per prompt length (one per prefill bucket) sends a request of
that length twice, max_tokens 1, greedy, and times each (the prompt latency: the request's whole
time, its one token included). The first request of a bucket after /health says ready must take
at most 2x the second (issue 37's check). With --baseline-src the server of an older source tree
runs the same way: what the first requests paid before (its prefill steps compiled on demand).

    flock -x /tmp/pij_cpu.lock python benchmarks/serve_warm.py [--baseline-src /tmp/pij_base] \
        [--out benchmarks/serve_warm.jsonl]

Each server starts twice: the first start fills the caches (compiled steps), the second is the
one measured.

--cold (issue 53): a first start on an empty cache, as a new user's: each start gets a new
POWERINFER_JAX_CACHE holding only a copy of the model's own entry (no download), rounds
alternate the baseline and ours. Per start, rows of kind "cold_start": /health 200 after
`ready_s` (what the user waits for), a short request's time right after (`first_request_s`),
every planned step ready after `complete_s`; then one "cold_start_summary" row (medians, ratio).

    flock -x /tmp/pij_cpu.lock python benchmarks/serve_warm.py --cold --rounds 2 \
        --baseline-src /tmp/pij_base [--out benchmarks/serve_warm.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

from powerinfer_jax._machine import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]

LENGTHS = (3, 8, 24, 48, 100, 200, 400, 1000, 2000)  # prompt tokens: buckets 4 .. 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cold_cache(args) -> Path:
    """A new, empty cache holding only a copy of the model's own entry (the downloaded file)."""
    root = Path(tempfile.mkdtemp(prefix="pij-cold-"))
    src = Path(args.model_cache) / "models" / args.model
    shutil.copytree(src, root / "models" / args.model,
                    ignore=shutil.ignore_patterns("sparsity", ".*lock"))
    return root


def start(args, baseline: bool, cache_root: Path | None = None):
    port = free_port()
    argv = ["-m", "powerinfer_jax.serve", "--model", args.model, "--port", str(port),
            "--parallel", str(args.parallel), "--dtype", args.dtype, "--log-level", "warning"]
    env = dict(os.environ)
    if cache_root is not None:
        env["POWERINFER_JAX_CACHE"] = str(cache_root)
    if baseline:  # another source tree, past the editable install's redirect (startup.py)
        env["PYTHONPATH"] = os.pathsep.join([str(args.baseline_src),
                                             sysconfig.get_paths()["purelib"]])
        argv = [sys.executable, "-S", *argv]
    else:
        argv = [sys.executable, *argv]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=args.baseline_src if baseline else REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): "
                             f"{proc.stderr.read()[-2000:]}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return proc, url, time.perf_counter() - t0, r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_complete(url: str, timeout: float = 1800.0) -> float:
    """Seconds until /health says every planned step is ready (at once where it has no such
    field: a server that warms everything before it answers 200)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        warm = httpx.get(url + "/health", timeout=30).json().get("warm") or {}
        if warm.get("complete", True):
            return time.perf_counter() - t0
        time.sleep(0.2)
    raise SystemExit(f"the server's warm-up did not complete within {timeout} s")


def cold(args, base: dict) -> list[dict]:
    """--cold: first starts on empty caches, rounds alternating baseline and ours."""
    rows = []
    modes = ["ours"] + (["baseline"] if args.baseline_src is not None else [])
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            root = cold_cache(args)
            try:
                proc, url, ready_s, health = start(args, mode == "baseline", root)
                try:
                    first = request_s(url, args.model, 8)
                    complete = ready_s + first + wait_complete(url)
                    after = httpx.get(url + "/health").json()
                finally:
                    stop(proc)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            rows.append({**base, "kind": "cold_start", "mode": mode, "round": r,
                         "ready_s": ready_s, "first_request_s": first, "complete_s": complete,
                         "warm_at_ready": health.get("warm"), "warm_after": after.get("warm"),
                         "loadavg": os.getloadavg()[0]})
            print(f"{mode:8s} round {r}: /health 200 after {ready_s:.1f} s, a short request "
                  f"{first:.2f} s, every step ready after {complete:.1f} s", file=sys.stderr)
    med = {m: statistics.median(x["ready_s"] for x in rows if x["mode"] == m) for m in modes}
    summary = {**base, "kind": "cold_start_summary", "summary": True, "rounds": args.rounds,
               "median_ready_s": med,
               "median_complete_s": {m: statistics.median(x["complete_s"] for x in rows
                                                          if x["mode"] == m) for m in modes}}
    if "baseline" in med:
        summary["ready_ratio_baseline_to_ours"] = med["baseline"] / med["ours"]
    return rows + [summary]


def request_s(url: str, model: str, n: int) -> float:
    body = {"model": model, "prompt": [100 + i % 1000 for i in range(n)], "max_tokens": 1,
            "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"request of {n} tokens: {r.status_code} {r.text[:500]}")
    return elapsed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="also run the server of this source tree (an older commit; see "
                        "benchmarks/startup.py) the same way")
    p.add_argument("--fill-only", action="store_true",
                   help="only the first starts (fill the caches, untimed: run it outside the "
                        "exclusive lock first)")
    p.add_argument("--cold", action="store_true",
                   help="first starts on empty caches (see the module docstring)")
    p.add_argument("--rounds", type=int, default=2, help="--cold: rounds (default: 2)")
    p.add_argument("--model-cache", default=str(Path.home() / ".cache" / "powerinfer_jax"),
                   help="--cold: the cache whose models/<model> is copied into each empty one")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base = {"bench": "serve_warm", "run_id": time.strftime("%Y%m%dT%H%M%S"),
            "commit": git_commit(), "machine": machine_info(),
            "threads": len(os.sched_getaffinity(0)),
            "config": {"model": args.model, "dtype": args.dtype, "parallel": args.parallel,
                       "max_tokens": 1, "lengths": list(LENGTHS)}}
    if args.cold:
        base["config"] = {**base["config"], "cache": "cold", "lengths": [8]}
        rows = cold(args, base)
        print(json.dumps(rows[-1], indent=1))
        _write(args.out, rows)
        return
    rows = []
    for mode in ["ours"] + (["baseline"] if args.baseline_src is not None else []):
        for attempt in ("fills the caches",) + (() if args.fill_only else ("measured",)):
            proc, url, ready_s, health = start(args, mode == "baseline")
            try:
                wait_complete(url)  # the steps warmed beside a ready server (loaded: quick)
                if attempt == "measured":
                    for n in LENGTHS:
                        first = request_s(url, args.model, n)
                        second = request_s(url, args.model, n)
                        rows.append({**base, "mode": mode, "prompt_tokens": n,
                                     "first_s": first, "warm_s": second,
                                     "ratio": first / second, "within_2x": first <= 2 * second,
                                     "loadavg": os.getloadavg()[0]})
                        print(f"{mode:6s} {n:5d} tokens: first {first:.3f} s, warm "
                              f"{second:.3f} s ({first / second:.2f}x)", file=sys.stderr)
                    after = httpx.get(url + "/health").json()
                    rows.append({**base, "mode": mode, "summary": True, "ready_s": ready_s,
                                 "warm_at_ready": health.get("warm"),
                                 "warm_after": after.get("warm"),
                                 "all_within_2x": all(r["within_2x"] for r in rows
                                                      if r.get("mode") == mode
                                                      and "within_2x" in r)})
                    print(f"{mode}: /health 200 after {ready_s:.1f} s ({health.get('warm')})",
                          file=sys.stderr)
            finally:
                stop(proc)
    print(json.dumps([r for r in rows if r.get("summary")], indent=1))
    _write(args.out, rows)


def _write(out, rows) -> None:
    if out:
        with open(out, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
