"""GPU decode tokens/s: the hybrid engine vs `--offload layers` vs all-GPU, at VRAM budgets given as
fractions of the FFN bytes (issue 5's benchmark). Needs a GPU and the PIJ_CUDA=ON build.

SYNTHETIC: the weights are random (no checkpoint can reach the GPU machine), and the active
neurons are not predicted from the weights. Each layer gets a `SampledMasks` predictor: neuron i is
active for a token with probability freq[l, i], drawn inside the jitted step from the token's own
hidden state, so every token and layer draws a fresh mask. freq comes from an activation profile
(--profile, benchmarks/gpu/synthetic.py `load_profile`): by default SmolLM2-135M's profiled
frequencies (benchmarks/gpu/smollm2_frequency.npz, from `python -m powerinfer_jax.calibrate` at
target 0.50 or 0.80), or any profile npz, e.g. a sparsified model's
`sparsity/target_*/profile.npz`, whose neurons fire with more locality. As is when the profile has
the model's shape; otherwise each layer's sorted frequencies are resampled to the model's neurons
(the layer of the same relative depth) and assigned to neurons in a random order. The placement
sees the same freq, as it would see a real profile.

Every configuration runs the framework's own path: Transformer, placement (sparsity/placement.py),
apply_placement (hot-first permutation; cold rows registered once in the CUDA module's host store)
and the Engine's jitted decode. Modes (SparsityConfig in brackets):
  all_gpu           every row on the GPU, sparse CUDA kernels on the sampled mask (predictor)
  all_gpu_dense     every row on the GPU, XLA's dense matmuls (dense)
  hybrid            hot neurons (by frequency) on the GPU, cold ones on the host pool (predictor)
  layers            the first k whole layers' FFNs on the GPU, the rest on the host pool,
                    computing only the sampled-active neurons (predictor)
  layers_dense      the llama.cpp -ngl baseline: as layers, every neuron computed (dense)
Attention, norms, embeddings and the KV cache stay on the GPU in every mode, also for the layers
baselines (llama.cpp would run an offloaded layer's attention on the CPU too): this favours the
baselines.

Overlap (--overlap): one hybrid FFN layer of the model at one budget, timed as is, with only its
hot part active (cold mask empty) and with only its cold part active (hot mask empty). GPU and host
work overlap when the full call takes less than the sum of the two parts.

  python -m benchmarks.gpu.hybrid_decode --shapes llama2-7b --budgets 0.1 0.25 0.5 1.0 \
      --out benchmarks/gpu_hybrid.jsonl --commit $(git rev-parse --short HEAD)
  python -m benchmarks.gpu.hybrid_decode --profile path/to/target_0.50/profile.npz ...
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.gpu import synthetic
from powerinfer_jax.config import ModelConfig, SparsityConfig

REPO = Path(__file__).resolve().parents[2]

SHAPES = synthetic.SHAPES
MODES = ("all_gpu", "all_gpu_dense", "hybrid", "layers", "layers_dense")


class SampledMasks(nnx.Module):
    """A stand-in predictor: scores freq_i - u_i with u_i uniform, drawn from a key made of the
    token's hidden state, so scores > 0 with probability freq_i, fresh per token and layer."""

    def __init__(self, freq):
        self.freq = nnx.Param(jnp.asarray(freq, jnp.float32))

    def __call__(self, x_btd):
        bits = jax.lax.bitcast_convert_type(x_btd[..., :2].astype(jnp.float32), jnp.uint32)
        seeds = (bits[..., 0] ^ (bits[..., 1] * jnp.uint32(2654435761))).reshape(-1)
        f = self.freq.shape[0]
        u = jax.vmap(lambda s: jax.random.uniform(jax.random.key(s), (f,)))(seeds)
        return (self.freq[...] - u).reshape(x_btd.shape[:-1] + (f,))

    def permute(self, perm) -> None:
        self.freq.set_value(self.freq[...][perm])


