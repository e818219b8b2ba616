"""A SYNTHETIC stock SwiGLU llama GGUF of a real model's shape (random weights), for the speed of
input sparsity (benchmarks/stock_sparsity.py): Llama-3-8B's or Mistral-7B's shape, every matrix
as random valid blocks of one format, written one tensor at a time (the 4.6 GB Q4_0 file never
sits in memory). The vocabulary is SmolLM2's tokenizer padded to the shape's size, so the LM head
and embedding are the shape's. The scales make each matrix's rows about unit-variance on a
unit-variance input, so activations stay finite through the layers and thresholds calibrate to
their targets; speed does not depend on the weights' values (say "synthetic" with any figure).
A Q4_K_M file is made from it by llama.cpp's llama-quantize (--allow-requantize).

    python -m benchmarks.swiglu_synthetic --shape llama3-8b --out /path/llama3-8b-q4_0.gguf
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint import quants
from powerinfer_jax.checkpoint.gguf import tokenizer_metadata
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.synthetic.write import GGUFStream, file_type, gguf_plan, padded_tokenizer

SHAPES = {  # the public configs' shapes (vocabulary: the shape's size, SmolLM2's tokens padded)
    "llama3-8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                      d_ff=14336, vocab_size=128256, rope_theta=500000.0),
    "mistral-7b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       d_ff=14336, vocab_size=32768, rope_theta=1000000.0),
}
QTYPES = ("Q4_0", "Q4_1", "Q8_0")


def config(shape: str, *, n_layers: int | None, bos, eos) -> ModelConfig:
    fields = dict(SHAPES[shape])
    if n_layers is not None:
        fields["n_layers"] = n_layers
    return ModelConfig(arch="llama", activation="silu", gated=True, bias=False, norm="rms",
                       norm_eps=1e-5, positions="rope", tie_embeddings=False, max_seq_len=4096,
                       bos_token_id=bos, eos_token_ids=eos, **fields)


def random_blocks(shape: tuple[int, int], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random codes with one f16 scale (minimum for Q4_1) per block: rows of ~unit variance on a
    unit-variance input (a code's spread times the scale is ~ 1 / sqrt(columns))."""
    rows, cols = shape
    block, nbytes = quants.block_size(qtype)
    if qtype == "Q4_0":  # both nibbles in [1, 15]: codes - 8 of mean 0 (a mean would add one
        # shared component to every row, and through the layers make all activations alike)
        lo = rng.integers(1, 16, size=(rows, cols // block, nbytes), dtype=np.uint8)
        b = lo | (rng.integers(1, 16, size=lo.shape, dtype=np.uint8) << 4)
    elif qtype == "Q8_0":  # int8 codes in [-127, 127]
        b = rng.integers(-127, 128, size=(rows, cols // block, nbytes)).astype(np.int8).view(
            np.uint8)
    else:  # Q4_1: codes in [0, 15] with the minimum at -7.5 scales: mean 0
        b = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    spread = {"Q4_0": 4.3, "Q4_1": 4.6, "Q8_0": 73.0}[qtype]  # std of the codes
    b[:, :, 0:2] = np.frombuffer(np.float16(1.0 / (spread * np.sqrt(cols))).tobytes(), np.uint8)
    if qtype == "Q4_1":
        b[:, :, 2:4] = np.frombuffer(np.float16(-7.5 / (spread * np.sqrt(cols))).tobytes(),
                                     np.uint8)
    return b.reshape(rows, -1)


def write(shape: str, qtype: str, out: Path, *, n_layers: int | None = None, seed: int = 0,
          tokenizer: str = "smollm2-135m") -> Path:
    from powerinfer_jax.checkpoint import registry  # lazy: the default model's file

    tok_path = registry.resolve_model(tokenizer)
    meta = tokenizer_metadata(tok_path)
    c = config(shape, n_layers=n_layers, bos=meta.get("bos_token_id"),
               eos=tuple(x for x in [meta.get("eos_token_id")] if x is not None))
    plan = gguf_plan(c, qtype, powerinfer=False, rank=0)
    stream = GGUFStream(out, c, plan, padded_tokenizer(meta, c.vocab_size),
                        name=f"synthetic {shape} swiglu", powerinfer=False,
                        file_type=file_type(qtype))
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for name, (shp, typ) in plan.items():
        if typ == "F32":
            stream.write(name, np.ones(shp, np.float32))
        else:
            stream.write(name, None, blocks=random_blocks(shp, typ, rng))
    path = stream.close()
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, synthetic) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    write(args.shape, args.qtype, Path(args.out), n_layers=args.layers, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
