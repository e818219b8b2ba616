"""Decode tokens/s of our MoE placement (hot experts on the accelerator, the rest on the host
pool) against llama.cpp's own expert offload (-ngl all --n-cpu-moe N) at the same VRAM budget,
in interleaved rounds (moe_check.sh's timing step; issue 35's GPU check).

SYNTHETIC: the model is `python -m powerinfer_jax.synthetic.moe`'s (random weights whose routers
pick each layer's experts with prescribed power-law frequencies on text), read from its output
folder (synthetic.json, frequencies.npz, the GGUF).

  ours       runtime.session.build on the GGUF with --vram-budget B (hybrid): per layer the most
             often routed experts (the generator's calibrated routing frequencies, written as the
             model's expert profile <model-dir>/artifacts/experts.npz) held on the accelerator,
             the rest as the file's tensors computed by the host pool
  llama.cpp  llama-bench -ngl all --n-cpu-moe N on the same GGUF: every tensor but the token
             embeddings on the GPU except the routed experts of the first N layers, N the
             fewest that fit B (llama_cpp_ngl.py's "ncmoe" layout)
B = our dense bytes + --budget x our expert bytes at --dtype (llama_cpp_ngl.our_budget: the
experts charged as the accelerator holds them). With an F16 GGUF and --dtype bfloat16 both
engines hold two bytes per weight, so B buys both the same share of the experts: llama.cpp the
last layers' experts whole, ours the hottest experts of every layer. Rounds alternate the
order; --deadline stops before a run that would not finish, with a row saying so.

With --device cpu (moe_check.sh --dry-run) the same path runs on a CPU: the placement's hot
experts run through XLA on the CPU, the cold ones from the host store through its callback, as
an accelerator runs them (MoE.split's store "host", which a CPU-only run would not choose), and
llama-bench is a CPU build: no GPU figure.

    python -m benchmarks.gpu.moe_bench --model-dir DIR --llama-bin BIN --budget 0.25 \
        --threads 16 --out $OUT/moe.jsonl --commit ABC
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.gpu import llama_cpp_ngl as lcn
from benchmarks.gpu import sparse_7b_bench as s7

SYNTHETIC = ("random weights whose routers pick each layer's experts with prescribed power-law "
             "frequencies on text (python -m powerinfer_jax.synthetic.moe); speed only")
MODEL_KEYS = ("arch", "config", "hot_fraction", "hot_share", "neuron_sparsity", "qtype", "seed",
              "calib_tokens")


def write_expert_profile(d: Path, cfg) -> tuple[Path, np.ndarray]:
    """The generator's calibrated routing frequencies as the model's expert profile, where the
    session's placement reads it (runtime/vram_budget.py `expert_frequencies`: <artifacts root>/
    experts.npz), so the session does not profile the routers again. Returns the file and the
    frequencies [L, E]."""
    from powerinfer_jax.runtime.vram_budget import EXPERT_PROFILE_NAME

    with np.load(d / "frequencies.npz") as z:
        freq = np.asarray(z["calibrated"], np.float64)
    if freq.shape != (cfg.n_layers, cfg.n_experts):
        sys.exit(f"{d / 'frequencies.npz'}: expected calibrated routing frequencies of shape "
                 f"{(cfg.n_layers, cfg.n_experts)}, got {freq.shape}")
    out = d / "artifacts" / EXPERT_PROFILE_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, frequency=freq, tokens=np.int64(0))
    return out, freq


def build_ours(rec: dict, d: Path, args, budget: int):
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.models.moe import MoE
    from powerinfer_jax.runtime.session import build

    if args.device == "cpu" and not getattr(MoE.split, "_host_store", False):
        # the dry run: the cold experts through the host store, the accelerator's path
        split = MoE.split

        def host_split(self, n_hot, *, store="auto"):
            return split(self, n_hot, store="host" if store == "auto" else store)

        host_split._host_store = True
        MoE.split = host_split

    runtime = RuntimeConfig(dtype=args.dtype, threads=args.threads, max_seq_len=args.max_seq_len)
    placement = PlacementConfig(vram_budget_gib=budget / 2 ** 30, offload="hybrid")
    return build(rec["file"], runtime, SparsityConfig(mode="dense"), placement=placement,
                 artifacts_root=d / "artifacts", progress=False)


def placement_row(session, cfg, freq: np.ndarray) -> dict:
    """Hot experts per layer and the share of the routings they serve (by the profile)."""
    p = session.placement
    if p is None:
        return {"placement": None}
    hot = [int(h) for h in p.hot]
    served = [float(np.sort(f)[::-1][:h].sum() / max(f.sum(), 1e-30)) for f, h in zip(freq, hot)]
    # layers whose cold experts are in the host store (run through its callback)
    host = sum(layer.ffn.host_handle is not None for layer in session.model.layers)
    return {"hot_per_layer": hot, "hot_fraction": sum(hot) / (cfg.n_experts * cfg.n_layers),
            "served_fraction": float(np.mean(served)), "host_store_layers": host}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True,
                    help="python -m powerinfer_jax.synthetic.moe --out")
    s7.add_common_args(ap, budget_help="VRAM beyond our dense parts, as a fraction of our "
                                       "expert bytes")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args(argv)
    s7.check_args(args)
    from powerinfer_jax.checkpoint.gguf import read_config

    d = Path(args.model_dir)
    rec = s7.read_model_dir(d, "powerinfer_jax.synthetic.moe", lambda r: {"GGUF": r.get("file")})
    cfg = read_config(rec["file"]).replace(max_seq_len=args.max_seq_len)
    profile, freq = write_expert_profile(d, cfg)
    budget, ours_sizes = lcn.our_budget(cfg, args.dtype, args.budget, args.max_seq_len)
    n_ctx = args.prompt_tokens + args.new_tokens
    layout = lcn.llama_cpp_layout(lcn.gguf_bytes(rec["file"]), budget, n_ctx, "ncmoe")
    if layout is None:
        sys.exit(f"--budget {args.budget}: {budget} bytes do not hold llama.cpp's tensors "
                 "other than the experts; raise it")
    cmd = lcn.llama_bench_cmd(args.llama_bin, rec["file"], layout, threads=args.threads,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              repeats=args.repeats)
    head = s7.header(args, rec, "gpu_moe_check", MODEL_KEYS, SYNTHETIC)
    head.update(budget_expert_fraction=args.budget, budget_bytes=budget,
                bytes_dense_ours=ours_sizes.dense, bytes_experts_ours=ours_sizes.ffn)
    print(json.dumps({"budget_gib": round(budget / 2 ** 30, 3), "n_cpu_moe": layout.n_cpu_moe,
                      "llama_cpp_gpu_gib": round(layout.gpu_bytes / 2 ** 30, 3),
                      "profile": str(profile)}), flush=True)
    s7.run_rounds(args, head, layout, cmd, "hybrid_hot_experts",
                  lambda: build_ours(rec, d, args, budget),
                  lambda s: placement_row(s, cfg, freq))
    s7.print_ratio(args.out, args.run_id)


if __name__ == "__main__":
    main()
