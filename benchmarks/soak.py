"""Soak: the server (`python -m powerinfer_jax.serve`, default model, --parallel 8) under a bounded
mixed load on 127.0.0.1 for --minutes, watching its memory, file descriptors and threads.

The load: --clients concurrent client loops (closed loop: each sends its next request when its
last one ends), each request drawn from a seeded mix:
  completion / chat, whole or streamed, with different sampling settings (greedy; temperature
  0.7 or 1.2 with top-p, top-k and a seed), 3 to context/16 words, 4 to min(48, context/4)
  new tokens;
  a stream the client closes after a few chunks (the server must cancel it and free the slot);
  a prompt longer than the context (a 400 "context_length_exceeded");
  a body that is not JSON (a 400).
Every request must be answered (or, for the disconnecting client, cut by it) with the status
its kind expects; a 5xx other than 503 while loading or draining is a server error. Every
--sample-s seconds the server process's resident memory (VmRSS), open file descriptors and
threads are read from /proc.

Rows appended to benchmarks/soak.jsonl:
  kind "sample"  t_s, rss_bytes, fds, threads (every --sample-s)
  kind "minute"  per minute of load: requests by kind, latency p50/p99 of the answered
                 generation requests, generated tokens/s, unexpected answers
  kind "run"     the configuration, totals and where the RSS baseline was taken
  kind "summary" exactly: kind, minutes, parallel, requests, rss_start_bytes, rss_end_bytes,
                 rss_growth, server_errors, p50_s, p99_s, commit
rss_growth is (rss_end - rss_start) / rss_start, with rss_start the median RSS of the minute
after the first 5 minutes of load (after a third of the run when it is shorter than 15 minutes,
e.g. the 3-minute check, whose ends are then 1 minute each) and rss_end the median of the last
minute under load: single samples swing ~10% with the requests in flight.

  python -m benchmarks.soak --minutes 60            # the hour-long soak
  python -m benchmarks.soak --minutes 3             # the short check
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.serve_load import Child, free_port, pct

REPO = Path(__file__).resolve().parents[1]
KINDS = {  # kind -> weight in the mix
    "completion": 3, "chat": 3, "completion_stream": 3, "chat_stream": 3,
    "disconnect": 2, "over_context": 1, "bad_json": 1,
}
WORDS = ("the history of computing is a story of ideas and machines that made them real "
         "from the abacus to the transistor each step changed what people could do").split()


# ---------------------------------------------------------------------------- sampling
def proc_stats(pid: int) -> dict | None:
    """The process's VmRSS (bytes), open fds and threads from /proc, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024, "fds": fds,
            "threads": int(fields["Threads"])}


class Sampler(threading.Thread):
    def __init__(self, pid: int, every: float, t0: float):
        super().__init__(daemon=True)
        self.pid, self.every, self.t0 = pid, every, t0
        self.samples: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            s = proc_stats(self.pid)
            if s is not None:
                self.samples.append({"t_s": round(time.monotonic() - self.t0, 1), **s})
            self.stop_event.wait(self.every)


