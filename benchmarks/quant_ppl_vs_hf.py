"""Issue 14's quality check: perplexity of quantized SmolLM2 GGUFs, ours vs HF transformers.

Hypothesis: on wiki.valid (ctx 512, 16 chunks), our perplexity is within 1% of HF transformers'
on the same file, for a Q4_1, a Q4_K_M and a Q8_0 SmolLM2-135M (the Q4_K_M and Q8_0 made with
llama.cpp's own `llama-quantize`: benchmarks/make_quantized_smollm2.sh).

Per file:
  ours   `python -m powerinfer_jax.evaluate --model FILE --text wiki.valid --ctx 512
         --max-chunks N --json --dtype float32` in a child process, twice:
         --weights auto (the file's blocks stay quantized and the kernels compute on them with
         8-bit activations, as llama.cpp does) and --weights dtype (dequantized to float32 at load)
  hf     transformers `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name,
         torch_dtype=float32)` (transformers dequantizes the GGUF to float32 itself), scoring the
         same token ids: our tokenizer's ids of the whole file (no BOS), the same non-overlapping
         ctx-token chunks (runtime.perplexity.chunk_tokens), the NLL of tokens 1..ctx-1 of each chunk
         (runtime.perplexity.perplexity's definition), torch threads = --threads.
Each row: file, its tensor type counts (gguf package), system, weights mode, ppl, ratio to HF's
ppl on the same file, within_1pct, commit (git rev-parse HEAD), machine, threads, dtype.

  nice -n 10 python benchmarks/quant_ppl_vs_hf.py --files A.gguf B.gguf ... \
      [--chunks 16] [--threads 2] [--out benchmarks/quant_ppl_vs_hf.jsonl]

Without --files: the registry's Q4_1 file and the Q4_K_M / Q8_0 files that
make_quantized_smollm2.sh writes (those that exist).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VALID = REPO.parent / "shared" / "data" / "wiki.valid.txt"
CACHE = Path(os.environ.get("POWERINFER_JAX_CACHE", Path.home() / ".cache" / "powerinfer_jax"))
WEIGHTS = ("auto", "dtype")
# How each file was made (the only source weights on hand are the registry's Q4_1 file).
PROVENANCE = {
    "Q4_1": "registry file (as published)",
    "Q4_K_M": "llama-quantize Q4_K_M of the F32 GGUF of the dequantized registry Q4_1 "
              "(requantized, not from the original BF16 release)",
    "Q8_0": "llama-quantize Q8_0 of the F32 GGUF of the dequantized registry Q4_1 "
            "(requantized, not from the original BF16 release)",
}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def default_files() -> list[Path]:
    from powerinfer_jax.checkpoint import resolve_model

    q41 = Path(resolve_model("smollm2-135m"))
    stem = q41.name.split(".")[0]
    quant = CACHE / "models" / "smollm2-135m" / "quant"
    return [q41] + [p for t in ("Q4_K_M", "Q8_0")
                    if (p := quant / f"{stem}.{t}.gguf").is_file()]


def type_counts(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return dict(sorted(counts.items()))


def file_type(path: Path) -> str:
    return path.name.removesuffix(".gguf").split(".")[-1]


def token_ids(path: Path, text: str) -> list[int]:
    """Our tokenizer's ids of the whole text (no BOS), as evaluate.py tokenizes it."""
    from powerinfer_jax.checkpoint.gguf import _open, read_metadata
    from powerinfer_jax.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(_open(path))).encode(text, add_bos=False)


def ours(path: Path, text: Path, *, weights: str, chunks: int, ctx: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "powerinfer_jax.evaluate", "--model", str(path), "--text",
           str(text), "--ctx", str(ctx), "--max-chunks", str(chunks), "--json", "--no-progress",
           "--dtype", "float32", "--weights", weights, "--threads", str(threads)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"ppl": res["ppl"], "tokens_scored": res["tokens_scored"], "chunks": res["chunks"],
            "wall_s": wall, "command": " ".join(cmd[1:]),
            "matrix_formats": res.get("weights"), "kernels": res.get("kernels"),
            "auto": res.get("auto")}


