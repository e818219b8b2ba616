"""Prefill and decode on the user's Q4_1 file, ours vs llama.cpp, with bytes read per decode token
next to the read bandwidth measured in the same run (issue 14's "prefill reported too; bytes read
per token vs the measured bandwidth").

Per round and thread count, back to back: llama.cpp's `llama-bench -p P -n N` (its pp and tg
rows) and our `python -m powerinfer_jax.bench --prompt-tokens P --new-tokens N` (dense, the
file's blocks, bf16 compute), then the machine's read bandwidth at that thread count
(`_bench_ops.read_bandwidth_gbs` over a 1 GiB array: DRAM, and a 96 MiB one, about the model's size: what
a token's weights can be read at when they stay in this VM's large last-level cache).

Bytes per decode token: every tensor of the file once (each matrix is read in full per token;
the tied embedding is the lm_head's matrix, the lookup reads one row more), the same for both
systems. effective_gbs = bytes x tok/s: the share of the bandwidth each system turns into
tokens; the rest is compute and per-token fixed cost.

    python -m benchmarks.decode_bandwidth [--model NAME_OR_GGUF] [--threads 1 2] [--rounds 3]
        [--out FILE]

--model: the default model (its Q4_1 file) unless given: any GGUF, e.g. a Q4_K_M file whose
Q4_K/Q6_K mix is what most users download (prefill there was issue 53's finding).
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

from benchmarks import q4_vs_llamacpp as q4  # same provenance helpers and llama-bench build

REPO = Path(__file__).resolve().parents[1]


def file_tensor_bytes(path: Path) -> int:
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    return sum(t.n_bytes for t in GGUFFile(path).tensors)


def file_qtypes(path: Path) -> str:
    """The file's matrix formats by bytes, largest first ("Q4_K 71%, Q6_K 29%")."""
    from collections import Counter

    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    by = Counter()
    for t in GGUFFile(path).tensors:
        if len(t.shape) >= 2:
            by[t.tensor_type.name] += t.n_bytes
    total = sum(by.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in by.most_common())


def bandwidth_gbs(threads: int, mib: int) -> float:
    from powerinfer_jax import ops
    from powerinfer_jax._bench_ops import read_bandwidth_gbs

    ops.set_num_threads(threads)
    return read_bandwidth_gbs(nbytes=mib << 20)


