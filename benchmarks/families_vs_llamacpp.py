"""Dense decode tokens/s of our engine against llama.cpp on the families' shapes (issue 34):
synthetic GGUFs (random weights) of Qwen3-1.7B's and Gemma-2-2B's shapes, Q4_0; and Gemma-3-1B's
shape as Q4_K_M (issue 53: its 1152-wide rows are no multiple of 256, so llama-quantize mixes
Q5_0/Q8_0 into the K-quants, the mix a user's Gemma-3 file has).

Each file is made the way a user's would be: a full-size random model built by transformers
from the real model's public config values (written below), saved as an HF directory with a
small tokenizer of the family's kind (tests/helpers_families.py: the tokenizer does not change
decode speed; the converter pads the vocabulary to the config's), converted to F16 by llama.cpp's
own convert_hf_to_gguf.py and quantized to Q4_0 by its llama-quantize (which, as for any user,
picks its own types for the embedding/output tensor).

    python -m benchmarks.families_vs_llamacpp --make            # the files, once (~10 GB work dir)
    flock -x /tmp/pij_cpu.lock python -m benchmarks.families_vs_llamacpp --rounds 3

Per round, per shape, back to back in fresh processes: llama.cpp's llama-bench (tg: -p 0) on the
file, then our `python -m powerinfer_jax.bench` (dense, bfloat16 compute on the file's blocks)
on the same file, both at --threads. The VM drifts, so the figure is the median over rounds of
the per-round ratio. Rows (JSONL, with config, commit, machine, threads, load average) go to
benchmarks/families_vs_llamacpp.jsonl; the summary rows also give bytes read per token (the
file's tensors a decode step reads: every matrix once, the embedding row aside) against the
achieved rate, to tell bandwidth-bound from compute-bound.
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

from benchmarks.q4_vs_llamacpp import git_commit, llama_bench, machine

REPO = Path(__file__).resolve().parents[1]
# tests/ is no package: its helpers import each other as top-level modules, as under pytest
sys.path.insert(0, str(REPO / "tests"))

import helpers_llamacpp as llamacpp  # noqa: E402  (tests/: the converter runner and finder)

WORK = llamacpp.cache_root() / "bench_families"
# Public config values of the real models (their config.json on the Hugging Face hub).
SHAPES = {
    "qwen3-1.7b": dict(
        family="qwen3", config_class="Qwen3Config",
        config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True, vocab_size=151936, hidden_act="silu")),
    "gemma2-2b": dict(
        family="gemma2", config_class="Gemma2Config",
        config=dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
                    sliding_window=4096, query_pre_attn_scalar=256,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                    vocab_size=256000)),
    "gemma3-1b": dict(
        family="gemma3", config_class="Gemma3TextConfig", qtype="Q4_K_M",
        config=dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    rope_local_base_freq=10000.0, sliding_window=512,
                    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                    tie_word_embeddings=True, vocab_size=262144)),
}


def qtype(shape: str) -> str:
    """The llama-quantize type of the shape's file (Q4_0 unless the shape names another)."""
    return SHAPES[shape].get("qtype", "Q4_0")


def paths(shape: str) -> dict:
    d = WORK / shape
    return {"hf": d / "hf", "f16": d / f"{shape}.f16.gguf",
            "quantized": d / f"{shape}.{qtype(shape).lower()}.gguf"}


