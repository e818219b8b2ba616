"""MoE decode tokens/s of our engine against llama.cpp (issue 35): a synthetic GGUF of
OLMoE-1B-7B's shape (random weights), Q4_0.

The file is written directly with the gguf package (a 7B model built by transformers would need
~28 GB of RAM here): arch `olmoe`, every matrix Q4_0 with random blocks (scales ~1/sqrt(fan-in)
so activations stay finite), the router `ffn_gate_inp` F32 random normal (tokens route to
random experts: no power law), norms ones. Its tokenizer is a small byte-level BPE
(tests/helpers_moe.py's, converted by llama.cpp's converter) padded with unused tokens to
OLMoE's 50304, so the embedding and LM head have the real shape.

    python -m benchmarks.moe_vs_llamacpp --make
    flock -x /tmp/pij_cpu.lock python -m benchmarks.moe_vs_llamacpp --rounds 3
    flock -x /tmp/pij_cpu.lock python -m benchmarks.moe_vs_llamacpp --rounds 5 \
        --model DIR/synthetic-olmoe-1b-7b-e64k8-h0.8-silu-Q4_0.gguf
(DIR: python -m powerinfer_jax.synthetic.moe --shape olmoe-1b-7b --out DIR)

Per round, back to back in fresh processes: llama-bench (tg, -p 0) on the file, then our
`python -m powerinfer_jax.bench` (dense, the experts' blocks through ops.moe_ffn) on the same
file, both at --threads. Rows (JSONL) go to benchmarks/moe_vs_llamacpp.jsonl; the summary gives
the bytes a decode step reads (attention, the LM head and the k routed experts per layer, not
all 64) against the achieved rate.
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

import numpy as np

from benchmarks.q4_vs_llamacpp import git_commit, llama_bench, machine

REPO = Path(__file__).resolve().parents[1]
# tests/ is no package: its helpers import each other as top-level modules, as under pytest
sys.path.insert(0, str(REPO / "tests"))

import helpers_llamacpp as llamacpp  # noqa: E402

WORK = llamacpp.cache_root() / "bench_moe"
# allenai/OLMoE-1B-7B-0924's public config.json
OLMOE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=16, intermediate_size=1024, num_experts=64,
             num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096,
             rope_theta=10000.0, rms_norm_eps=1e-5)
Q4_0_BLOCK, Q4_0_BYTES = 32, 18


def _q4_0(rng, shape, fan_in):
    """Random Q4_0 blocks for a matrix of numpy shape `shape` (last axis: weights)."""
    lead, cols = shape[:-1], shape[-1]
    nb = cols // Q4_0_BLOCK
    b = rng.integers(0, 256, lead + (nb, Q4_0_BYTES), dtype=np.uint8)
    d = np.float16(0.5 / np.sqrt(fan_in) / 4)
    b[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    return b.reshape(lead + (nb * Q4_0_BYTES,))


def tokenizer_meta(vocab: int) -> dict:
    """A tiny BPE GGUF's tokenizer keys (the test helpers' Qwen-style vocabulary converted by
    llama.cpp), the token list padded with unused tokens to `vocab`."""
    import helpers_moe as moe

    from powerinfer_jax.checkpoint.gguf import tokenizer_metadata

    d = WORK / "tok"
    src = WORK / "tok.gguf"
    if not src.is_file():
        moe.build("olmoe", d)
        llamacpp.convert([(d, src, moe.FAMILIES["olmoe"].gguf_pre, "f32")])
    meta = tokenizer_metadata(src)
    n = len(meta["tokens"])
    meta["tokens"] = list(meta["tokens"]) + [f"[PAD{i}]" for i in range(n, vocab)]
    meta["token_type"] = list(meta["token_type"]) + [5] * (vocab - n)  # UNUSED
    return meta


def make() -> Path:
    import gguf

    from powerinfer_jax.checkpoint.gguf import TOKENIZER_WRITERS

    out = WORK / "olmoe-1b-7b-shaped.q4_0.gguf"
    if out.is_file():
        return out
    WORK.mkdir(parents=True, exist_ok=True)
    c = OLMOE
    d, f, e, nl = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["num_hidden_layers"]
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "olmoe")
    w.add_name("synthetic OLMoE-1B-7B-shaped (random weights)")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_block_count(nl)
    w.add_feed_forward_length(f)
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(e)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_vocab_size(c["vocab_size"])
    for key, value in tokenizer_meta(c["vocab_size"]).items():
        getattr(w, TOKENIZER_WRITERS[key])(value)
    rng = np.random.default_rng(0)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def add_q4(name, shape, fan_in):
        w.add_tensor(name, _q4_0(rng, shape, fan_in), raw_dtype=q4)  # bytes: [..., row bytes]

    add_q4("token_embd.weight", (c["vocab_size"], d), d)
    add_q4("output.weight", (c["vocab_size"], d), d)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(nl):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + n + ".weight", np.ones(d, np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add_q4(p + n + ".weight", (d, d), d)
        w.add_tensor(p + "ffn_gate_inp.weight",
                     rng.standard_normal((e, d), dtype=np.float32) * d ** -0.5)
        add_q4(p + "ffn_gate_exps.weight", (e, f, d), d)
        add_q4(p + "ffn_up_exps.weight", (e, f, d), d)
        add_q4(p + "ffn_down_exps.weight", (e, d, f), f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def decode_bytes(path: Path) -> int:
    """Bytes one decode step reads: every tensor but the embedding (its row aside) and the
    unrouted experts (k of E per layer)."""
    from powerinfer_jax.checkpoint.gguf_file import GGUFFile

    f = GGUFFile(path)
    arch = f.metadata["general.architecture"]
    k, e = f.metadata[f"{arch}.expert_used_count"], f.metadata[f"{arch}.expert_count"]
    total = 0
    for t in f.tensors:
        if t.name == "token_embd.weight":
            continue
        total += int(t.n_bytes) * k // e if "_exps." in t.name else int(t.n_bytes)
    return total


def ours(path: Path, *, threads: int, new_tokens: int, prompt_tokens: int, repeats: int):
    cmd = [sys.executable, "-m", "powerinfer_jax.bench", "--model", str(path), "--dtype",
           "bfloat16", "--sparsity", "dense", "--new-tokens", str(new_tokens),
           "--prompt-tokens", str(prompt_tokens), "--threads", str(threads), "--repeats",
           str(repeats), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make", action="store_true", help="make the file and stop")
    ap.add_argument("--model", default=None, metavar="GGUF",
                    help="another MoE GGUF (e.g. python -m powerinfer_jax.synthetic.moe's) "
                         "instead of the random-routing file --make writes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="our bench's timed runs per process")
    ap.add_argument("--llama-bench", default=str(llamacpp.binary("llama-bench") or ""))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "moe_vs_llamacpp.jsonl"))
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else make()
    if args.make:
        print(json.dumps({"file": str(path), "bytes": path.stat().st_size}))
        return 0
    if not Path(args.llama_bench).is_file():
        ap.error("--llama-bench: no llama-bench (benchmarks/build_llama_bench_cpu.sh)")
    from experiments._common import append_rows, run_id

    base = {"bench": "moe_vs_llamacpp", "run_id": run_id(), "commit": git_commit(),
            "machine": machine(), "threads": args.threads, "synthetic": True,
            "shape": "olmoe-1b-7b", "config": OLMOE,
            "weights_note": "random Q4_0 blocks written directly (gguf package), F32 router"}
    if args.model:  # a generated model: what its generator recorded
        rec = path.parent / "synthetic.json"
        rec = json.loads(rec.read_text()) if rec.is_file() else {}
        base.update(shape=path.stem, config=rec.get("config"), weights_note=(
            "python -m powerinfer_jax.synthetic.moe: prescribed power-law routing on text"
            + ("; relu experts run sparse inside (the exact oracle; llama.cpp's olmoe/qwen3moe "
               "graph computes silu on every neuron)"
               if (rec.get("config") or {}).get("activation") == "relu" else "")),
            generator={k: rec.get(k) for k in ("command", "hot_fraction", "hot_share",
                                                "neuron_sparsity", "seed", "commit")})
    from powerinfer_jax import _bench_ops, ops

    ops.set_num_threads(args.threads)
    base["machine_read_gb_s"] = _bench_ops.read_bandwidth_gbs(nbytes=1 << 30)  # streaming sum
    ours(path, threads=args.threads, new_tokens=4, prompt_tokens=args.prompt_tokens, repeats=1)
    llama_bench(Path(args.llama_bench), path, threads=args.threads, new_tokens=4)
    rows = []
    for rnd in range(args.rounds):
        for system in ("llama.cpp", "powerinfer_jax"):
            la, t0 = os.getloadavg(), time.time()
            if system == "llama.cpp":
                r, cmd = llama_bench(Path(args.llama_bench), path, threads=args.threads,
                                     new_tokens=args.new_tokens)
                tok_s = r["avg_ts"]
                extra = {"llama_bench": {k: r.get(k) for k in (
                    "build_commit", "cpu_info", "model_type", "model_size", "n_gen",
                    "n_threads", "samples_ts")}}
            else:
                r, cmd = ours(path, threads=args.threads, new_tokens=args.new_tokens,
                              prompt_tokens=args.prompt_tokens, repeats=args.repeats)
                tok_s = r["decode_tok_s"]
                extra = {"ours": r}
            row = {**base, "kind": "decode", "round": rnd, "system": system, "file": str(path),
                   "tok_s": tok_s, "loadavg": la, "seconds": time.time() - t0,
                   "command": " ".join(map(str, cmd)), **extra}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("round", "system", "tok_s")}), flush=True)
    by = {s: {r["round"]: r["tok_s"] for r in rows if r["system"] == s}
          for s in ("llama.cpp", "powerinfer_jax")}
    ratios = [by["powerinfer_jax"][k] / by["llama.cpp"][k] for k in sorted(by["llama.cpp"])]
    nbytes = decode_bytes(path)
    med = {k: statistics.median(v.values()) for k, v in by.items()}
    summary = {**base, "kind": "summary", "rounds": args.rounds, "median_tok_s": med,
               "ratio_per_round": ratios, "median_ratio": statistics.median(ratios),
               "decode_bytes_per_token": nbytes,
               "achieved_gb_s": {k: v * nbytes / 1e9 for k, v in med.items()}}
    print(json.dumps({k: summary[k] for k in ("median_tok_s", "median_ratio", "achieved_gb_s",
                                              "machine_read_gb_s")}), flush=True)
    append_rows(Path(args.out), rows + [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