# ---------------------------------------------------------------------------- the load
def request_for(kind: str, rng: random.Random, model: str, ctx: int) -> dict:
    # prompt and output sized to the context, so that only over_context requests exceed it
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, max(3, ctx // 16))))
    body = {"model": model, "max_tokens": rng.randint(4, min(48, ctx // 4))}
    setting = rng.choice(["greedy", "warm", "hot"])
    if setting == "greedy":
        body["temperature"] = 0
    else:
        body.update(temperature=0.7 if setting == "warm" else 1.2, top_p=rng.choice([0.9, 1.0]),
                    top_k=rng.choice([0, 40]), seed=rng.randrange(2 ** 31))
    if kind == "over_context":
        words = " ".join(rng.choice(WORDS) for _ in range(2 * ctx))
    if kind.startswith("chat") or (kind == "disconnect" and rng.random() < 0.5):
        body["messages"] = [{"role": "user", "content": words}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = words
        path = "/v1/completions"
    if kind.endswith("stream") or kind == "disconnect":
        body.update(stream=True, stream_options={"include_usage": True})
        if kind == "disconnect":
            body["max_tokens"] = min(48, ctx // 4)
    return {"path": path, "body": body}


async def sse_lines(r: httpx.Response):
    """The lines of a server-sent event stream, split where the format splits them (CR, LF):
    httpx's aiter_lines also splits at U+2028, U+0085..., which generated text may hold raw
    inside an event's JSON."""
    buf = ""
    async for chunk in r.aiter_text():
        buf += chunk.replace("\r\n", "\n").replace("\r", "\n")
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line
    if buf:
        yield buf


async def one(client: httpx.AsyncClient, kind: str, req: dict, rng: random.Random) -> dict:
    """Send one request; {kind, status, latency_s, tokens, ok, detail}."""
    t0 = time.perf_counter()
    out = {"kind": kind, "status": None, "tokens": 0, "ok": False, "detail": ""}
    try:
        if kind == "bad_json":
            r = await client.post(req["path"], content=b'{"model": "x", "prompt": [1, 2,',
                                  headers={"content-type": "application/json"})
            out["status"] = r.status_code
            out["ok"] = r.status_code == 400
        elif req["body"].get("stream"):
            async with client.stream("POST", req["path"], json=req["body"]) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    out["detail"] = (await r.aread())[:200].decode(errors="replace")
                else:
                    chunks, stop_after = 0, rng.randint(1, 4)
                    async for line in sse_lines(r):
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            out["ok"] = out["ok"] or line == "data: [DONE]"
                            continue
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            out["detail"] = str(obj["error"])[:200]
                            out["status"] = 500
                            break
                        if obj.get("usage"):
                            out["tokens"] = obj["usage"]["completion_tokens"]
                        chunks += 1
                        if kind == "disconnect" and chunks >= stop_after:
                            out["ok"] = True  # the client goes away: closing the stream
                            break
        else:
            r = await client.post(req["path"], json=req["body"])
            out["status"] = r.status_code
            if r.status_code == 200:
                out["tokens"] = r.json()["usage"]["completion_tokens"]
                out["ok"] = kind in ("completion", "chat")
            elif kind == "over_context":
                out["ok"] = r.status_code == 400 and "context" in r.text
            if not out["ok"]:
                out["detail"] = r.text[:200]
    except httpx.HTTPError as e:
        out["detail"] = f"{type(e).__name__}: {e}"
    out["latency_s"] = time.perf_counter() - t0
    out["end"] = time.monotonic()
    return out


async def load(url: str, model: str, ctx: int, clients: int, seconds: float, seed: int
               ) -> list[dict]:
    kinds, weights = zip(*KINDS.items())
    limits = httpx.Limits(max_connections=clients + 4)
    results: list[dict] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0),
                                 limits=limits) as client:
        async def loop(i: int):
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                results.append(await one(client, kind, request_for(kind, rng, model, ctx), rng))

        await asyncio.gather(*(loop(i) for i in range(clients)))
    return results


# ---------------------------------------------------------------------------- rows
GENERATION = ("completion", "chat", "completion_stream", "chat_stream")


def minute_rows(results: list[dict], t_load: float, minutes: int) -> list[dict]:
    rows = []
    for m in range(minutes):
        lo, hi = t_load + 60 * m, t_load + 60 * (m + 1)
        rs = [r for r in results if lo <= r["end"] < hi]
        lat = sorted(r["latency_s"] for r in rs if r["kind"] in GENERATION and r["ok"])
        rows.append({"kind": "minute", "minute": m + 1, "requests": len(rs),
                     "by_kind": {k: sum(r["kind"] == k for r in rs) for k in KINDS},
                     "p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
                     "tok_s": sum(r["tokens"] for r in rs) / 60.0,
                     "unexpected": sum(not r["ok"] for r in rs)})
    return rows


def server_errors(results: list[dict]) -> int:
    """5xx answers (503 is for loading and draining only, and the load runs between them)."""
    return sum(1 for r in results if r["status"] is not None and r["status"] >= 500)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=int, default=60, help="minutes of load")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--clients", type=int, default=12,
                   help="concurrent client loops (more than the slots: some requests queue)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=256,
                   help="the server's context (a prompt past it is refused)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--note", default="shared machine: other jobs ran at the same time")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "soak.jsonl"))
    args = p.parse_args(argv)
    if args.minutes < 1:
        raise SystemExit(f"--minutes: expected an integer >= 1, got {args.minutes}")

    import tempfile

    from experiments import _common

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pij-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv_server = [sys.executable, "-m", "powerinfer_jax.serve", "--model", args.model,
                   "--parallel", str(args.parallel), "--queue", "256", "--max-seq-len",
                   str(args.max_seq_len), "--port", str(port), "--alias", "soak",
                   "--log-level", "warning", *(["--threads", str(args.threads)]
                                               if args.threads else []), *args.server_args]
    head = _common.header("soak", threads=args.threads or len(os.sched_getaffinity(0)),
                          dtype="float32", model=args.model,
                          config={k: getattr(args, k) for k in (
                              "minutes", "parallel", "clients", "max_seq_len", "sample_s",
                              "seed", "server_args")}, quick=args.minutes < 60)
    head["note"] = args.note
    t0 = time.monotonic()
    server = Child("powerinfer_jax", argv_server, port, log_dir / "soak.server.log")
    sampler = Sampler(server.proc.pid, args.sample_s, t0)
    sampler.start()
    loading_503 = 0
    try:
        while True:  # /health answers 503 while loading: allowed, counted
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {server.proc.returncode}; see "
                                   f"{log_dir / 'soak.server.log'}")
            try:
                code = httpx.get(server.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                code = None
            if code == 200:
                break
            loading_503 += code == 503
            if time.monotonic() - t0 > 1800:
                raise RuntimeError("the server was not ready after 30 minutes")
            time.sleep(1)
        ready_s = time.monotonic() - t0
        t_load = time.monotonic()
        print(f"ready after {ready_s:.0f} s; load for {args.minutes} min", flush=True)
        results = asyncio.run(load(server.url, "soak", args.max_seq_len, args.clients,
                                   60.0 * args.minutes, args.seed))
        t_end = time.monotonic()
        under_load = [s for s in sampler.samples if t_load - t0 <= s["t_s"] <= t_end - t0]
        alive = server.proc.poll() is None
    finally:
        sampler.stop_event.set()
        server.close()  # SIGTERM: the server drains and stops
    log = (log_dir / "soak.server.log").read_text(errors="replace")
    warm = min(300.0, 60.0 * args.minutes / 3)  # the first 5 minutes (a third of a short run)
    after = [s for s in under_load if s["t_s"] >= t_load - t0 + warm] or under_load
    span = min(60.0, warm)  # a minute of samples at each end: RSS swings ~10% step to step
    first = [s for s in after if s["t_s"] < after[0]["t_s"] + span]
    last = [s for s in under_load if s["t_s"] > under_load[-1]["t_s"] - span]
    base, end = first[0], last[-1]
    rss_start = int(statistics.median(s["rss_bytes"] for s in first))
    rss_end = int(statistics.median(s["rss_bytes"] for s in last))
    gen = sorted(r["latency_s"] for r in results if r["kind"] in GENERATION and r["ok"])
    rows = [{**head, "kind": "sample", **s} for s in sampler.samples]
    rows += [{**head, **r} for r in minute_rows(results, t_load, args.minutes)]
    errors = server_errors(results)
    unexpected = [r for r in results if not r["ok"]]
    rows.append({**head, "kind": "run", "ready_s": ready_s, "loading_503": loading_503,
                 "requests": len(results), "by_kind": {k: sum(r["kind"] == k for r in results)
                                                       for k in KINDS},
                 "unexpected": len(unexpected),
                 "unexpected_examples": [{k: r[k] for k in ("kind", "status", "detail")}
                                         for r in unexpected[:5]],
                 "server_alive_at_end": alive, "tracebacks_in_log":
                     log.count("Traceback (most recent call last)"),
                 "error_lines_in_log": [line for line in log.splitlines()
                                        if line.startswith(("ERROR", "CRITICAL"))][:20],
                 "rss_baseline_after_s": round(base["t_s"] - (t_load - t0), 1),
                 "generated_tokens": sum(r["tokens"] for r in results),
                 "fds_start_end": [base["fds"], end["fds"]],
                 "threads_start_end": [base["threads"], end["threads"]],
                 "rss_peak_bytes": max(s["rss_bytes"] for s in under_load),
                 "tok_s_overall": sum(r["tokens"] for r in results) / (t_end - t_load)})
    summary = {"kind": "summary", "minutes": args.minutes, "parallel": args.parallel,
               "requests": len(results), "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
               "rss_growth": (rss_end - rss_start) / rss_start,
               "server_errors": errors, "p50_s": pct(gen, 50), "p99_s": pct(gen, 99),
               "commit": head["commit"]}
    rows.append(summary)
    _common.append_rows(args.out, rows)
    print(json.dumps(summary))
    print(f"{len(rows)} rows -> {args.out} (server log {log_dir / 'soak.server.log'}); "
          f"{len(unexpected)} unexpected answers, median latency "
          f"{statistics.median(gen) if gen else float('nan'):.2f} s")


if __name__ == "__main__":
    main()
