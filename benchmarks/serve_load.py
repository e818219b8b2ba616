"""Serving throughput under concurrent load: our server (python -m powerinfer_jax.serve) vs
llama.cpp's llama-server, same model weights, threads and load.

Hypotheses (issue 15 item 3): with continuous batching, 16 concurrent streams decode at >= 3x one
stream's aggregate throughput; and our server's aggregate throughput is >= llama-server's at bf16.

Both servers run as child processes on 127.0.0.1 with --threads/-t THREADS and PARALLEL slots;
this process is the load generator (asyncio + httpx, streaming /v1/completions, greedy, EOS ignored
so every request generates exactly NEW_TOKENS, a distinct PROMPT_TOKENS-token prompt from the wiki
training text per request, llama-server's prompt cache off). At each concurrency C, C clients each
send REQUESTS_PER_CLIENT requests back to back (closed loop). Per level: aggregate tok/s (generated
tokens / wall time), request latency p50/p99, time to first token p50/p99, each stream's decode
tok/s after its first token. Rounds interleave systems and levels (this VM drifts 20-30% within
minutes), and a first untimed round compiles and warms everything. llama.cpp reads a BF16 GGUF
written from the same dequantized weights our bf16 model loads (experiments/peers.py), so both
compute on identical bf16 weights.

One JSONL row per (round, system, concurrency), then summary rows (medians over rounds of the
scaling C vs 1 and of ours / llama.cpp), appended to benchmarks/serve_load.jsonl; a table on
stdout. Build llama-server with benchmarks/build_llama_server.sh.

  python -m benchmarks.serve_load --llama-server ../llama_cpp_build/build-0.3.36/bin/llama-server
  python -m benchmarks.serve_load --no-llama    # ours only
  python -m benchmarks.serve_load --engine-only # the engine's batched decode, no HTTP
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

OURS, LLAMA = "powerinfer_jax", "llama.cpp"


# ---------------------------------------------------------------------------- servers
class Child:
    """A server process on a free port; stopped with SIGTERM (then SIGKILL) on close."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log.name}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ours(args, ctx: int, log_dir: Path) -> Child:
    port = free_port()
    argv = [sys.executable, "-m", "powerinfer_jax.serve", "--model", args.model, "--dtype",
            args.dtype, "--threads", str(args.threads), "--parallel", str(max(args.concurrency)),
            "--queue", "1024", "--max-seq-len", str(ctx), "--port", str(port), "--alias", "bench",
            "--log-level", "warning", *args.server_args]
    return Child(OURS, argv, port, log_dir / "serve_load.ours.log")


def start_llama(args, gguf: Path, ctx: int, log_dir: Path) -> Child:
    port = free_port()
    parallel = max(args.concurrency)
    argv = [args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
            "-np", str(parallel), "-c", str(ctx * parallel), "-b", "512", "--host", "127.0.0.1",
            "--port", str(port), "--alias", "bench", "--no-webui", *args.llama_args]
    return Child(LLAMA, argv, port, log_dir / "serve_load.llama.log")


# ---------------------------------------------------------------------------- load
async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], new_tokens: int):
    """(latency s, first-token s, tokens, decode tok/s after the first token, error)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    pieces = 0
    usage = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None, None, 0, None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return None, None, 0, None, str(obj["error"])[:200]
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices") and obj["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    pieces += 1
    except httpx.HTTPError as e:
        return None, None, 0, None, f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else pieces
    decode = (n - 1) / (last - first) if first is not None and last > first and n > 1 else None
    return end - t0, (first or end) - t0, n, decode, None


async def run_level(url: str, prompts, concurrency: int, per_client: int, new_tokens: int):
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker(i: int):
            return [await one_request(client, url, next(prompts), new_tokens)
                    for _ in range(per_client)]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r[4] is None]
    tokens = sum(r[2] for r in ok)
    lat = sorted(r[0] for r in ok)
    ttft = sorted(r[1] for r in ok)
    dec = [r[3] for r in ok if r[3] is not None]
    return {"requests": len(flat), "errors": len(flat) - len(ok),
            "error_examples": [r[4] for r in flat if r[4] is not None][:3],
            "wall_s": wall, "generated_tokens": tokens, "agg_tok_s": tokens / wall,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "stream_decode_tok_s_median": statistics.median(dec) if dec else None}


ENGINE_COUNTERS = ("pij_decode_step_seconds_sum", "pij_decode_step_seconds_count",
                   "pij_prefill_seconds_sum", "pij_prefill_seconds_count",
                   "pij_decode_step_sequences_sum")


def engine_counters(url: str) -> dict[str, float]:
    """Our server's engine-thread counters from /metrics (where a level's wall time went)."""
    out = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def breakdown(before: dict, after: dict, wall: float) -> dict:
    d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
    steps = d["pij_decode_step_seconds_count"]
    return {"decode_steps": steps, "decode_s": d["pij_decode_step_seconds_sum"],
            "mean_step_ms": 1e3 * d["pij_decode_step_seconds_sum"] / steps if steps else None,
            "mean_sequences_per_step": d["pij_decode_step_sequences_sum"] / steps if steps else None,
            "prefills": d["pij_prefill_seconds_count"], "prefill_s": d["pij_prefill_seconds_sum"],
            "other_s": wall - d["pij_decode_step_seconds_sum"] - d["pij_prefill_seconds_sum"]}


def pct(sorted_values: list[float], q: float):
    """Nearest-rank percentile (None for no values)."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def prompt_stream(tokenizer, n_tokens: int, text_file: str | None):
    """Distinct prompts of exactly n_tokens ids: consecutive windows of the training text."""
    from powerinfer_jax.sparsity import corpus

    files = [text_file] if text_file else corpus.default_corpus_files()
    text = corpus.read_corpus(files)[:2_000_000]
    ids = tokenizer.encode(text, add_bos=False)
    i = 0
    while True:
        if i + n_tokens > len(ids):
            i = 0
        yield ids[i:i + n_tokens]
        i += n_tokens


