"""Sparse decode at real shapes on the CPU (SYNTHETIC weights: `python -m powerinfer_jax.synthetic`
models, random weights with prescribed firing frequencies; or a trained ReLU-family model's files
from `python -m experiments.peer_files`, rows marked "synthetic": false): ours vs llama.cpp dense
on the same llama GGUF and vs PowerInfer's CPU predictor mode on the PowerInfer GGUF of the same
model.

Per round, per model (one per sparsity profile) and thread count, back to back, each in a fresh
process pinned to the same CPUs:
  llama.cpp     llama-bench -p 0 -n N (tg) on <model>.gguf: dense, every weight read per token
  powerinfer    PowerInfer's `main` on <model>.powerinfer.gguf (its predictors, CPU build)
  dense         ours, --sparsity dense, the file's blocks
  exact         ours, --sparsity oracle: the gate of every neuron, then up and down of the neurons
                whose gate fires (ReLU's exact active set; no predictor, no approximation)
  predictor     ours, --sparsity powerinfer on <model>.powerinfer.gguf (PowerInfer's file): the
                same predictors as PowerInfer's run, then gate/up/down rows of predicted neurons
                only, the down rows as the file stores them (neuron rows)
  predictor_gguf  the same predictors on <model>.gguf (llama.cpp's file): the down rows read in
                the file's blocks of 32 neurons (nothing re-quantized)
The order of systems rotates per round; ratios are taken within a round (the VM drifts 20-30%).

Bytes per decode token (from the files' tensor sizes and the model's measured sparsity s):
  dense      every matrix once + one embedding row
  sparse     dense - s * FFN bytes (gate, up, down) + the predictors' bytes
  napkin     dense bytes / sparse bytes: the speed-up a perfect kernel gets at the memory wall
The machine's read bandwidth at each thread count is measured in the same run.

    python -m benchmarks.sparse_7b --models /work/models/s90 [/work/models/s50 ...]
        [--threads 2] [--rounds 3] [--new-tokens 64] [--out benchmarks/sparse_7b.jsonl]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("POWERINFER_JAX_CACHE", Path.home() / ".cache" / "powerinfer_jax"))
LLAMA_BENCH = CACHE / "peers" / "llamacpp-cpu-native" / "bin" / "llama-bench"
# Prefill on a build without AMX where there is one (build_llama_bench_cpu.sh ISAS=native-noamx):
# on a Xeon VM with AMX the native build's AMX path stopped llama-bench's prefill with SIGSEGV,
# while its decode (batch 1) runs, and is its fastest there (7.9 tok/s against 2.7 without AMX).
LLAMA_BENCH_PREFILL = next(
    (p for p in (CACHE / "peers" / f"llamacpp-cpu-{b}" / "bin" / "llama-bench"
                 for b in ("native-noamx", "native")) if p.is_file()), LLAMA_BENCH)
OURS = {"dense": ["--sparsity", "dense"], "exact": ["--sparsity", "oracle"],
        "predictor": ["--sparsity", "powerinfer"],
        "predictor_gguf": ["--sparsity", "powerinfer", "--predictors", "{pwri}"]}
# Which file each of ours reads: the llama GGUF (llama.cpp's file), or the PowerInfer GGUF
# (PowerInfer's file: the same model, its down projection stored transposed, neuron rows of
# Q4_0 along D, so a neuron's down row is read alone; on the llama GGUF it lies in the file's
# blocks of 32 neurons, whose scales and shared bytes the sparse kernel reads as well).
OURS_FILE = {"dense": "gguf", "exact": "gguf", "predictor": "pwri", "predictor_gguf": "gguf"}
PEERS = ("llama.cpp", "powerinfer")
PROMPT = ("The history of computing is a story of ideas that made machines faster, smaller and "
          "easier to program. Early engineers built circuits by hand.")


SYNTHETIC = ("random weights (SYNTHETIC): python -m powerinfer_jax.synthetic; frequencies "
             "prescribed, measured on wiki.valid")


def model_files(d: Path) -> dict:
    """A model directory's files: a synthetic model's (synthetic.json) or a trained model's
    (peer_model.json, experiments/peer_files.py)."""
    real = d / "peer_model.json"
    rec = json.loads((real if real.is_file() else d / "synthetic.json").read_text())
    rec["synthetic"] = False if real.is_file() else SYNTHETIC
    files = rec["files"]
    if "gguf" not in files or "powerinfer" not in files:
        raise SystemExit(f"--models {d}: expected a llama GGUF and a PowerInfer GGUF "
                         f"(--formats gguf,powerinfer), got {sorted(files)}")
    return {"gguf": Path(files["gguf"]), "pwri": Path(files["powerinfer"]), "record": rec}


def tensor_bytes(path: Path) -> dict[str, int]:
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    return {t.name: int(t.n_bytes) for t in GGUFFile(path).tensors}


def napkin(gguf: Path, pwri: Path, sparsity: float, vocab: int) -> dict:
    t = tensor_bytes(gguf)
    p = tensor_bytes(pwri)
    embed = t["token_embd.weight"]
    dense = sum(t.values()) - embed + embed // vocab
    ffn = sum(v for k, v in t.items() if ".ffn_gate." in k or ".ffn_up." in k or ".ffn_down." in k)
    pred = sum(v for k, v in p.items() if ".fc1." in k or ".fc2." in k)
    sparse = dense - sparsity * ffn + pred
    return {"dense_bytes": dense, "ffn_bytes": ffn, "predictor_bytes": pred,
            "sparse_bytes": int(sparse), "napkin_ratio": dense / sparse,
            "napkin_ratio_free_predictor": dense / (dense - sparsity * ffn)}


def pinned(threads: int) -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    return ["taskset", "-c", ",".join(map(str, cpus))]


def run_llama(gguf: Path, threads: int, new_tokens: int) -> tuple[float, list]:
    cmd = pinned(threads) + [str(LLAMA_BENCH), "-m", str(gguf), "-p", "0", "-n",
                             str(new_tokens), "-t", str(threads), "-r", "1", "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    gen = [r for r in rows if r.get("n_gen") == new_tokens]
    return float(gen[-1]["avg_ts"]), cmd


def run_powerinfer(binary: Path, pwri: Path, threads: int, new_tokens: int) -> tuple[float, list]:
    from experiments.peers_powerinfer import run_powerinfer as run

    r = run(binary, pwri, PROMPT, threads=threads, new_tokens=new_tokens)
    return float(r["decode_tok_s"]), [str(binary), "-m", str(pwri), "-t", str(threads)]


def run_ours(config: str, files: dict, threads: int, new_tokens: int, dtype: str
             ) -> tuple[dict, list]:
    extra = [a.format(pwri=files["pwri"]) for a in OURS[config]]
    cmd = pinned(threads) + [sys.executable, "-m", "powerinfer_jax.bench", "--model",
                             str(files[OURS_FILE[config]]), "--dtype", dtype, *extra, "--threads",
                             str(threads), "--prompt-tokens", "16", "--new-tokens",
                             str(new_tokens), "--repeats", "2", "--max-seq-len", "256", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def run_llama_prefill(gguf: Path, threads: int, n: int) -> tuple[float, list]:
    cmd = pinned(threads) + [str(LLAMA_BENCH_PREFILL), "-m", str(gguf), "-p", str(n), "-n", "0",
                             "-t", str(threads), "-r", "1", "-o", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return float([r for r in rows if r.get("n_prompt") == n][-1]["avg_ts"]), cmd


def run_ours_prefill(files: dict, threads: int, n: int, dtype: str) -> tuple[float, list]:
    cmd = pinned(threads) + [sys.executable, "-m", "powerinfer_jax.bench", "--model",
                             str(files["gguf"]), "--dtype", dtype, "--sparsity", "dense",
                             "--threads", str(threads), "--prompt-tokens", str(n),
                             "--new-tokens", "2", "--repeats", "1", "--max-seq-len",
                             str(n + 64), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["prefill_tok_s"]), cmd


def wall_and_peak_rss(cmd: list) -> tuple[float, int]:
    """A child's wall time (s) and peak resident set (bytes, its own rusage from wait4): a
    load-and-one-token run, so the time is the load's and the peak the model's footprint."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: nobody reads it while it runs
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)}: exit {os.waitstatus_to_exitcode(status)}: "
                               f"{err.read().decode(errors='replace')[-2000:]}")
    return wall, int(usage.ru_maxrss) * 1024