def build(cfg: ModelConfig, freq: np.ndarray, dtype, seed: int, sparsity):
    """A synthetic model (random weights: no checkpoint to build from) in `sparsity`'s mode;
    predictor mode's predictors sample masks at the profiled frequencies."""
    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.sparsity import modes

    m = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed), kernels="xla")
    modes.configure(m, sparsity, predictors=None if sparsity.mode == "dense" else
                    [SampledMasks(f) for f in freq])
    return m


def place(m, mode: str, frac: float, freq, kv_len: int):
    """Apply the placement for `mode` at a budget of dense bytes + frac * FFN bytes."""
    from powerinfer_jax.models.hybrid import apply_placement
    from powerinfer_jax.sparsity import placement as pl

    sizes = pl.model_bytes(m, kv_len=kv_len)
    budget = sizes.dense + int(frac * sizes.ffn)
    p = pl.place("layers" if mode.startswith("layers") else "hybrid", list(freq), sizes, budget)
    t0 = time.perf_counter()
    apply_placement(m, p)
    jax.block_until_ready(nnx.state(m))
    return p, sizes, time.perf_counter() - t0


def decode_tok_s(engine, prompt, new_tokens: int, repeats: int) -> tuple[float, list[float]]:
    engine.generate(prompt, max_new_tokens=4)  # compile and warm up
    runs = [engine.generate(prompt, max_new_tokens=new_tokens).decode_tok_s
            for _ in range(repeats)]
    return statistics.median(runs), runs


def header(args, cfg) -> dict:
    from powerinfer_jax import _cli

    dev = jax.devices()[0]
    return {"experiment": "gpu_hybrid_decode",
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": args.commit or _cli.git_commit(),
            "machine": {**_cli.machine_info(), "gpu": dev.device_kind,
                        "jax": jax.__version__},
            "threads": args.threads, "dtype": args.dtype, "model": f"{args.shapes} (synthetic)",
            "synthetic": "random weights; masks sampled from the profiled activation "
                         f"frequencies of {args.profile}"}


def run_mode(args, cfg, freq, mode: str, frac: float | None) -> dict:
    from powerinfer_jax.ops import _ffi
    from powerinfer_jax.runtime.decode import Engine

    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    sp = SparsityConfig(mode="dense") if mode.endswith("dense") else \
        SparsityConfig(mode="predictor", threshold=0.0)
    m = build(cfg, freq, dtype, args.seed, sp)
    row = {"mode": mode, "budget_ffn_fraction": frac, "init_s": None}
    if mode in ("hybrid", "layers", "layers_dense"):
        p, sizes, place_s = place(m, mode, frac, freq, args.max_seq_len)
        f = cfg.d_ff
        row.update(hot_per_layer=list(p.hot), hot_fraction=sum(p.hot) / (f * cfg.n_layers),
                   served_fraction=p.served_fraction, place_s=place_s,
                   bytes_device=sizes.dense + sum(h * nb for h, nb in zip(p.hot,
                                                                         sizes.neuron_bytes)),
                   bytes_host=_ffi._pij_cuda.cold_store_bytes(), bytes_ffn=sizes.ffn,
                   bytes_dense=sizes.dense)
    row["init_s"] = time.perf_counter() - t0
    eng = Engine(m, max_seq_len=args.max_seq_len)
    prompt = list(range(1, args.prompt_tokens + 1))
    med, runs = decode_tok_s(eng, prompt, args.new_tokens, args.repeats)
    row.update(decode_tok_s=med, decode_runs=runs, new_tokens=args.new_tokens,
               prompt_tokens=args.prompt_tokens)
    if args.overlap and mode == "hybrid":
        row["overlap"] = overlap(m, args, cfg)
    del eng, m
    gc.collect()
    return row


