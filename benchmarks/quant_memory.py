"""Memory a loaded checkpoint holds: resident set growth of `load_checkpoint` with and without
keep_quantized, against the GGUF file's size (the target for a model kept quantized: within 1.15x).

Each variant loads in a fresh process (so one does not reuse the other's freed pages); the row
records the RSS before the load (after importing the package), after it (the checkpoint alive,
the reader closed, garbage collected) and at its peak (ru_maxrss), and the bytes the params hold; then, the params dropped, what stays (the runtime's fixed
overhead: tokenizer, metadata, heap), so the params' own share can be compared with the file.
A quantized file's blocks are views of its mmap (checkpoint/gguf.py): they count in the resident
set only once touched, so the keep_quantized variant also builds the model, generates 2 tokens
and records the resident bytes of the file's mapping (/proc/self/smaps) and the process's RSS.

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

def file_rss(path):  # resident bytes of this process's mappings of `path` (/proc/self/smaps)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total

def file_spans(path):  # [begin, end) of this process's mappings of `path` (/proc/self/maps)
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                if line.rstrip().endswith(" " + path)]

model, keep, use = sys.argv[1], sys.argv[2] != "0", sys.argv[2] == "2"
path = os.path.realpath(ckpt.resolve_model(model))
before = rss()
ck = ckpt.load_checkpoint(path, keep_quantized=keep)
gc.collect()
after = rss()
mapped_after_load = file_rss(path)
held = sum(int(np.asarray(v.blocks).nbytes) if hasattr(v, "blocks") else int(v.nbytes)
           for v in ck.params.values())
row = dict(file_bytes=os.path.getsize(path), rss_before=before, rss_after=after,
           params_bytes=held, file_mapping_rss_after_load=mapped_after_load)
if use:  # the weights in use: a model built on them after a first generate
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.session import build
    sparsity = SparsityConfig(**json.loads(sys.argv[3])) if len(sys.argv) > 3 else SparsityConfig()
    s = build(model, RuntimeConfig(dtype="bfloat16"), sparsity, checkpoint=ck, progress=False)
    s.engine.generate([1, 2, 3, 4], max_new_tokens=2)
    gc.collect()
    row.update(rss_after_generate=rss(), file_mapping_rss_after_generate=file_rss(path))
    # the model's arrays that are not views of the file (copies: down groups, predictors, ...)
    import jax
    from flax import nnx
    spans = file_spans(path)
    row["model_bytes_outside_file"] = sum(
        int(x.nbytes) for x in jax.tree.leaves(nnx.state(s.model)) if hasattr(x, "nbytes")
        and not any(b <= x.unsafe_buffer_pointer() < e for b, e in spans))
else:
    row["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the fixed overhead: what the load leaves without its params (tokenizer, metadata, heap)
    ck.params.clear()
    gc.collect()
    ckpt.loader.return_freed_memory()
    row["rss_without_params"] = rss()
print(json.dumps(row))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="benchmarks/quant_memory.jsonl")
    ap.add_argument("--sparse", action="store_true",
                    help="only the build-and-generate row, in oracle mode at target sparsity "
                         "0.5 (the sparse kernel's down groups instead of the file's ffn_down)")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    sparse = dict(mode="oracle", target_sparsity=0.5)
    with open(args.out, "a", encoding="utf-8") as fh:
        for keep in (() if args.sparse else (False, True)):
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
        # the quantized blocks are views of the file's mmap: resident once touched, so the
        # weights' own footprint is read after a build and a first generate
        out = subprocess.run([sys.executable, "-c", _CHILD, args.model, "2"]
                             + ([json.dumps(sparse)] if args.sparse else []),
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r.update(bench="quant_memory", model=args.model, keep_quantized=True, commit=commit,
                 part="after_build_and_generate", sparsity=sparse if args.sparse else "dense",
                 file_mapping_over_file=r["file_mapping_rss_after_generate"] / r["file_bytes"],
                 rss_growth_through_generate_over_file=(
                     r["rss_after_generate"] - r["rss_before"]) / r["file_bytes"],
                 # the weights' resident share: the file's mapping plus the model's own copies
                 weights_resident_over_file=(r["file_mapping_rss_after_generate"]
                                             + r["model_bytes_outside_file"]) / r["file_bytes"])
        fh.write(json.dumps(r) + "\n")
        print(json.dumps(r))


if __name__ == "__main__":
    sys.exit(main())
