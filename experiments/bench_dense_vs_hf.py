"""Hypothesis: our dense decode beats HF transformers (torch CPU, fp32) on the same GGUF, same threads.

Runs, in one process and one sitting, `bench` of our model (each --dtype) and HF transformers
generating the same prompt ids greedily, at each thread count; appends one JSONL row per config to
--out. Each thread count runs in a child process, because pinning threads is per process.

  python -m experiments.bench_dense_vs_hf --threads 1 2 --dtypes float32 bfloat16 \
      --out benchmarks/dense_vs_hf.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def bench_hf(model: str, ids: list[int], new_tokens: int, repeats: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from powerinfer_jax.checkpoint.registry import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model)
    m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                             torch_dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def run():
        with torch.no_grad():
            t0 = time.perf_counter()
            m(x)  # prefill alone
            t1 = time.perf_counter()
            out = m.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
            t2 = time.perf_counter()
        prefill = t1 - t0
        decode = (t2 - t1) - prefill  # generate = prefill + (new_tokens - 1) decode steps
        return len(ids) / prefill, (new_tokens - 1) / decode, out[0, len(ids):].tolist()

    run()  # warm-up
    runs = [run() for _ in range(repeats)]
    return {"prefill_tok_s": statistics.median(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs),
            "decode_tok_s_runs": [r[1] for r in runs], "tokens": runs[0][2]}


def child(args) -> None:
    """One thread count: ours for each dtype, then HF; prints JSON rows."""
    from powerinfer_jax import _cli
    from powerinfer_jax.bench import bench_model, prompt_ids, row_header
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build

    threads = _cli.configure_threads(args.child_threads)
    ids = None
    for dtype in args.dtypes:
        s = build(args.model, RuntimeConfig(dtype=dtype, threads=threads))
        ids = prompt_ids(s.tokenizer, args.prompt_tokens)
        res = bench_model(s, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                          repeats=args.repeats)
        ns = argparse.Namespace(dtype=dtype, model=args.model, sparsity="dense", threshold=0.0,
                                kernels="auto", target_sparsity=None, tag="dense_vs_hf")
        print("ROW " + json.dumps({**row_header(ns, threads, s), "system": "powerinfer_jax",
                                   "bench": "model", **res}), flush=True)
    hf = bench_hf(args.model, ids, args.new_tokens, args.repeats, threads)
    ns = argparse.Namespace(dtype="float32", model=args.model, sparsity="dense", threshold=0.0,
                            kernels="torch", target_sparsity=None, tag="dense_vs_hf")
    print("ROW " + json.dumps({**row_header(ns, threads), "system": "hf_transformers",
                               "bench": "model", "prompt_tokens": len(ids),
                               "new_tokens": args.new_tokens, "repeats": args.repeats, **hf}),
          flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/dense_vs_hf.jsonl")
    p.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_threads is not None:
        return child(args)
    rows = []
    for t in args.threads:
        cmd = [sys.executable, "-m", "experiments.bench_dense_vs_hf", "--child-threads", str(t),
               "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
               "--dtypes", *args.dtypes]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows += [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    with open(args.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    hf = {r["threads"]: r["decode_tok_s"] for r in rows if r["system"] == "hf_transformers"}
    for r in rows:
        ratio = r["decode_tok_s"] / hf[r["threads"]]
        print(f"{r['system']:16s} {r['dtype']:9s} threads={r['threads']} "
              f"prefill={r['prefill_tok_s']:8.1f} tok/s decode={r['decode_tok_s']:6.1f} tok/s "
              f"({ratio:.2f}x HF) first_token={r.get('first_token_s', float('nan')):.1f}s")


if __name__ == "__main__":
    main()
