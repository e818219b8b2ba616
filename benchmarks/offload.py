"""Models larger than memory, under a real memory limit: ours (--ram-budget, runtime/offload.py)
against llama.cpp (its default mmap), on the same GGUF. Issue 36.

    sudo flock -x /tmp/pij_cpu.lock python benchmarks/offload.py \
        --model /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.powerinfer.gguf \
        --predictors /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.powerinfer.gguf \
        --llama-model /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.gguf \
        --systems ours ours_dense llamacpp --budgets 0.25 0.4 0.6 1.0 --tokens 16 --threads 2 \
        --out benchmarks/offload.jsonl

Ours runs --model (PowerInfer's GGUF: its down projection as Q4_0 neuron rows, our fastest
in-memory sparse mode), llama.cpp --llama-model (llama.cpp's GGUF of the same model; default
--model); budgets are fractions of the llama.cpp file ("the file"). Systems: ours (--sparsity
powerinfer), ours_dense (the dense twin: the same file, --sparsity dense: every neuron of every
layer asked of the store each token, so the store reads every neuron it does not hold, as
llama.cpp re-reads what the kernel evicted, but only FFN rows and with O_DIRECT), llamacpp.
--at-file adds a row per system at a --ram-budget of the whole model (ours' file + its KV
cache margin: the model loads in memory, runtime/offload.py's rule) under a limit of that budget
plus the process overhead: what a budget of the file gives, against the unlimited reference.

The memory limit is a cgroup's. The issue asks for cgroup v2's memory.max, but on this machine
the v2 hierarchy (/sys/fs/cgroup/unified) has no controllers enabled; the v1 memory controller
works, so each run gets its own v1 memory cgroup (memory.limit_in_bytes = budget fraction x the
file's size; page cache charged to it, as v2 would). Only the benchmarked child goes in it: a
wrapper shell writes its own pid into cgroup.procs, then execs the command under /usr/bin/time
(peak RSS). The cgroup is removed afterwards. Before every run the page cache is dropped (`sync;
echo 1 > /proc/sys/vm/drop_caches`: root). Bytes read from the disk: the wrapper's
/proc/<pid>/io read_bytes, read after it exits but before it is reaped (a zombie's counters hold
those of the children it reaped: the command's own reads, an mmap's readahead included); the v1
blkio cgroup's throttle counters stay 0 here (no throttle rule, mq-deadline scheduler).

Rows (JSONL, one per system and budget): decode tok/s, bytes read from the disk per decoded token
(ours: the store's count of its decode steps' reads, ahead of time included, and the kernel's
count for the process over the timed generations, /proc/self/io read_bytes; llama.cpp: the
/proc total over every token it ran, load included, an upper bound), the neuron cache's hit
rates (hit_rate: no read waited for; memory_hit_rate: no read at all, a read ahead's hits
left out), peak RSS (/usr/bin/time) and the cgroup's memory.max_usage_in_bytes (page cache included),
whether the kernel OOM-killed the child. Ours gets --ram-budget = limit - --overhead-mb: the
budget counts the model's bytes, not the process (Python, jax, XLA), whose size the unlimited
reference run measures (peak RSS - the model's resident bytes) and reports.

llama.cpp runs llama-bench -p 0 -n TOKENS -r 1 with -lm mmap --repack 0: its default loading
maps the file; repacking would copy the weights into anonymous memory, which a limit below the
file cannot hold (an OOM, not a slow run), so it is off for every budget (the unlimited
reference row measures its default too).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the native build's AMX path stops prefill with SIGSEGV on this Xeon (decode works); the
# native-noamx build (benchmarks/build_llama_bench_cpu.sh) is preferred where present
_PEERS = Path.home() / ".cache/powerinfer_jax/peers"
LLAMA_BENCH = next((p for p in (_PEERS / "llamacpp-cpu-native-noamx/bin/llama-bench",
                                _PEERS / "llamacpp-cpu-native/bin/llama-bench") if p.exists()),
                   _PEERS / "llamacpp-cpu-native/bin/llama-bench")
# --at-file: the budget above ours' file size (its KV cache at --max-seq-len 64 and batch 1 in
# bfloat16 is 32 MiB on a 7B)
_AT_FILE_MARGIN = 64 << 20
CGROUP = Path("/sys/fs/cgroup")
GIB = 1 << 30


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1\n")  # the page cache


class Cgroup:
    """A v1 memory cgroup (with a limit) for one child, removed when done."""

    def __init__(self, name: str, limit: int | None):
        self.mem = CGROUP / "memory" / name
        self.mem.mkdir()
        if limit is not None:
            (self.mem / "memory.limit_in_bytes").write_text(str(limit))

    def wrap(self, cmd: list[str]) -> list[str]:
        script = (f'echo $$ > {self.mem}/cgroup.procs; '
                  'exec /usr/bin/time -f "PIJ_MAXRSS_KB %M" "$@"')
        return ["sh", "-c", script, "sh", *cmd]

    def read(self) -> dict:
        out = {"max_usage_bytes": int((self.mem / "memory.max_usage_in_bytes").read_text()),
               "failcnt": int((self.mem / "memory.failcnt").read_text())}
        oom = (self.mem / "memory.oom_control").read_text()
        for line in oom.splitlines():
            if line.startswith("oom_kill "):
                out["oom_kills"] = int(line.split()[1])
        return out

    def pids(self) -> list[int]:
        return [int(x) for x in (self.mem / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        for _ in range(50):  # the child's exit may take a moment to leave the group
            try:
                self.mem.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run(cmd: list[str], limit: int | None, timeout: float, tag: str) -> dict:
    import tempfile

    drop_caches()
    cg = Cgroup(f"pij_offload_{os.getpid()}_{tag}", limit)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            t0, timed_out = time.time(), False
            p = subprocess.Popen(cg.wrap(cmd), stdout=out, stderr=err, text=True, cwd=REPO)
            deadline = t0 + timeout
            while True:  # exited, not yet reaped: its /proc/<pid>/io still reads
                info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
                if info is not None:
                    break
                if time.time() > deadline and not timed_out:
                    # the command itself, not /usr/bin/time: time reaps it and exits, so its
                    # /proc counters and peak RSS still cover the run
                    timed_out = True
                    for pid in cg.pids():
                        if pid != p.pid:
                            os.kill(pid, 9)
                time.sleep(0.2)
            wall = time.time() - t0
            io = dict(line.split(": ") for line in Path(f"/proc/{p.pid}/io").read_text()
                      .splitlines())
            p.wait()
            stats = cg.read()
        finally:
            cg.remove()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss = None
    for line in stderr.splitlines():
        if line.startswith("PIJ_MAXRSS_KB"):
            rss = int(line.split()[1]) * 1024
    return {"rc": p.returncode, "wall_s": wall, "timed_out": timed_out, "peak_rss_bytes": rss, **stats,
            "disk_read_bytes": int(io["read_bytes"]), "stdout": stdout, "stderr": stderr}


def ours_cmd(a, budget: int | None, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", a.model, "--threads",
           str(a.threads), "--dtype", a.dtype, "--prompt-tokens", str(a.prompt_tokens),
           "--new-tokens", str(a.tokens), "--repeats", "1", "--max-seq-len", str(a.max_seq_len),
           "--json", "--neuron-cache", a.policy]
    if mode == "powerinfer":
        cmd += ["--sparsity", "powerinfer", "--predictors", a.predictors]
    else:
        cmd += ["--sparsity", mode]
    if budget is not None:
        cmd += ["--ram-budget", f"{budget / GIB:.6f}"]
    return cmd


def llama_cmd(a, *, default_load: bool = False) -> list[str]:
    cmd = [str(LLAMA_BENCH), "-m", a.llama_model or a.model, "-p", "0", "-n", str(a.tokens),
           "-t", str(a.threads),
           "-r", "1", "-o", "jsonl"]
    return cmd if default_load else cmd + ["-lm", "mmap", "--repack", "0"]


def parse_ours(res: dict) -> dict:
    lines = [l for l in res["stdout"].splitlines() if l.startswith("{")]
    if res["rc"] != 0 or not lines:
        err = [l for l in res["stderr"].splitlines() if l.startswith("error:")]
        return {"ok": False, "error": err[-1] if err else res["stderr"][-400:]}
    row = json.loads(lines[-1])
    out = {"ok": True, "decode_tok_s": row["decode_tok_s"], "prefill_tok_s": row["prefill_tok_s"],
           "first_token_s": row["first_token_s"], "offload": row.get("offload"),
           "token_ids": row.get("tokens"),
           # the kernel's count of this process's disk reads over the timed generations
           # (prompt + new tokens each), per generated token
           "proc_read_bytes_per_token": (row["proc_read_bytes_timed"] / (row["repeats"]
                                         * row["new_tokens"])
                                         if row.get("proc_read_bytes_timed") is not None
                                         else None)}
    off = row.get("offload") or {}
    st = off.get("stats") or {}
    if st:
        pt = st["per_token"]
        out.update(bytes_read_per_token=pt["bytes_read"], hit_rate=pt["hit_rate"],
                   demand_bytes_read_per_token=pt.get("demand_bytes_read"),
                   memory_hit_rate=pt.get("memory_hit_rate"),
                   static_hit_rate=pt["static_hit_rate"], neurons_read_per_token=pt["neurons_read"],
                   neurons_requested_per_token=pt["neurons_requested"],
                   store_bytes_read_total=st["bytes_read"], decode_tokens_counted=pt["tokens"],
                   resident_bytes=off["resident_bytes"])
    elif off:
        out.update(bytes_read_per_token=0.0, hit_rate=1.0, resident_bytes=off["resident_bytes"])
    return out


def parse_llama(res: dict, tokens: int) -> dict:
    lines = [l for l in res["stdout"].splitlines() if l.startswith("{")]
    if res["rc"] != 0 or not lines:
        return {"ok": False, "error": res["stderr"][-400:]}
    row = json.loads(lines[-1])
    # warm-up (one token) + the timed run
    return {"ok": True, "decode_tok_s": row["avg_ts"], "llama_row": row,
            "bytes_read_per_token_upper": res["disk_read_bytes"] / (tokens + 1)}


def header(a) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": {"cpu": cpu, "cpus": os.cpu_count(),
                                          "host": platform.node()},
            "threads": a.threads, "model": a.model, "llama_model": a.llama_model or a.model,
            "llama_bench": str(LLAMA_BENCH),
            "file_bytes": os.path.getsize(a.llama_model or a.model),
            "ours_file_bytes": os.path.getsize(a.model),
            "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "dtype": a.dtype,
            "synthetic": "synthetic" in Path(a.model).name, "tag": a.tag}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="ours' GGUF")
    p.add_argument("--llama-model", default=None,
                   help="llama.cpp's GGUF of the same model (default: --model); budgets are "
                        "fractions of its size")
    p.add_argument("--at-file", action=argparse.BooleanOptionalAction, default=True,
                   help="a row per system at a --ram-budget of ours' whole file (module doc)")
    p.add_argument("--predictors", default=None, help="PowerInfer GGUF with the predictors")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.4, 0.6, 1.0],
                   help="memory limits as fractions of the model file")
    p.add_argument("--systems", nargs="+", default=["ours", "llamacpp"],
                   choices=["ours", "ours_dense", "llamacpp"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", default="frequency")
    p.add_argument("--overhead-mb", type=float, default=None,
                   help="limit - our --ram-budget (default: measured by the reference run)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="first run both systems without a limit (in-memory speed; warms XLA's "
                        "compilation cache; measures our process overhead)")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--llama-timeout", type=float, default=None,
                   help="llama.cpp's runs under a limit: killed after this many seconds (a row "
                        "with ok false and the time it ran; default: --timeout)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "offload.jsonl"))
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("error: benchmarks/offload.py: expected root (cgroups, drop_caches), got uid "
                 f"{os.geteuid()}")
    if "ours" in a.systems and not a.predictors:
        sys.exit("error: --predictors: expected the PowerInfer GGUF for system 'ours'")
    base = header(a)
    file_bytes = base["file_bytes"]
    overhead = None if a.overhead_mb is None else int(a.overhead_mb * (1 << 20))

    def emit(row):
        # the machine's load when the row was taken (these VMs are shared: 2 cores)
        row = {**base, **row, "loadavg_1m": os.getloadavg()[0]}
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        keys = ("system", "budget_fraction", "ok", "decode_tok_s", "bytes_read_per_token",
                "proc_read_bytes_per_token", "bytes_read_per_token_upper", "hit_rate",
                "memory_hit_rate", "peak_rss_bytes", "max_usage_bytes",
                "oom_kills", "error")
        print(json.dumps({k: row.get(k) for k in keys if k in row}), flush=True)

    def one(system, frac, limit, budget=None, *, default_load=False):
        tag = f"{system}_{frac}"
        if system == "llamacpp":
            cmd = llama_cmd(a, default_load=default_load)
            res = run(cmd, limit, a.timeout if limit is None else a.llama_timeout or a.timeout,
                      tag)
            parsed = parse_llama(res, a.tokens)
        else:
            mode = "powerinfer" if system == "ours" else "dense"
            cmd = ours_cmd(a, budget, mode)
            res = run(cmd, limit, a.timeout, tag)
            parsed = parse_ours(res)
        keep = {k: res[k] for k in ("rc", "wall_s", "timed_out", "peak_rss_bytes", "max_usage_bytes",
                                    "failcnt", "oom_kills", "disk_read_bytes")}
        row = {"system": system, "budget_fraction": frac, "limit_bytes": limit,
               "ram_budget_bytes": budget, "cmd": shlex.join(cmd), **keep, **parsed}
        if system != "llamacpp" and budget is not None:
            row["overhead_bytes"] = limit - budget
        if system != "llamacpp" and frac is not None and parsed.get("token_ids") is not None:
            # greedy with the same prompt: the run under the limit against the in-memory one
            row["tokens_equal_reference"] = parsed["token_ids"] == reference_tokens.get(system)
        if parsed.get("bytes_read_per_token") and parsed.get("decode_tokens_counted"):
            row["disk_read_bytes_per_run_token"] = res["disk_read_bytes"] / (2 * a.tokens)
        emit(row)
        return row

    reference_tokens = {}
    if a.reference:
        for system in a.systems:
            r = one(system, None, None)
            reference_tokens[system] = r.get("token_ids")
            if system == "ours" and overhead is None and r.get("ok") and r["peak_rss_bytes"] \
                    and r.get("resident_bytes"):
                overhead = max(r["peak_rss_bytes"] - r["resident_bytes"], 0)
        if "llamacpp" in a.systems:
            one("llamacpp", None, None, default_load=True)
    if overhead is None:
        overhead = 512 << 20
    for frac in a.budgets:
        limit = int(frac * file_bytes)
        for system in a.systems:
            budget = None if system == "llamacpp" else max(limit - overhead, 1 << 20)
            one(system, frac, limit, budget)
    if a.at_file:
        budget = base["ours_file_bytes"] + _AT_FILE_MARGIN
        for system in a.systems:
            one(system, "at_file", budget + overhead, None if system == "llamacpp" else budget)


if __name__ == "__main__":
    main()
