"""Where a decode step's time goes: `perf record` (software clock, no hardware counters needed)
on a `powerinfer_jax.bench` run, each sample charged to the part of the step its call stack is
in, as rows (benchmarks/decode_profile.jsonl).

    python -m benchmarks.decode_profile --extension /tmp/symb/_pij_ext*.so \
        --model /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.powerinfer.gguf \
        --bench-args "--sparsity powerinfer" [--threads 2] [--seconds 30] [--tag ...]

--extension: a `_pij_ext` module built with its symbols (release builds strip them):
    cmake -S . -B /tmp/symb -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE=$(which python) -DPIJ_KEEP_SYMBOLS=ON && cmake --build /tmp/symb
The run loads it by path (benchmarks/ext_ab.py's child), decodes --new-tokens per repeat, and
perf samples --seconds of it after --warmup seconds (load, compile and the first prefill).
Parts (the first rule a sample's stack matches, leaf first): dense matvecs (the interleaved and
row-layout matvecs of attention, lm_head, the predictors), the sparse FFN's gate/up dots, its
down rows and piece bookkeeping, decode attention over the KV cache, the pool's waiting (a
thread with no task: the end of a parallel step, or the other thread running glue alone), XLA
and the rest. Shares are of all samples of the process's threads; thread-ms per token = share x
the threads x 1000 / the run's decode tok/s (the threads' CPU time summed: a part's wall time is
about its thread-ms / the threads when it runs on all of them). Run it with the machine
otherwise idle.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (part, pattern over a frame's symbol), in priority: a sample whose leaf frame is the pool's
# waiting is pool_wait; otherwise the first part any frame of its stack matches (the sparse
# FFN's gate/up dots call the same dot tiles as the matvecs, under NeuronDots)
PARTS = (
    ("pool_wait", r"ThreadPool::(WorkerLoop|RunErased|DrainTasks)\b"),
    ("attention", r"KvHeadGroup|DecodeAttention"),
    ("sparse_gate_up", r"NeuronDots|ArrayDots|GroupDots|InterleavedTokenTile|"
                       r"\(anonymous namespace\)::Activations"),
    ("sparse_down", r"AxpyRows|AxpyPairs|AxpyGroup|AccumulateDown|AxpyDownRows|RunPiece|"
                    r"RoundCoefsPer32"),
    ("sparse_other", r"QSparseFfn|DiskFfn|QuantizeActs|QuantizeBlock"),
    ("dense_matvec", r"InterleavedRows|QLinear|qlinear|DotTile"),
    ("xla", r"^xla::|^tsl::|libjax|jaxlib"),
)
_RULES = [(name, re.compile(p)) for name, p in PARTS]


def classify(stack: list[str]) -> str:
    """The part of a sample whose frames (leaf first) are `stack`."""
    if not stack:
        return "other"
    if _RULES[0][1].search(stack[0]):
        return _RULES[0][0]
    for name, rule in _RULES[1:]:
        if any(rule.search(frame) for frame in stack):
            return name
    return "other"


def parse_perf_script(text: str) -> dict[str, int]:
    """Samples per part from `perf script -F comm,ip,sym` output (one sample: a header line, then
    its frames, then a blank line)."""
    counts: dict[str, int] = {}
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = [l.strip() for l in block.splitlines() if l.strip()]
        if len(lines) < 2:
            continue
        frames = [re.sub(r"^[0-9a-f]+\s+", "", l) for l in lines[1:]]
        part = classify(frames)
        counts[part] = counts.get(part, 0) + 1
    return counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--extension", required=True,
                    help="a _pij_ext .so built with PIJ_KEEP_SYMBOLS=ON")
    ap.add_argument("--bench-args", default="--sparsity powerinfer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=float, default=45.0, help="seconds before sampling")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds sampled")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "decode_profile.jsonl"))
    a = ap.parse_args(argv)
    ext = Path(a.extension)
    if not ext.is_file() or ".so" not in ext.name:
        sys.exit(f"--extension: expected a built _pij_ext .so file, got {a.extension!r}")
    if subprocess.run(["perf", "--version"], capture_output=True).returncode != 0:
        sys.exit("perf: expected on PATH (Debian's linux-perf), got none")
    from powerinfer_jax import _machine

    bench = (f"{a.bench_args} --dtype bfloat16 --threads {a.threads} --prompt-tokens 16 "
             f"--new-tokens {a.new_tokens} --repeats 3 --max-seq-len {a.new_tokens + 64}")
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:a.threads]))
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "benchmarks.ext_ab", "--child",
           "--probe", "decode", "--extension", str(ext), "--threads", str(a.threads),
           "--model", a.model, "--bench-args", bench]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
        time.sleep(a.warmup)
        if child.poll() is not None:
            sys.exit(f"the bench ended before --warmup {a.warmup} s: exit {child.returncode} "
                     "(more --new-tokens, or less --warmup)")
        rec = subprocess.run(["perf", "record", "-F", "999", "-g", "-p", str(child.pid), "-o",
                              str(data), "--", "sleep", str(a.seconds)], capture_output=True,
                             text=True)
        still_decoding = child.poll() is None
        out, _ = child.communicate()
        if rec.returncode != 0 or child.returncode != 0:
            sys.exit(f"perf record: exit {rec.returncode} {rec.stderr[-500:]}; bench: exit "
                     f"{child.returncode}")
        if not still_decoding:
            sys.exit("the bench ended while perf sampled: the samples may hold its exit; more "
                     "--new-tokens")
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,ip,sym"],
                                capture_output=True, text=True).stdout
    counts = parse_perf_script(script)
    total = sum(counts.values())
    res = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    tok_s = res["decode_tok_s"]
    shares = {k: counts.get(k, 0) / total for k, _ in PARTS + (("other", ""),)}
    row = {"experiment": "decode_profile", "commit": _machine.git_commit(),
           "machine": _machine.machine_info(), "threads": a.threads, "model": a.model,
           "synthetic": "synthetic" in Path(a.model).name.lower(), "bench_args": bench,
           "tag": a.tag, "samples": total, "decode_tok_s": tok_s,
           "share": {k: round(v, 4) for k, v in shares.items()},
           "thread_ms_per_token": {k: round(v * a.threads * 1e3 / tok_s, 2)
                                   for k, v in shares.items()},
           "sampled_s": a.seconds, "extension": str(ext)}
    with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: row[k] for k in ("decode_tok_s", "samples", "share",
                                          "thread_ms_per_token")}))


if __name__ == "__main__":
    main()
