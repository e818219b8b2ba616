"""Read rates of scattered neuron rows (three arrays, three arrays with the next rows requested,
neuron bundles) against a plain stream, at a 7B FFN's shape, 2 threads: the ceiling a sparse FFN
kernel's row reads have on this machine (issue 39). Compiles benchmarks/cpp/scattered_reads.cc
(-O2 -march=native) and appends one row per round to benchmarks/scattered_reads.jsonl.

    python -m benchmarks.scattered_reads [--active 0.1] [--rounds 3] [--tag ...]

Run it with the machine otherwise idle; it allocates ~4.6 GB.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--active", type=float, default=0.1, help="share of each layer's neurons read")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "scattered_reads.jsonl"))
    a = ap.parse_args(argv)
    if not 0 < a.active <= 1 or a.rounds < 1:
        sys.exit(f"--active/--rounds: expected a share in (0, 1] and rounds >= 1, got "
                 f"{a.active}/{a.rounds}")
    from powerinfer_jax import _machine

    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "scattered_reads"
        subprocess.run(["g++", "-O2", "-march=native", "-std=c++20", "-pthread", "-o", str(exe),
                        str(REPO / "benchmarks" / "cpp" / "scattered_reads.cc")], check=True)
        out = subprocess.run([str(exe), str(a.active), str(a.rounds)], check=True,
                             capture_output=True, text=True).stdout
    head = {"experiment": "scattered_reads", "commit": _machine.git_commit(),
            "machine": _machine.machine_info(), "threads": 2, "row_bytes": 2304,
            "neurons": 11008, "layers": 32, "tag": a.tag}
    rows = [{**head, **json.loads(l)} for l in out.splitlines() if l.startswith("{")]
    with open(a.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        print(json.dumps({k: r[k] for k in r if k.endswith("_gbs") or k == "round"}))


if __name__ == "__main__":
    main()
