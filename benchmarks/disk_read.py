"""What this machine's disk gives a model larger than memory (issue 36's napkin math): sequential
O_DIRECT reads of --block bytes (streaming whole tensors, as a layer's attention weights would be)
and random O_DIRECT reads of --bundle bytes at --depth reads in flight (neuron bundles, as the
neuron store reads them). Reads a file that is not in use (default: a neuron bundle file), page
cache bypassed; root not needed.

    flock -x /tmp/pij_cpu.lock python benchmarks/disk_read.py \
        --file /work/scratch/model.gguf.pij-neurons --out benchmarks/disk_read.jsonl

Rows (JSONL): GB/s sequential, reads/s and GB/s random per depth, with the file, machine, commit.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

import numpy as np


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)  # page aligned: O_DIRECT's buffer rule


def sequential(path: str, block: int, total: int) -> dict:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        buf = _aligned(block)
        n = min(total, size) // block
        t0 = time.perf_counter()
        for k in range(n):
            got = os.preadv(fd, [buf], k * block)
            if got != block:
                raise OSError(f"{path}: short read at {k * block}")
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"kind": "sequential", "block_bytes": block, "bytes": n * block, "seconds": dt,
            "gb_s": n * block / dt / 1e9}


def random_reads(path: str, bundle: int, depth: int, count: int, seed: int) -> dict:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    slots = size // bundle
    rng = np.random.default_rng(seed)
    offsets = rng.choice(slots, size=count, replace=False) * bundle
    chunks = np.array_split(offsets, depth)

    def reader(offs):
        buf = _aligned(bundle)
        for off in offs:
            os.preadv(fd, [buf], int(off))  # (the GIL is released while the read blocks)

    threads = [threading.Thread(target=reader, args=(c,)) for c in chunks]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    os.close(fd)
    return {"kind": "random", "bundle_bytes": bundle, "depth": depth, "reads": count,
            "seconds": dt, "reads_s": count / dt, "gb_s": count * bundle / dt / 1e9}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", required=True)
    p.add_argument("--block", type=int, default=4 << 20)
    p.add_argument("--sequential-bytes", type=int, default=2 << 30)
    p.add_argument("--bundle", type=int, default=7168, help="a 7B Q4_0 bundle's slot")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--reads", type=int, default=20000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from powerinfer_jax import _cli

    head = {"bench": "disk_read", "file": a.file, "commit": _cli.git_commit(),
            "machine": _cli.machine_info()}
    rows = [sequential(a.file, a.block, a.sequential_bytes)]
    rows += [random_reads(a.file, a.bundle, d, a.reads, seed=d) for d in a.depths]
    for r in rows:
        r = {**head, **r}
        print(json.dumps({k: r[k] for k in r if k not in ("machine",)}))
        if a.out:
            with open(a.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