def overlap(m, args, cfg) -> dict:
    """One placed layer's hybrid call: full, hot part only, cold part only (median µs)."""
    from powerinfer_jax.ops import _ffi

    layer = next((l for l in m.layers if l.ffn.cold_handle is not None and l.ffn.n_hot > 0),
                 None)
    if layer is None:
        return {}
    ffn = layer.ffn
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, cfg.d_model)), jnp.float32)
    freq = np.asarray(ffn.selector.predictor.freq[...])
    s = jnp.asarray((rng.random((1, cfg.d_ff)) < freq).astype(np.float32))
    h = ffn.n_hot
    zero = jnp.zeros_like(s)
    cases = {"full": s, "hot_only": s.at[:, h:].set(0.0), "cold_only": s.at[:, :h].set(0.0),
             "none": zero}
    w = (ffn.up.weight[...], ffn.down_t.weight[...], ffn.gate.weight[...])
    fn = jax.jit(lambda x, sc, up, dn, g: _ffi.sparse_ffn_hybrid(
        x, up, dn, w_gate=g, b_up=None, b_down=None, scores=sc[:, :h], scores_cold=sc[:, h:],
        threshold=0.5, activation=ffn.activation, criterion="scores",
        cold_handle=ffn.cold_handle))
    out = {"n_hot": h, "n_cold": ffn.n_cold,
           "active_hot": int(np.asarray(s[:, :h]).sum()),
           "active_cold": int(np.asarray(s[:, h:]).sum())}
    for name, sc in cases.items():
        jax.block_until_ready(fn(x, sc, *w))
        ts = []
        for _ in range(args.overlap_iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, sc, *w))
            ts.append((time.perf_counter() - t0) * 1e6)
        out[f"{name}_us"] = statistics.median(ts)
    parts = out["hot_only_us"] + out["cold_only_us"] - out["none_us"]
    out["sum_of_parts_us"] = parts
    out["overlap_saved_us"] = parts - out["full_us"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.25, 0.5, 1.0],
                    help="VRAM budget beyond the dense parts, as fractions of the FFN bytes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="host pool threads for the cold rows")
    ap.add_argument("--profile", default=None,
                    help="activation profile npz: PATH (a profile.npz: counts / n_tokens, or a "
                         "'frequency' array), PATH:KEY, or a key of the bundled SmolLM2 "
                         "profiles (0.50, 0.80) (default: --profile-target's)")
    ap.add_argument("--profile-target", default="0.50", choices=["0.50", "0.80"],
                    help="the bundled SmolLM2 profile at this calibration target")
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--overlap-iters", type=int, default=50)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "gpu_hybrid.jsonl"))
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("hybrid_decode: expected a GPU backend (this benchmark measures the CUDA hybrid "
                 f"engine), got {jax.default_backend()}")
    from powerinfer_jax.models.ffn import cuda_hybrid_available
    from powerinfer_jax.ops import _ffi

    if not cuda_hybrid_available():
        sys.exit("hybrid_decode: expected the PIJ_CUDA=ON build (see BUILD.md)")
    _ffi.set_num_threads(args.threads)  # the one pool, shared with the CUDA module
    cfg = SHAPES[args.shapes].replace(max_seq_len=args.max_seq_len)
    src, args.profile = synthetic.load_profile(args.profile or args.profile_target)
    freq = synthetic.frequencies(src, cfg)
    head = header(args, cfg)
    head["config"] = {"shapes": args.shapes, "n_layers": cfg.n_layers, "d_model": cfg.d_model,
                      "d_ff": cfg.d_ff, "mean_active_fraction": float(freq.mean()),
                      "profile": args.profile,
                      "profile_target": None if ":target_" not in args.profile
                      else args.profile.rsplit("target_", 1)[1],
                      "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                      "repeats": args.repeats}
    jobs = [(m, None) for m in args.modes if m.startswith("all_gpu")]
    jobs += [(m, b) for b in args.budgets for m in args.modes if not m.startswith("all_gpu")]
    for mode, frac in jobs:
        try:
            row = {**head, **run_mode(args, cfg, freq, mode, frac)}
        except Exception as e:  # one failed configuration must not lose the others' rows
            row = {**head, "mode": mode, "budget_ffn_fraction": frac,
                   "error": f"{type(e).__name__}: {e}"[:2000]}
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        short = {k: row.get(k) for k in ("mode", "budget_ffn_fraction", "decode_tok_s",
                                          "hot_fraction", "served_fraction", "error")}
        print(json.dumps(short), flush=True)
        if "overlap" in row:
            print("overlap", json.dumps(row["overlap"]), flush=True)


if __name__ == "__main__":
    main()
