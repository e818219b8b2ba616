"""The synthetic models the GPU benchmarks run: shapes, activation frequencies, and a GGUF writer.

No checkpoint can reach the GPU machine, so the benchmarks run real shapes with random weights:
  SHAPES           Llama-2-7B's and SmolLM2-135M's shapes
  frequencies      per-layer neuron activation frequencies [L, F] mapped onto a shape from any
                   profile npz: `python -m powerinfer_jax.calibrate`'s / a sparsified model's
                   `sparsity/target_*/profile.npz` (counts / n_tokens), an npz holding a
                   `frequency` array, or a bundle of several (smollm2_frequency.npz: one
                   [L, F] array per key, picked with PATH:KEY)
  write_gguf       a llama-architecture GGUF of a shape with random BF16/F16/F32 weights, written
                   one tensor at a time (a 7B model never sits in memory: ~13.5 GB at BF16), for
                   llama.cpp's side of the comparison; llama.cpp's speed does not depend on the
                   weights' values

    python -m benchmarks.gpu.synthetic --shapes llama2-7b --dtype bf16 --out /tmp/llama2-7b.gguf
"""
from __future__ import annotations

import argparse
import re
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from powerinfer_jax.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]

SHAPES = {
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30,
                                n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, max_seq_len=256,
                                activation="silu", rope_theta=100000.0, tie_embeddings=True),
    "llama2-7b": ModelConfig(arch="llama", vocab_size=32000, d_model=4096, n_layers=32,
                             n_heads=32, n_kv_heads=32, head_dim=128, d_ff=11008,
                             max_seq_len=256, activation="silu"),
}
BUNDLED_PROFILE = Path(__file__).with_name("smollm2_frequency.npz")
GGUF_DTYPES = ("bf16", "f16", "f32")


# ------------------------------------------------------------------------------ profiles
def load_profile(spec: str) -> tuple[np.ndarray, str]:
    """[L, F] frequencies from PATH or PATH:KEY (see the module docstring) and a label for
    result rows. A bare key ("0.50", "target_0.80") names one of the bundled SmolLM2 profiles."""
    if Path(spec).is_file():
        path, key = spec, ""
    elif ":" in spec and Path(spec.rsplit(":", 1)[0]).is_file():
        path, key = spec.rsplit(":", 1)
    else:  # a key of the bundled SmolLM2 profiles
        path, key = str(BUNDLED_PROFILE), spec
    if re.fullmatch(r"\d+(\.\d+)?", key):
        key = f"target_{key}"
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"--profile: expected an npz file (PATH or PATH:KEY), got {spec!r}")
    with np.load(p) as z:
        if key:
            if key not in z:
                raise SystemExit(f"--profile {spec}: expected a key in {sorted(z)}, got {key!r}")
            freq = z[key]
        elif "counts" in z and "n_tokens" in z:  # sparsity/profile.py's ActivationProfile
            freq = z["counts"] / max(int(z["n_tokens"]), 1)
        elif "frequency" in z:
            freq = z["frequency"]
        else:
            raise SystemExit(f"--profile {spec}: expected 'counts' and 'n_tokens' (a profile.npz),"
                             f" 'frequency', or PATH:KEY with a key in {sorted(z)}")
    freq = np.asarray(freq, np.float64)
    if freq.ndim != 2 or not np.all(np.isfinite(freq)) or freq.min() < 0 or freq.max() > 1:
        raise SystemExit(f"--profile {spec}: expected [layers, neurons] frequencies in [0, 1], "
                         f"got shape {freq.shape}")
    label = f"{p.name}:{key}" if key else str(p)
    return freq, label


def frequencies(src: np.ndarray, cfg: ModelConfig, seed: int = 0) -> np.ndarray:
    """[L, F] frequencies for `cfg` from a profile [L_src, F_src]: as is when the shapes match;
    otherwise layer l takes the source layer at the same relative depth, its sorted frequencies
    resampled to F neurons and assigned to neurons in a random order (seeded)."""
    if src.shape == (cfg.n_layers, cfg.d_ff):
        return src.astype(np.float64)
    rng = np.random.default_rng(seed)
    out = np.empty((cfg.n_layers, cfg.d_ff))
    for l in range(cfg.n_layers):
        s = np.sort(src[round(l * (src.shape[0] - 1) / max(1, cfg.n_layers - 1))])[::-1]
        q = np.interp(np.linspace(0, 1, cfg.d_ff), np.linspace(0, 1, s.size), s)
        out[l] = q[rng.permutation(cfg.d_ff)]
    return out