# ---------------------------------------------------------------------------- main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--llama-server", default=None, help="llama-server binary "
                   "(benchmarks/build_llama_server.sh prints its path)")
    p.add_argument("--no-llama", action="store_true", help="benchmark our server only")
    p.add_argument("--engine-only", action="store_true",
                   help="no servers: the engine's batched decode in this process (Engine.run of C "
                        "requests together), the ceiling the server's throughput is measured "
                        "against")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="extra flags for our server (last on the line), e.g. --sparsity predictor")
    p.add_argument("--llama-args", nargs="*", default=[], help="extra flags for llama-server")
    p.add_argument("--note", default="shared VM: other engineers' jobs ran at the same time",
                   help="recorded in every row (say 'quiet machine' on a rerun without other load)")
    p.add_argument("--text", default=None, help="prompt text (default: the project's wiki "
                   "training text, sparsity/corpus.py; never the validation file)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "serve_load.jsonl"))
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp directory)")
    args = p.parse_args(argv)
    if not args.no_llama and not args.engine_only and not args.llama_server:
        raise SystemExit("--llama-server: expected the llama-server binary (build it with "
                         "benchmarks/build_llama_server.sh), or pass --no-llama")

    import tempfile

    from experiments import _common
    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import load_checkpoint

    _cli.check_writable(args.out, "--out")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_load_"))
    ckpt = load_checkpoint(args.model)
    tokenizer = ckpt.tokenizer
    gguf = None
    if not args.no_llama and not args.engine_only:
        from experiments.peers import peer_ggufs

        gguf = peer_ggufs(args.model, ckpt)["BF16" if args.dtype == "bfloat16" else "F32"]
    del ckpt  # the dequantized weights: not needed any more
    ctx = args.prompt_tokens + args.new_tokens + 8
    prompts = prompt_stream(tokenizer, args.prompt_tokens, args.text)
    config = {k: getattr(args, k) for k in ("model", "concurrency", "requests_per_client",
                                             "prompt_tokens", "new_tokens", "rounds",
                                             "server_args", "llama_args")}
    config["parallel"] = max(args.concurrency)
    config["llama_gguf"] = None if gguf is None else gguf.name
    head = _common.header("serve_load", threads=args.threads, dtype=args.dtype, model=args.model,
                          config=config, quick=False)
    head["note"] = args.note

    if args.engine_only:
        rows = engine_only(args, head)
        rows += summarize(head, rows, args.concurrency, ["engine_only"])
        _common.append_rows(args.out, rows)
        print(f"{len(rows)} rows -> {args.out}")
        return
    servers = [start_ours(args, ctx, log_dir)]
    if gguf is not None:
        servers.append(start_llama(args, gguf, ctx, log_dir))
    rows = []
    try:
        for s in servers:
            s.wait_ready(1800)
        for rnd in range(args.rounds + 1):  # round 0 warms up (compiles every bucket), untimed
            for c in args.concurrency:
                for s in servers:
                    load0 = os.getloadavg()[0]
                    before = engine_counters(s.url) if s.name == OURS else None
                    res = asyncio.run(run_level(s.url, prompts, c, args.requests_per_client,
                                                args.new_tokens))
                    if before is not None:
                        res["engine_thread"] = breakdown(before, engine_counters(s.url),
                                                         res["wall_s"])
                    row = {**head, "system": s.name, "round": rnd, "warmup": rnd == 0,
                           "concurrency": c, **res, "loadavg_1m": [load0, os.getloadavg()[0]]}
                    print(f"round {rnd} {s.name:15s} C={c:3d} {res['agg_tok_s']:7.1f} tok/s "
                          f"p50 {res['latency_p50_s'] or 0:6.2f} s ttft p50 "
                          f"{res['ttft_p50_s'] or 0:6.3f} s errors {res['errors']}", flush=True)
                    if rnd > 0:
                        rows.append(row)
    finally:
        for s in servers:
            s.close()
    rows += summarize(head, rows, args.concurrency, [s.name for s in servers])
    _common.append_rows(args.out, rows)
    print(f"{len(rows)} rows -> {args.out} (server logs in {log_dir})")