# The load row's KV cache: llama-simple sizes its context to the prompt and the tokens asked for
# (n_ctx = prompt + n_predict - 1), so our run gets a cache of about that size too.
LOAD_CONTEXT = 16


def load_commands(files: dict, threads: int, dtype: str) -> dict[str, list]:
    """Load the model and produce one token, warm page cache: llama.cpp's llama-simple (mmap,
    its default threads on the pinned CPUs) and our generate (dense, the file's blocks)."""
    simple = LLAMA_BENCH.parent / "llama-simple"
    return {"llama.cpp": pinned(threads) + [str(simple), "-m", str(files["gguf"]), "-n", "1",
                                            "Hello"],
            "dense": pinned(threads) + [sys.executable, "-m", "powerinfer_jax.generate",
                                        "--model", str(files["gguf"]), "--dtype", dtype,
                                        "--threads", str(threads), "--prompt", "Hello",
                                        "--max-new-tokens", "1", "--max-seq-len",
                                        str(LOAD_CONTEXT)]}


def load_files(files: dict) -> dict[str, list]:
    """The files each load command reads: the GGUF, and for ours also the interleaved copy of
    its matrices beside it (checkpoint/interleaved_file.py) when there is one."""
    side = files["gguf"].with_name(files["gguf"].name + ".pij-interleaved")
    return {"llama.cpp": [files["gguf"]],
            "dense": [files["gguf"]] + ([side] if side.is_file() else [])}


