"""MoE models larger than memory, under a real memory limit: ours (--ram-budget on an MoE model,
runtime/expert_offload.py) against llama.cpp (its default mmap), on the same GGUF. Issue 52.

    sudo python -m benchmarks.moe_offload \
        --model-dir ~/.cache/powerinfer_jax/synthetic-moe/qwen3-q4_0 \
        --limits 0.4 0.6 0.8 --rounds 2 --tokens 32 --threads 2 --out benchmarks/moe_offload.jsonl

--model-dir: a `python -m powerinfer_jax.synthetic.moe` output folder (SYNTHETIC: random weights
whose routers follow a prescribed power law on text; its calibrated routing is the profile the
pinned experts come from); or --model FILE with --shape NAME. Limits are fractions of the GGUF
file. Each run is one child process in its own cgroup v1 memory group (memory.limit_in_bytes;
page cache charged to it), with the page cache dropped before it (`sync; echo 3 >
/proc/sys/vm/drop_caches`): benchmarks/offload.py's `Cgroup` and `run` (only the child in the
group, the group removed after). Per round and limit, ours and llama.cpp back to back, their order
alternating between rounds (interleaved A/B).

  ours       python -m powerinfer_jax.bench --ram-budget (limit - overhead) --sparsity dense:
             the overhead (Python, jax, XLA's runtime and programs: what --ram-budget does not
             count) is measured first by one run without a limit (its peak RSS less the budget's
             resident bytes) plus --margin-mb; the store's statistics cover the timed run (bench
             resets them after its cold run): bytes read per decoded token (demand and ahead),
             hit rate, read-ahead recall
  llama.cpp  llama-bench -p 0 -n TOKENS -r 1 -lm mmap --repack 0 (its default load maps the file;
             repacking would copy the weights into anonymous memory, which a limit below the file
             cannot hold), under the same limit
  disk       the disk's rate for the store's reads, measured here before the rounds: random
             expert extents of the expert file in 1 MiB O_DIRECT pieces, --readers in flight
  in memory  --in-memory: ours without a limit or budget, once per round (the 80% target's
             reference; it needs the whole file in memory)

Rows (JSONL): kind "disk" (the probe), kind "run" (every run: the command, rc, peak RSS, the
cgroup's max usage and OOM kills, decode tok/s, the store's figures or llama.cpp's /proc read
bytes), and per limit one kind "summary" row with exactly the issue's fields (medians over
rounds; over_disk_bound = our seconds per token / (disk bytes per token / disk rate)).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import offload as off

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")  # page cache, dentries and inodes


def disk_probe(path: Path, slot_bytes: int, data_offset: int, *, readers: int,
               piece: int = 1 << 20, seconds: float = 6.0, seed: int = 0) -> dict:
    """GB/s of random expert extents read in `piece`-byte O_DIRECT reads, `readers` in flight
    (the expert store's reads)."""
    import mmap

    size = path.stat().st_size
    n_slots = (size - data_offset) // slot_bytes
    rng = np.random.default_rng(seed)
    done = [0] * readers
    stop = time.perf_counter() + seconds
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    slots = iter(rng.integers(0, n_slots, 1 << 20).tolist())
    lock = threading.Lock()

    def reader(i):
        buf = mmap.mmap(-1, piece)
        while time.perf_counter() < stop:
            with lock:
                s = next(slots)
            base = data_offset + s * slot_bytes
            for off_ in range(0, slot_bytes, piece):
                n = min(piece, slot_bytes - off_)
                got = os.preadv(fd, [memoryview(buf)[:n]], base + off_)
                done[i] += got

    t0 = time.perf_counter()
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return {"bytes": sum(done), "seconds": dt, "gb_s": sum(done) / dt / 1e9, "readers": readers,
            "piece_bytes": piece, "slot_bytes": slot_bytes, "file": str(path)}


def ours_cmd(a, model: str, budget: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", model, "--threads",
           str(a.threads), "--dtype", a.dtype, "--prompt-tokens", str(a.prompt_tokens),
           "--new-tokens", str(a.tokens), "--repeats", "1", "--max-seq-len", str(a.max_seq_len),
           "--sparsity", "dense", "--json"]
    if a.policy:
        cmd += ["--neuron-cache", a.policy]
    if budget is not None:
        cmd += ["--ram-budget", f"{budget / GIB:.6f}"]
    return cmd


def llama_cmd(a, model: str) -> list[str]:
    return [str(off.LLAMA_BENCH), "-m", model, "-p", "0", "-n", str(a.tokens), "-t",
            str(a.threads), "-r", "1", "-o", "jsonl", "-lm", "mmap", "--repack", "0"]


def parse_ours(res: dict) -> dict:
    lines = [l for l in res["stdout"].splitlines() if l.startswith("{")]
    if res["rc"] != 0 or not lines:
        err = [l for l in res["stderr"].splitlines() if l.startswith("error:")]
        return {"ok": False, "error": err[-1] if err else res["stderr"][-600:]}
    row = json.loads(lines[-1])
    out = {"ok": True, "decode_tok_s": row["decode_tok_s"], "prefill_tok_s": row["prefill_tok_s"],
           "token_ids": row.get("tokens"),
           "proc_read_bytes_per_token": (row["proc_read_bytes_timed"] / row["new_tokens"]
                                         if row.get("proc_read_bytes_timed") is not None
                                         else None)}
    o = row.get("offload") or {}
    out["offload_mode"] = o.get("mode")
    out["resident_bytes"] = o.get("resident_bytes")
    st = o.get("stats") or {}
    if st:
        pt = st["per_token"]
        out.update(bytes_read_per_token=pt["bytes_read"], hit_rate=pt["hit_rate"],
                   memory_hit_rate=pt["memory_hit_rate"], pinned_hit_rate=pt["pinned_hit_rate"],
                   experts_read_per_token=pt["experts_read"],
                   readahead_recall=pt["readahead_recall"],
                   readahead_bytes_per_token=pt["readahead_bytes"],
                   readahead_wasted_bytes_per_token=pt["readahead_wasted_bytes"],
                   wait_s=st["wait_ns"] / 1e9, tokens_counted=pt["tokens"],
                   summary={k: o[k] for k in ("pinned_experts", "cache_slots", "experts",
                                              "slot_bytes", "policy", "frequencies",
                                              "pinned_served_fraction", "dense_bytes")})
    elif o:
        out.update(bytes_read_per_token=0.0, hit_rate=1.0)
    return out


def parse_llama(res: dict, tokens: int) -> dict:
    lines = [l for l in res["stdout"].splitlines() if l.startswith("{")]
    if res["rc"] != 0 or not lines:
        return {"ok": False, "error": res["stderr"][-600:]}
    row = json.loads(lines[-1])
    # llama-bench runs a warm-up token then the timed tokens: the /proc count over all of them
    # (load included) is an upper bound per token
    return {"ok": True, "decode_tok_s": row["avg_ts"],
            "bytes_read_per_token_upper": res["disk_read_bytes"] / (tokens + 1)}


def model_info(a) -> tuple[str, str, str, bool]:
    """(GGUF path, shape name, qtype, synthetic)."""
    if a.model_dir:
        d = Path(a.model_dir).expanduser()
        rec = json.loads((d / "synthetic.json").read_text())
        words = rec["command"].split()
        shape = words[words.index("--shape") + 1] if "--shape" in words else "olmoe-1b-7b"
        return rec["file"], a.shape or shape, rec["qtype"], True
    name = Path(a.model).name
    qtype = next((q for q in ("Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
                  if q.lower() in name.lower()), "unknown")
    return a.model, a.shape, qtype, "synthetic" in name


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None)
    p.add_argument("--limits", type=float, nargs="+", default=[0.4, 0.6, 0.8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", default=None, help="--neuron-cache (default: the library's)")
    p.add_argument("--readers", type=int, default=16, help="the disk probe's reads in flight")
    p.add_argument("--overhead-mb", type=float, default=None)
    p.add_argument("--margin-mb", type=float, default=192)
    p.add_argument("--in-memory", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--llama", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--llama-timeout", type=float, default=900)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "moe_offload.jsonl"))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("error: benchmarks/moe_offload.py: expected root (cgroups, drop_caches), got "
                 f"uid {os.geteuid()}")
    if bool(a.model_dir) == bool(a.model) or (a.model and not a.shape):
        sys.exit("error: expected --model-dir, or --model with --shape")
    model, shape, qtype, synthetic = model_info(a)
    file_bytes = os.path.getsize(model)
    head = off.header(argparse.Namespace(**{**vars(a), "model": model, "llama_model": model,
                                            "predictors": None}))
    commit = head["commit"]
    base = {"bench": "moe_offload", "shape": shape, "qtype": qtype, "synthetic": synthetic,
            "file_bytes": file_bytes, "machine": head["machine"], "threads": a.threads,
            "commit": commit, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
            "tag": a.tag, "shared_machine": "2 cores shared with other work (load average "
                                            "in each row)"}

    def emit(row, *, summary=False):
        row = row if summary else {**base, **row, "loadavg_1m": os.getloadavg()[0]}
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        keys = ("kind", "system", "limit_fraction", "ok", "decode_tok_s", "bytes_read_per_token",
                "hit_rate", "readahead_recall", "peak_rss_bytes", "max_usage_bytes",
                "oom_kills", "error", "ours_tok_s", "llama_cpp_tok_s", "ours_over_llama_cpp",
                "over_disk_bound", "gb_s")
        print(json.dumps({k: row.get(k) for k in keys if k in row}), flush=True)

    def one(system, frac, limit, budget=None, rnd=None):
        tag = f"{system}_{frac}_{rnd}"
        if system == "llama.cpp":
            cmd = llama_cmd(a, model)
            res = off.run(cmd, limit, a.llama_timeout, tag)
            parsed = parse_llama(res, a.tokens)
        else:
            cmd = ours_cmd(a, model, budget)
            res = off.run(cmd, limit, a.timeout, tag)
            parsed = parse_ours(res)
        keep = {k: res[k] for k in ("rc", "wall_s", "timed_out", "peak_rss_bytes",
                                    "max_usage_bytes", "failcnt", "oom_kills",
                                    "disk_read_bytes")}
        row = {"kind": "run", "system": system, "round": rnd, "limit_fraction": frac,
               "limit_bytes": limit, "ram_budget_bytes": budget, "cmd": shlex.join(cmd),
               **keep, **parsed}
        emit(row)
        return row

    # 0. the expert file, built once (outside any limit: it reads every expert of the GGUF)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from powerinfer_jax.checkpoint import "
                    "load_checkpoint; from powerinfer_jax.runtime.expert_file import ensure; "
                    "ensure(load_checkpoint(sys.argv[1], keep_quantized=True))", model],
                   check=True, cwd=REPO)
    emit({"kind": "expert_file", "seconds": time.perf_counter() - t0})
    # 1. the overhead
    lo = int(min(a.limits) * file_bytes)
    overhead = None if a.overhead_mb is None else int(a.overhead_mb * (1 << 20))
    if overhead is None:
        probe = one("ours", "overhead_probe", None, lo - (768 << 20))
        if not probe.get("ok") or not probe.get("resident_bytes"):
            sys.exit(f"error: the overhead probe failed: {probe.get('error')}")
        overhead = max(probe["peak_rss_bytes"] - probe["resident_bytes"], 0)
    overhead += int(a.margin_mb * (1 << 20))
    base["overhead_bytes"] = overhead
    # 2. the disk
    from powerinfer_jax.runtime.expert_file import candidates, read_header

    xfile = next(c for c in candidates(model) if c.exists())
    spec = read_header(xfile)
    disk = disk_probe(xfile, spec.slot_bytes, spec.data_offset, readers=a.readers)
    emit({"kind": "disk", **disk})
    # 3. interleaved rounds
    runs: dict = {}
    for rnd in range(a.rounds):
        if a.in_memory:
            runs.setdefault(("ours", "in_memory"), []).append(one("ours", "in_memory", None,
                                                                  None, rnd))
        for frac in a.limits:
            limit = int(frac * file_bytes)
            order = ["ours", "llama.cpp"] if a.llama else ["ours"]
            if rnd % 2:
                order.reverse()
            for system in order:
                budget = None if system == "llama.cpp" else limit - overhead
                runs.setdefault((system, frac), []).append(one(system, frac, limit, budget, rnd))
    # 4. the tokens (greedy, the same prompt): every run of ours gives the same ones
    ours_tokens = [r.get("token_ids") for (system, _), rows in runs.items() if system == "ours"
                   for r in rows if r.get("ok")]
    emit({"kind": "check", "ours_runs": len(ours_tokens),
          "ours_tokens_all_equal": all(t == ours_tokens[0] for t in ours_tokens)})
    # 5. summaries
    disk_gbs = disk["gb_s"]

    def med(rows, key):
        v = [r[key] for r in rows if r.get("ok") and r.get(key) is not None]
        return statistics.median(v) if v else None

    if not a.llama:  # a summary compares with llama.cpp: without it the run rows are the result
        return
    for frac in a.limits:
        ours, llama = runs.get(("ours", frac), []), runs.get(("llama.cpp", frac), [])
        ratios = [o["decode_tok_s"] / l["decode_tok_s"] for o, l in zip(ours, llama)
                  if o.get("ok") and l.get("ok")]
        ours_tok_s = med(ours, "decode_tok_s")
        per_token = med(ours, "bytes_read_per_token")
        bound = None
        if ours_tok_s and per_token:
            bound = (1.0 / ours_tok_s) / (per_token / (disk_gbs * 1e9))
        emit({"kind": "summary", "shape": shape, "qtype": qtype, "threads": a.threads,
              "limit_fraction": frac, "limit_bytes": int(frac * file_bytes),
              "ours_tok_s": ours_tok_s, "llama_cpp_tok_s": med(llama, "decode_tok_s"),
              "ours_over_llama_cpp": statistics.median(ratios) if ratios else None,
              "disk_bytes_per_token": per_token, "disk_gbs": disk_gbs,
              "over_disk_bound": bound, "hit_rate": med(ours, "hit_rate"),
              "readahead_recall": med(ours, "readahead_recall"),
              "policy": next((r["summary"]["policy"] for r in ours if r.get("summary")), None),
              "synthetic": synthetic, "commit": commit}, summary=True)


if __name__ == "__main__":
    main()