def _llama_rows(binary: Path, gguf: Path, args: list[str]) -> tuple[list[dict], list, int]:
    cmd = [str(binary), "-m", str(gguf), *args, "-r", "2", "-o", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")], cmd, \
        p.returncode


def llama(binary: Path, gguf: Path, *, threads: int, prompt: int, new: int) -> tuple[dict, list]:
    """tg and pp rows of llama-bench with its defaults. On AMX machines its default repacks the
    weights into its AMX buffer type, and in this llama.cpp tree that type's prefill matmul
    crashes (SIGSEGV in ggml_backend_amx_mul_mat): prefill then runs again with --repack 0 and
    the row says so."""
    t = ["-t", str(threads)]
    tg_rows, cmd, rc = _llama_rows(binary, gguf, ["-p", "0", "-n", str(new), *t])
    tg = [r for r in tg_rows if r.get("n_gen") == new and r.get("n_prompt") == 0]
    if rc != 0 or not tg:
        raise RuntimeError(f"{' '.join(cmd)}: exit {rc}, no tg{new} row")
    out = {"decode_tok_s": tg[-1]["avg_ts"], "llama_decode_repack": 1}
    pp_rows, pcmd, rc = _llama_rows(binary, gguf, ["-p", str(prompt), "-n", "0", *t])
    if rc != 0:
        out["llama_prefill_default_exit"] = rc
        pp_rows, pcmd, rc = _llama_rows(binary, gguf, ["-p", str(prompt), "-n", "0", *t,
                                                       "--repack", "0"])
        out["llama_prefill_repack"] = 0
    pp = [r for r in pp_rows if r.get("n_prompt") == prompt and r.get("n_gen") == 0]
    if rc != 0 or not pp:
        raise RuntimeError(f"{' '.join(pcmd)}: exit {rc}, no pp{prompt} row")
    out["prefill_tok_s"] = pp[-1]["avg_ts"]
    return out, cmd + ["&&"] + pcmd


def ours(model: str, *, threads: int, prompt: int, new: int) -> tuple[dict, list]:
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", model, "--dtype",
           "bfloat16", "--weights", "auto", "--sparsity", "dense", "--prompt-tokens",
           str(prompt), "--new-tokens", str(new), "--threads", str(threads), "--repeats", "2",
           "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]}, cmd


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=q4.MODEL,
                    help="a model name or GGUF path (default: %(default)s)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--llama-bench", default=str(q4.CACHE / "peers" / "llamacpp-cpu-native" /
                                                 "bin" / "llama-bench"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "decode_bandwidth.jsonl"))
    args = ap.parse_args(argv)

    from powerinfer_jax.checkpoint import resolve_model

    gguf = Path(resolve_model(args.model))
    types = file_qtypes(gguf)
    per_token = file_tensor_bytes(gguf)
    base = {"bench": "decode_bandwidth", "run_id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
            "commit": q4.git_commit(), "machine": q4.machine(), "model": args.model,
            "file": gguf.name, "file_bytes": gguf.stat().st_size, "file_qtypes": types,
            "bytes_per_decode_token": per_token, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "isa": q4.ext_isa(sys.executable)["isa_info"]}
    rows = []
    for rnd in range(args.rounds):
        for threads in args.threads:
            bw = {"bandwidth_gbs_1gib": bandwidth_gbs(threads, 1024),
                  "bandwidth_gbs_96mib": bandwidth_gbs(threads, 96)}
            for system in ("llama.cpp", "powerinfer_jax"):
                if system == "llama.cpp":
                    res, cmd = llama(Path(args.llama_bench), gguf, threads=threads,
                                     prompt=args.prompt_tokens, new=args.new_tokens)
                    extra = {"weights": f"{types} (llama.cpp)", "dtype": "f32 compute"}
                else:
                    res, cmd = ours(args.model, threads=threads, prompt=args.prompt_tokens,
                                    new=args.new_tokens)
                    extra = {"weights": f"auto (the file's {types} blocks)", "dtype": "bfloat16"}
                eff = per_token * res["decode_tok_s"] / 1e9
                row = {**base, **extra, "kind": "measure", "round": rnd, "threads": threads,
                       "system": system, **res, **bw, "effective_gbs": eff,
                       "fraction_of_bandwidth_1gib": eff / bw["bandwidth_gbs_1gib"],
                       "fraction_of_bandwidth_96mib": eff / bw["bandwidth_gbs_96mib"],
                       "loadavg": os.getloadavg(), "command": " ".join(map(str, cmd))}
                rows.append(row)
                print(f"[{rnd}] t={threads} {system:15s} prefill {res['prefill_tok_s']:8.1f} "
                      f"decode {res['decode_tok_s']:7.1f} tok/s  {eff:5.1f} GB/s of "
                      f"{bw['bandwidth_gbs_96mib']:.0f} (96 MiB) / "
                      f"{bw['bandwidth_gbs_1gib']:.0f} (1 GiB)", file=sys.stderr, flush=True)
    measured = list(rows)
    for threads in args.threads:
        for key in ("prefill_tok_s", "decode_tok_s"):
            ratios = []
            for rnd in range(args.rounds):
                a = [r for r in measured if r["round"] == rnd and r["threads"] == threads]
                o = next(r[key] for r in a if r["system"] == "powerinfer_jax")
                ll = next(r[key] for r in a if r["system"] == "llama.cpp")
                ratios.append(o / ll)
            rows.append({**base, "kind": "summary", "threads": threads, "metric": key,
                         "ratio_ours_to_llamacpp_per_round": ratios,
                         "median_ratio": statistics.median(ratios)})
            print(f"t={threads} {key}: ours / llama.cpp median {statistics.median(ratios):.3f}",
                  file=sys.stderr)
    with open(args.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