def warm_page_cache(paths) -> None:
    """Read each file through once, so that a load measured next finds it in the page cache
    (the other systems' runs in between evict files on a machine this size: round 0 of the
    stop-43 rows read the interleaved file from disk)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def bandwidth(threads: int) -> float:
    code = ("from powerinfer_jax import ops; from powerinfer_jax._bench_ops import "
            f"read_bandwidth_gbs; ops.set_num_threads({threads}); "
            "print(read_bandwidth_gbs(nbytes=1 << 30))")
    out = subprocess.run(pinned(threads) + [sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, cwd=REPO).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True, type=Path)
    ap.add_argument("--threads", nargs="+", type=int, default=[2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--systems", default="llama.cpp,powerinfer,dense,exact,predictor,"
                    "predictor_gguf")
    ap.add_argument("--dense-checks", action=argparse.BooleanOptionalAction, default=True,
                    help="per round also prefill of --prefill-tokens (llama.cpp vs ours dense), "
                         "and load time and peak RSS of a load-and-one-token run")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--powerinfer-src", default="/work/.mirror/SJTU-IPADS+PowerInfer/repo",
                    help="a PowerInfer git directory (experiments/peers_powerinfer_build.sh)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "sparse_7b.jsonl")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in PEERS and s not in OURS:
            raise SystemExit(f"--systems: expected names from {list(PEERS) + list(OURS)}, got {s}")
    from powerinfer_jax import _cli

    binary = None
    if "powerinfer" in systems:
        from experiments.peers_powerinfer import build

        binary, pi_commit = build(args.powerinfer_src, CACHE / "peers")
    models = {d: model_files(d) for d in args.models}
    head = {"experiment": "sparse_7b", "commit": _cli.git_commit(),
            "machine": _cli.machine_info(), "dtype": args.dtype, "new_tokens": args.new_tokens}
    rows = []

    def emit(row):
        row = {**head, "time": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), **row}
        rows.append(row)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in row if k not in ("machine", "cmd", "synthetic")}),
              flush=True)

    for threads in args.threads:
        emit({"kind": "bandwidth", "threads": threads, "read_gbs": bandwidth(threads)})
    for rnd in range(args.rounds):
        for d, files in models.items():
            rec = files["record"]
            sp = rec.get("verify", {}).get("sparsity", rec["sparsity"])
            nap = napkin(files["gguf"], files["pwri"], sp, rec["config"]["vocab_size"])
            for threads in args.threads:
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for system in order:
                    base = {"kind": "decode", "round": rnd, "model": str(d),
                            "synthetic": rec["synthetic"],
                            "sparsity": rec["sparsity"], "measured_sparsity": sp,
                            "threads": threads, "system": system, **nap}
                    if system == "llama.cpp":
                        tok_s, cmd = run_llama(files["gguf"], threads, args.new_tokens)
                        emit({**base, "tok_s": tok_s, "cmd": cmd})
                    elif system == "powerinfer":
                        tok_s, cmd = run_powerinfer(binary, files["pwri"], threads,
                                                    args.new_tokens)
                        emit({**base, "tok_s": tok_s, "cmd": cmd, "powerinfer_commit": pi_commit})
                    else:
                        res, cmd = run_ours(system, files, threads, args.new_tokens, args.dtype)
                        emit({**base, "tok_s": res["decode_tok_s"],
                              "prefill_tok_s": res["prefill_tok_s"],
                              "runs": res["decode_tok_s_runs"], "cmd": cmd})
            if not args.dense_checks:
                continue
            for threads in args.threads:
                base = {"round": rnd, "model": str(d), "synthetic": rec["synthetic"],
                        "threads": threads, "file_bytes": files["gguf"].stat().st_size}
                for system in (("llama.cpp", "dense") if rnd % 2 == 0 else ("dense", "llama.cpp")):
                    if system == "llama.cpp":
                        tok_s, cmd = run_llama_prefill(files["gguf"], threads, args.prefill_tokens)
                    else:
                        tok_s, cmd = run_ours_prefill(files, threads, args.prefill_tokens,
                                                      args.dtype)
                    emit({**base, "kind": "prefill", "system": system,
                          "prompt_tokens": args.prefill_tokens, "tok_s": tok_s, "cmd": cmd})
                cmds, reads = load_commands(files, threads, args.dtype), load_files(files)
                if rnd == 0:  # untimed: our steps compiled once (later runs load them), as
                    for cmd in cmds.values():  # a user's second start finds them
                        wall_and_peak_rss(cmd)
                for system in (list(cmds) if rnd % 2 == 0 else list(cmds)[::-1]):
                    warm_page_cache(reads[system])
                    wall, rss = wall_and_peak_rss(cmds[system])
                    emit({**base, "kind": "load", "system": system, "load_and_one_token_s": wall,
                          "peak_rss_bytes": rss, "rss_over_file": rss / base["file_bytes"],
                          "page_cache": "warm: " + ", ".join(p.name for p in reads[system]),
                          "cmd": cmds[system]})
    for (model, threads), group in _groups(rows).items():
        per = {}
        for r in group:
            per.setdefault(r["system"], {})[r["round"]] = r["tok_s"]
        summary = {"kind": "summary", "model": model, "threads": threads,
                   "synthetic": group[0]["synthetic"]}
        for system, vals in per.items():
            summary[f"{system}_median_tok_s"] = statistics.median(vals.values())
            for ref in PEERS + ("dense",):
                if ref in per and ref != system:
                    ratios = [v / per[ref][k] for k, v in vals.items() if k in per[ref]]
                    summary[f"{system}_over_{ref}"] = statistics.median(ratios)
        r0 = group[0]
        summary["napkin_ratio"] = r0["napkin_ratio"]
        if "dense" in per and "predictor" in per:
            summary["predictor_share_of_napkin"] = summary["predictor_over_dense"] / \
                r0["napkin_ratio"]
        emit(summary)
    for (model, threads, kind), group in _groups(rows, ("prefill", "load")).items():
        key = "tok_s" if kind == "prefill" else "load_and_one_token_s"
        per = {}
        for r in group:
            per.setdefault(r["round"], {})[r["system"]] = r
        both = [v for v in per.values() if "dense" in v and "llama.cpp" in v]
        summary = {"kind": f"summary_{kind}", "model": model, "threads": threads,
                   "synthetic": group[0]["synthetic"],
                   f"dense_over_llama.cpp_{key}": statistics.median(
                       v["dense"][key] / v["llama.cpp"][key] for v in both)}
        if kind == "load":
            for system in ("dense", "llama.cpp"):
                summary[f"{system}_peak_rss_over_file"] = statistics.median(
                    v[system]["rss_over_file"] for v in both)
        emit(summary)


def _groups(rows, kinds=None):
    out = {}
    for r in rows:
        if kinds is None and r.get("kind") == "decode":
            out.setdefault((r["model"], r["threads"]), []).append(r)
        elif kinds is not None and r.get("kind") in kinds:
            out.setdefault((r["model"], r["threads"], r["kind"]), []).append(r)
    return out


if __name__ == "__main__":
    main()