def make(shape: str) -> Path:
    """HF directory -> F16 GGUF -> quantized GGUF (each step skipped when its output exists)."""
    import torch
    import transformers

    import helpers_families as fam

    spec, p = SHAPES[shape], paths(shape)
    if not (p["hf"] / "config.json").is_file():
        family = fam.FAMILIES[spec["family"]]
        fam.save_tokenizer(p["hf"], family.tokenizer, fam.template(family.template))
        cfg = getattr(transformers, spec["config_class"])(**spec["config"], bos_token_id=2,
                                                          eos_token_id=1, pad_token_id=0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(p["hf"])
        del model
    if not p["f16"].is_file():
        llamacpp.convert([(p["hf"], p["f16"], fam_pre(shape), "f16")], timeout=3600)
    if not p["quantized"].is_file():
        llamacpp.quantize(p["f16"], p["quantized"], qtype(shape), threads=2)
    return p["quantized"]


def fam_pre(shape: str) -> str | None:
    import helpers_families as fam

    return fam.FAMILIES[SHAPES[shape]["family"]].gguf_pre


def decode_bytes(gguf: Path) -> int:
    """Bytes of the tensors one decode step reads: every 2-D tensor (matrices; the tied
    embedding matrix once, as the LM head) but the embedding lookup's single row."""
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    r = GGUFFile(gguf)
    names = {t.name for t in r.tensors}
    total = 0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # untied: only its looked-up row is read
        total += int(t.n_bytes)
    return total


def ours(gguf: Path, *, threads: int, new_tokens: int, prompt_tokens: int, repeats: int):
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", str(gguf), "--dtype",
           "bfloat16", "--sparsity", "dense", "--new-tokens", str(new_tokens),
           "--prompt-tokens", str(prompt_tokens), "--threads", str(threads), "--repeats",
           str(repeats), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make", action="store_true", help="make the files and stop")
    ap.add_argument("--shapes", default="qwen3-1.7b,gemma2-2b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="our bench's timed runs per process")
    ap.add_argument("--llama-bench", default=str(llamacpp.binary("llama-bench") or ""))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "families_vs_llamacpp.jsonl"))
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: expected names from {list(SHAPES)}, got {s!r}")
    files = {s: make(s) for s in shapes}
    if args.make:
        print(json.dumps({s: str(f) for s, f in files.items()}))
        return 0
    if not Path(args.llama_bench).is_file():
        ap.error("--llama-bench: no llama-bench (benchmarks/build_llama_bench_cpu.sh)")
    from experiments._common import append_rows, run_id

    base = {"bench": "families_vs_llamacpp", "run_id": run_id(), "commit": git_commit(),
            "machine": machine(), "threads": args.threads, "synthetic": True,
            "weights_note": "random weights (transformers init), quantized by llama-quantize "
                            "(the shape's qtype)"}
    # untimed warm-up of ours (XLA's compile cache) and of the page cache for llama.cpp
    for s in shapes:
        ours(files[s], threads=args.threads, new_tokens=4, prompt_tokens=args.prompt_tokens,
             repeats=1)
        llama_bench(Path(args.llama_bench), files[s], threads=args.threads, new_tokens=4)
    rows = []
    for rnd in range(args.rounds):
        for s in shapes:
            for system in ("llama.cpp", "powerinfer_jax"):
                la, t0 = os.getloadavg(), time.time()
                if system == "llama.cpp":
                    r, cmd = llama_bench(Path(args.llama_bench), files[s], threads=args.threads,
                                         new_tokens=args.new_tokens)
                    tok_s = r["avg_ts"]
                    extra = {"llama_bench": {k: r.get(k) for k in (
                        "build_commit", "cpu_info", "model_type", "model_size", "n_gen",
                        "n_threads", "samples_ts")}}
                else:
                    r, cmd = ours(files[s], threads=args.threads, new_tokens=args.new_tokens,
                                  prompt_tokens=args.prompt_tokens, repeats=args.repeats)
                    tok_s = r["decode_tok_s"]
                    extra = {"ours": r}
                row = {**base, "kind": "decode", "round": rnd, "shape": s, "system": system,
                       "file": str(files[s]), "tok_s": tok_s, "loadavg": la,
                       "seconds": time.time() - t0, "command": " ".join(map(str, cmd)), **extra}
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("round", "shape", "system", "tok_s")}),
                      flush=True)
    summary = []
    for s in shapes:
        by = {sys_: {r["round"]: r["tok_s"] for r in rows if r["shape"] == s
                     and r["system"] == sys_} for sys_ in ("llama.cpp", "powerinfer_jax")}
        ratios = [by["powerinfer_jax"][k] / by["llama.cpp"][k] for k in sorted(by["llama.cpp"])]
        nbytes = decode_bytes(files[s])
        med = {k: statistics.median(v.values()) for k, v in by.items()}
        summary.append({**base, "kind": "summary", "shape": s, "qtype": qtype(s),
                        "config": SHAPES[s]["config"],
                        "rounds": args.rounds, "median_tok_s": med,
                        "ratio_per_round": ratios, "median_ratio": statistics.median(ratios),
                        "decode_bytes_per_token": nbytes,
                        "achieved_gb_s": {k: v * nbytes / 1e9 for k, v in med.items()}})
        print(json.dumps({k: summary[-1][k] for k in ("shape", "median_tok_s", "median_ratio",
                                                      "achieved_gb_s")}), flush=True)
    append_rows(Path(args.out), rows + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