# ------------------------------------------------------------------------------ GGUF
def tensor_plan(cfg: ModelConfig, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape [rows, cols], GGUF type) of every tensor, in file order."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    t = dtype.upper()
    out = [("token_embd.weight", (v, d), t)]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), "F32"),
                (b + "attn_q.weight", (cfg.q_dim, d), t), (b + "attn_k.weight", (cfg.kv_dim, d), t),
                (b + "attn_v.weight", (cfg.kv_dim, d), t),
                (b + "attn_output.weight", (d, cfg.q_dim), t),
                (b + "ffn_norm.weight", (d,), "F32"),
                (b + "ffn_gate.weight", (f, d), t), (b + "ffn_up.weight", (f, d), t),
                (b + "ffn_down.weight", (d, f), t)]
    out.append(("output_norm.weight", (d,), "F32"))
    if not cfg.tie_embeddings:
        out.append(("output.weight", (v, d), t))
    return out


def tensor_values(name: str, shape: tuple[int, ...], gguf_type: str, seed: int) -> np.ndarray:
    """Deterministic random values of one tensor (seed and name): norms near 1 (float32),
    matrices as the bits of BF16/F16 numbers of magnitude in [2^-7, 2^-5) with random signs and
    mantissas (no zeros, subnormals, infinities or NaNs), or such float32 numbers for F32."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape))
    if len(shape) == 1:
        return (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32).reshape(shape)
    r = np.frombuffer(rng.bytes(2 * n), np.uint16)
    if gguf_type == "BF16":  # sign | exponent 0x78 or 0x79 | 7 mantissa bits
        bits = (r & np.uint16(0x80FF)) | np.uint16(0x3C00)
    elif gguf_type == "F16":  # sign | exponent 8 or 9 (bias 15) | 10 mantissa bits
        bits = (r & np.uint16(0x87FF)) | np.uint16(0x2000)
    else:  # the BF16 numbers widened exactly (a bfloat16 is the high half of a float32)
        bf16 = (r & np.uint16(0x80FF)) | np.uint16(0x3C00)
        return (bf16.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return bits.reshape(shape)


def _spm_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style ("llama") vocabulary of n tokens: <unk> <s> </s>, the 256 byte
    tokens, then distinct filler pieces."""
    if n < 259 + 1:
        raise SystemExit(f"vocab_size: expected at least 260 for a llama vocabulary, got {n}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (n - 259)
    return tokens, scores, types


def write_gguf(path, cfg: ModelConfig, *, dtype: str = "bf16", seed: int = 0,
               progress: bool = False) -> dict:
    """Write `cfg` as a llama GGUF with random weights, one tensor in memory at a time.
    Returns {"path", "bytes", "tensor_bytes": {name: bytes}, "seconds"}."""
    import gguf

    if dtype not in GGUF_DTYPES:
        raise SystemExit(f"--dtype: expected one of {list(GGUF_DTYPES)}, got {dtype!r}")
    if cfg.arch != "llama" or cfg.bias or not cfg.gated:
        raise SystemExit(f"write_gguf: expected a llama-family shape, got arch={cfg.arch!r}")
    t0 = time.perf_counter()
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"powerinfer_jax synthetic {cfg.n_layers}x{cfg.d_model} (random weights)")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "f32": gguf.LlamaFileType.ALL_F32}[dtype])
    tokens, scores, types = _spm_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    plan = tensor_plan(cfg, dtype)
    sizes = {}
    for name, shape, t in plan:
        itemsize = 4 if t == "F32" else 2
        nbytes = int(np.prod(shape)) * itemsize
        raw = {"BF16": gguf.GGMLQuantizationType.BF16}.get(t)
        np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[t]
        w.add_tensor_info(name, shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)
        sizes[name] = nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    done = 0
    for k, (name, shape, t) in enumerate(plan):
        values = tensor_values(name, shape, t, seed)
        if t == "F16":
            values = values.view(np.float16)
        w.write_tensor_data(values)
        done += values.nbytes
        if progress and (k % 20 == 0 or k == len(plan) - 1):
            print(f"synthetic gguf: {done / 2**30:.2f} GiB, {k + 1}/{len(plan)} tensors",
                  file=sys.stderr, flush=True)
    w.close()
    tmp.replace(path)
    return {"path": str(path), "bytes": path.stat().st_size, "tensor_bytes": sizes,
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Write a synthetic llama GGUF (random weights).")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--dtype", choices=GGUF_DTYPES, default="bf16")
    ap.add_argument("--max-seq-len", type=int, default=None, help="context_length in the file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shapes]
    if args.max_seq_len:
        cfg = cfg.replace(max_seq_len=args.max_seq_len)
    info = write_gguf(args.out, cfg, dtype=args.dtype, seed=args.seed, progress=True)
    print(f"{info['path']}: {info['bytes'] / 2**30:.2f} GiB in {info['seconds']:.0f} s")


if __name__ == "__main__":
    main()