def engine_only(args, head: dict) -> list[dict]:
    """The engine without HTTP (runtime/decode.py Engine.run, in this process): C identical-length
    requests decoded together, per level and round; where the server's time goes beyond it."""
    from powerinfer_jax import _cli
    from powerinfer_jax.runtime.decode import Request

    _cli.configure_threads(args.threads)
    import powerinfer_jax as pij

    ctx = args.prompt_tokens + args.new_tokens + 8
    llm = pij.load(args.model, dtype=args.dtype, threads=args.threads, max_seq_len=ctx,
                   max_batch=max(args.concurrency), progress=False)
    eng = llm.session.engine
    prompts = prompt_stream(llm.tokenizer, args.prompt_tokens, args.text)
    rows = []
    for rnd in range(args.rounds + 1):
        for c in args.concurrency:
            reqs = [Request(next(prompts), args.new_tokens, seed=i) for i in range(c)]
            t0 = time.perf_counter()
            res = eng.run(reqs)
            wall = time.perf_counter() - t0
            n = sum(len(r.tokens) for r in res)
            row = {**head, "system": "engine_only", "round": rnd, "warmup": rnd == 0,
                   "concurrency": c, "requests": c, "generated_tokens": n, "wall_s": wall,
                   "agg_tok_s": n / wall, "loadavg_1m": os.getloadavg()[0],
                   "stream_decode_tok_s_median": statistics.median(r.decode_tok_s for r in res)}
            print(f"round {rnd} engine_only     C={c:3d} {n / wall:7.1f} tok/s", flush=True)
            if rnd > 0:
                rows.append(row)
    return rows


def summarize(head: dict, rows: list[dict], levels, systems) -> list[dict]:
    """Per system and level: medians over rounds of aggregate tok/s, of the per-round scaling vs
    one stream, and (when llama.cpp ran) of the per-round ratio ours / llama.cpp."""
    out = []
    by = {(r["system"], r["round"], r["concurrency"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    base = min(levels)
    for s in systems:
        for c in levels:
            runs = [by[(s, k, c)] for k in rounds]
            scaling = [by[(s, k, c)]["agg_tok_s"] / by[(s, k, base)]["agg_tok_s"] for k in rounds]
            row = {**head, "system": s, "summary": True, "concurrency": c,
                   "agg_tok_s_median": statistics.median(r["agg_tok_s"] for r in runs),
                   "agg_tok_s_runs": [r["agg_tok_s"] for r in runs],
                   f"scaling_vs_{base}_median": statistics.median(scaling),
                   f"scaling_vs_{base}_runs": scaling}
            if s == OURS and LLAMA in systems:
                ratio = [by[(OURS, k, c)]["agg_tok_s"] / by[(LLAMA, k, c)]["agg_tok_s"]
                         for k in rounds]
                row.update(vs_llama_cpp_median=statistics.median(ratio), vs_llama_cpp_runs=ratio)
            for key in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
                        "stream_decode_tok_s_median"):
                vals = [r[key] for r in runs if r[key] is not None]
                row[key + "_median"] = statistics.median(vals) if vals else None
            out.append(row)
            extra = (f"  vs llama.cpp {row['vs_llama_cpp_median']:.2f}x"
                     if "vs_llama_cpp_median" in row else "")
            print(f"summary {s:15s} C={c:3d} {row['agg_tok_s_median']:7.1f} tok/s  scaling "
                  f"{row[f'scaling_vs_{base}_median']:.2f}x{extra}")
    return out


if __name__ == "__main__":
    main()