def hf(path: Path, ids: list[int], *, chunks: int, ctx: int, threads: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from powerinfer_jax.runtime.perplexity import chunk_tokens

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 torch_dtype=torch.float32).eval()
    nll, scored = 0.0, 0
    parts = chunk_tokens(ids, ctx, chunks)
    for chunk in parts:
        with torch.no_grad():
            x = torch.tensor(np.asarray(chunk[None], np.int64))
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            nll -= logp.gather(-1, x[0, 1:, None]).sum().item()
        scored += ctx - 1
    wall = time.perf_counter() - t0
    del model
    return {"ppl": math.exp(nll / scored), "tokens_scored": scored,
            "chunks": int(parts.shape[0]), "wall_s": wall,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__}


def previous_hf(out: Path, name: str, args) -> dict:
    """The latest hf_transformers row of `out` for file `name` at the same ctx, chunks, text."""
    found = None
    if out.is_file():
        for line in out.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if (r.get("system") == "hf_transformers" and r.get("file") == name
                    and r.get("ctx") == args.ctx and r.get("max_chunks") == args.chunks
                    and r.get("text") == args.text.name):
                found = r
    if found is None:
        raise SystemExit(f"--reuse-hf: no hf_transformers row for {name} (ctx {args.ctx}, "
                         f"{args.chunks} chunks, {args.text.name}) in {out}: run without it")
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", type=Path, default=None,
                   help="GGUF files (default: the registry Q4_1 and make_quantized_smollm2.sh's)")
    p.add_argument("--chunks", type=int, default=16, help="chunks of --ctx tokens (default 16)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", type=Path, default=VALID)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "quant_ppl_vs_hf.jsonl")
    p.add_argument("--note", default="other work shared the machine (nice -n 10)")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS),
                   help="our weight modes to run (default: all)")
    p.add_argument("--reuse-hf", action="store_true",
                   help="take HF's perplexity from the latest hf_transformers row of --out for "
                        "the same file, ctx, chunks and text (HF's side does not change with our "
                        "commits) instead of running transformers again; the row says so")
    args = p.parse_args(argv)

    from powerinfer_jax import _cli

    files = args.files or default_files()
    text = args.text.read_text(encoding="utf-8")
    base = {"bench": "quant_ppl_vs_hf", "commit": commit(), "machine": _cli.machine_info(),
            "threads": args.threads, "dtype": "float32", "ctx": args.ctx,
            "max_chunks": args.chunks, "text": args.text.name, "shared_machine": args.note}
    for path in files:
        path = path.resolve()
        ftype = file_type(path)
        head = {**base, "file": path.name, "file_type": ftype,
                "provenance": PROVENANCE.get(ftype, "given"),
                "file_bytes": path.stat().st_size, "tensor_types": type_counts(path)}
        ids = token_ids(path, text)
        print(f"{path.name}: {len(ids)} tokens, types {head['tensor_types']}", file=sys.stderr,
              flush=True)
        if args.reuse_hf:
            ref, rows = previous_hf(args.out, path.name, args), []
            head["hf_reused_from"] = {"commit": ref["commit"], "time": ref["time"]}
        else:
            ref = hf(path, ids, chunks=args.chunks, ctx=args.ctx, threads=args.threads)
            rows = [{**head, "system": "hf_transformers", "weights": "dequantized float32 (HF)",
                     **ref, "ratio_to_hf": 1.0, "within_1pct": True}]
        print(f"  hf_transformers          ppl {ref['ppl']:.4f}", file=sys.stderr, flush=True)
        for weights in args.weights:
            try:
                res = ours(path, args.text, weights=weights, chunks=args.chunks, ctx=args.ctx,
                           threads=args.threads)
            except Exception as e:  # noqa: BLE001 - recorded as a failed row
                rows.append({**head, "system": "powerinfer_jax", "weights": weights,
                             "status": "error", "error": str(e)[-2000:]})
                print(f"  powerinfer_jax {weights:6s} FAILED: {str(e)[-300:]}", file=sys.stderr)
                continue
            if res["tokens_scored"] != ref["tokens_scored"]:
                raise RuntimeError(f"{path.name}: scored {res['tokens_scored']} tokens, HF "
                                   f"{ref['tokens_scored']}")
            ratio = res["ppl"] / ref["ppl"]
            rows.append({**head, "system": "powerinfer_jax", "weights": weights, **res,
                         "hf_ppl": ref["ppl"], "ratio_to_hf": ratio,
                         "within_1pct": abs(ratio - 1) < 0.01, "status": "ok"})
            print(f"  powerinfer_jax {weights:6s}    ppl {res['ppl']:.4f}  ratio {ratio:.4f}",
                  file=sys.stderr, flush=True)
        t = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"time": t, **r}) + "\n")


if __name__ == "__main__":
    main()
