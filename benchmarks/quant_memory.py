"""Memory a loaded checkpoint holds: resident set growth of `load_checkpoint` with and without
keep_quantized, against the GGUF file's size (the target for a model kept quantized: within 1.15x).

Each variant loads in a fresh process (so one does not reuse the other's freed pages); the row
records the RSS before the load (after importing the package), after it (the checkpoint alive,
the reader closed, garbage collected) and at its peak (ru_maxrss), and the bytes the params hold; then, the params dropped, what stays (the runtime's fixed
overhead: tokenizer, metadata, heap), so the params' own share can be compared with the file.

    nice -n 10 python benchmarks/quant_memory.py --out benchmarks/quant_memory.jsonl
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import gc, json, os, resource, sys
import numpy as np
import powerinfer_jax.checkpoint as ckpt

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

model, keep = sys.argv[1], sys.argv[2] == "1"
path = ckpt.resolve_model(model)
before = rss()
ck = ckpt.load_checkpoint(path, keep_quantized=keep)
gc.collect()
after = rss()
held = sum(int(np.asarray(v.blocks).nbytes) if hasattr(v, "blocks") else int(v.nbytes)
           for v in ck.params.values())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# the fixed overhead: what the load leaves behind without its params (tokenizer, metadata, heap)
ck.params.clear()
gc.collect()
ckpt.loader._return_freed_memory()
print(json.dumps(dict(file_bytes=os.path.getsize(path), rss_before=before, rss_after=after,
                      rss_peak=peak, params_bytes=held, rss_without_params=rss())))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="benchmarks/quant_memory.jsonl")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(args.out, "a", encoding="utf-8") as fh:
        for keep in (False, True):
            out = subprocess.run([sys.executable, "-c", _CHILD, args.model, "1" if keep else "0"],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            grown = r["rss_after"] - r["rss_before"]
            r.update(bench="quant_memory", model=args.model, keep_quantized=keep, commit=commit,
                     rss_growth=grown, rss_growth_over_file=grown / r["file_bytes"],
                     params_over_file=r["params_bytes"] / r["file_bytes"],
                     fixed_overhead=r["rss_without_params"] - r["rss_before"],
                     rss_growth_less_overhead_over_file=(
                         r["rss_after"] - r["rss_without_params"]) / r["file_bytes"])
            fh.write(json.dumps(r) + "\n")
            print(json.dumps(r))


if __name__ == "__main__":
    sys.exit(main())
