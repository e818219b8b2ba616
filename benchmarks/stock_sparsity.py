"""Speed of input sparsity on a stock SwiGLU model's shape against llama.cpp on the same file.

Per file (a SYNTHETIC Llama-3-8B-shaped GGUF from benchmarks/swiglu_synthetic.py, Q4_0, and a
Q4_K_M made from it by llama.cpp's llama-quantize), per round, per thread count, back to back in
fresh processes: llama.cpp's `llama-bench -p 0 -n N` (dense decode), our dense decode, and our
input-sparse decode at each target (`--sparsity input_<rule> --target-sparsity T`). Rows per run,
then one summary row per (file, threads, target) with the medians over rounds, in
benchmarks/stock_sparsity.jsonl.

The thresholds of the synthetic files are calibrated here first (`prepare`), with every site at
the target sparsity (the uniform allocation: on random weights the loss-guided allocation has no
meaning, and decode speed depends only on which bytes are skipped); they are saved where the
runtime looks for them, and the measured model-wide sparsity on held-out text goes in the rows.
Bytes per token: the blocks' matrices as read (every scale plane, the codes of the nonzero
channels at the measured per-site sparsity), plus the LM head and one embedding row.

    python -m benchmarks.stock_sparsity --file llama3-8b:Q4_0:/path/q4_0.gguf \\
        --file llama3-8b:Q4_K_M:/path/q4_k_m.gguf --threads 1,2 --targets 0.4,0.5 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "stock_sparsity.jsonl"


def machine() -> dict:
    from benchmarks.q4_vs_llamacpp import machine as m  # lazy: one provenance helper

    return m()


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


# ------------------------------------------------------------------------------ preparation
def prepare(model: str, rule: str, targets: list[float], *, tokens: int) -> dict:
    """Calibrate and save the thresholds of `model` at each target (uniform allocation) and
    measure each one's model-wide sparsity on held-out text. Returns {target: report}."""
    import numpy as np

    import powerinfer_jax as pij
    from powerinfer_jax.sparsity import artifacts as arts_mod
    from powerinfer_jax.sparsity import corpus as corpus_mod
    from powerinfer_jax.sparsity import input_sparsity as isp

    llm = pij.load(model, sparsity="dense", max_seq_len=512)
    m, tok = llm.model, llm.tokenizer
    # the columns layout is what input sparsity runs on: arrange this process's copy the same way
    session = llm.session
    fp = arts_mod.model_fingerprint(model, session.source, llm.config)
    root = arts_mod.artifacts_root(model, session.source)
    text = corpus_mod.read_corpus(corpus_mod.default_corpus_files())
    ids = tok.encode(text[: 40 * tokens])
    chunks = corpus_mod.corpus_chunks(ids, 128, max_tokens=2 * tokens)
    calib, held = chunks[: max(1, len(chunks) // 2)], chunks[max(1, len(chunks) // 2):]
    inputs = isp.collect_inputs(m, calib, sample_tokens=tokens)
    out = {}
    for t in targets:
        a = isp.calibrate(m, calib, rule=rule, target=float(t), inputs=inputs, how="uniform")
        isp.save(isp.artifact_path(root, rule, float(t)), a, fp)
        measured = isp.measure(m, a, held)
        out[t] = {"calibrated": a.model_sparsity(), "measured": a.model_sparsity(measured),
                  "per_site": {s: float(np.mean([x[s] for x in measured])) for s in isp.SITES},
                  "bytes": isp.bytes_per_token(m, measured)}
    out["dense_bytes"] = isp.bytes_per_token(m, None)
    return out


# ------------------------------------------------------------------------------ measuring
def run_llama(binary: str, gguf: str, threads: int, new_tokens: int) -> float:
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(new_tokens), "-t", str(threads), "-r", "1",
           "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    gen = [r for r in rows if r.get("n_gen") == new_tokens]
    return float(gen[-1]["avg_ts"])


def run_ours(gguf: str, threads: int, new_tokens: int, sparsity: list[str]) -> dict:
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", gguf, *sparsity,
           "--threads", str(threads), "--prompt-tokens", "16", "--new-tokens", str(new_tokens),
           "--repeats", "2", "--max-seq-len", "256", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", action="append", required=True, metavar="SHAPE:QTYPE:PATH")
    ap.add_argument("--rule", choices=["magnitude", "weighted"], default="magnitude")
    ap.add_argument("--targets", default="0.4,0.5")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--llama-bench", default=str(Path(os.environ.get(
        "POWERINFER_JAX_CACHE", Path.home() / ".cache" / "powerinfer_jax")) / "peers" /
        "llamacpp-cpu-native" / "bin" / "llama-bench"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--note", default="", help="what else ran on the machine (kept in each row)")
    ap.add_argument("--prepare-only", metavar="MODEL", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    targets = [float(t) for t in args.targets.split(",")]
    if args.prepare_only:
        print(json.dumps(prepare(args.prepare_only, args.rule, targets,
                                 tokens=args.calib_tokens)))
        return 0
    if not Path(args.llama_bench).is_file():
        ap.error(f"--llama-bench: no binary at {args.llama_bench} "
                 "(benchmarks/build_llama_bench_cpu.sh)")
    threads = [int(t) for t in args.threads.split(",")]
    files = [f.split(":", 2) for f in args.file]
    base = {"machine": machine(), "commit": git_commit(), "rule": args.rule,
            "new_tokens": args.new_tokens, "synthetic": True,
            "note": args.note}
    out = open(args.out, "a", encoding="utf-8")

    def emit(row: dict) -> None:
        if row.get("kind") == "run":  # the 1-minute load average as the run ended
            row = {**row, "loadavg_1m": round(os.getloadavg()[0], 2)}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), file=sys.stderr)

    reports = {}
    for shape, qtype, path in files:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.stock_sparsity", "--file",
                               f"{shape}:{qtype}:{path}", "--rule", args.rule, "--targets",
                               args.targets, "--calib-tokens", str(args.calib_tokens),
                               "--prepare-only", path], capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"prepare {path}: {proc.stderr[-1500:]}")
        reports[path] = {k if k == "dense_bytes" else float(k): v for k, v in
                         json.loads(proc.stdout.strip().splitlines()[-1]).items()}
        emit({**base, "kind": "prepare", "shape": shape, "qtype": qtype, "file": path,
              "report": reports[path]})
    results: dict = {}
    for rnd in range(args.rounds):
        for shape, qtype, path in files:
            for t in threads:
                key = (path, t)
                r = results.setdefault(key, {"llama": [], "dense": [], **{x: [] for x in targets}})
                r["llama"].append(run_llama(args.llama_bench, path, t, args.new_tokens))
                emit({**base, "kind": "run", "round": rnd, "shape": shape, "qtype": qtype,
                      "threads": t, "engine": "llama.cpp", "decode_tok_s": r["llama"][-1]})
                d = run_ours(path, t, args.new_tokens, ["--sparsity", "dense"])
                r["dense"].append(d["decode_tok_s"])
                emit({**base, "kind": "run", "round": rnd, "shape": shape, "qtype": qtype,
                      "threads": t, "engine": "ours", "sparsity": "dense", "result": d})
                for x in targets:
                    s = run_ours(path, t, args.new_tokens, ["--sparsity", f"input_{args.rule}",
                                                            "--target-sparsity", str(x)])
                    r[x].append(s["decode_tok_s"])
                    emit({**base, "kind": "run", "round": rnd, "shape": shape, "qtype": qtype,
                          "threads": t, "engine": "ours", "sparsity": f"input_{args.rule}",
                          "target_sparsity": x, "result": s})
    med = statistics.median
    for shape, qtype, path in files:
        for t in threads:
            r = results[(path, t)]
            for x in [0.0] + targets:
                ours = med(r["dense"]) if x == 0.0 else med(r[x])
                rep = reports[path]
                emit({"kind": "summary", "shape": shape, "qtype": qtype, "threads": t,
                      "rule": "dense" if x == 0.0 else args.rule, "target_sparsity": x,
                      "measured_sparsity": 0.0 if x == 0.0 else rep[x]["measured"],
                      "ours_tok_s": ours, "llama_cpp_tok_s": med(r["llama"]),
                      "ours_over_llama_cpp": ours / med(r["llama"]),
                      "ours_over_our_dense": ours / med(r["dense"]),
                      "bytes_per_token": rep["dense_bytes"] if x == 0.0 else rep[x]["bytes"],
                      "synthetic": True, "commit": base["commit"]})
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
