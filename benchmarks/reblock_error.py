"""What re-blocking the FFN down rows costs in quality, to pick the format for ops.qsparse_ffn.

GGUF stores ffn_down [D, F] blocked along F; the quantized sparse FFN reads one neuron's down row
(down_t[i], D values), so the rows are re-blocked along D at load: dequantize, then quantize each
down_t row (`QuantTensor.reblocked`). That adds a second rounding on top of the file's. Measured
on the real model (default: the registry's SmolLM2-135M Q4_1 file):
  1. per layer, the FFN output's relative error (||y' - y|| / ||y||) on real FFN inputs from
     wiki.train (the dense model's own, `sparsity.profile.collect_ffn_inputs`), float math, only
     the down rows changed; next to it the error of the whole quantized path the kernel computes
     (the file's gate/up with int8-rounded activations, `ops.qsparse_ffn`'s reference) with the
     file's own down rows, as a yardstick;
  2. perplexity on wiki.valid (ctx 512, 16 chunks, float32 dense model) with every layer's down
     rows replaced by their re-blocked values.
Q4_K needs rows of a multiple of 256 values: SmolLM2's D = 576 cannot be re-blocked to it.

    nice -n 10 python benchmarks/reblock_error.py --out benchmarks/reblock_error.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from powerinfer_jax import _cli

FORMATS = ("Q8_0", "Q5_1", "Q4_1", "Q4_0", "Q4_K")


def _ffn_float(x, gate, up, down_t):
    return (x @ gate.T / (1 + np.exp(-(x @ gate.T)))) * (x @ up.T) @ down_t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--train", default="../shared/data/wiki.train.txt")
    ap.add_argument("--valid", default="../shared/data/wiki.valid.txt")
    ap.add_argument("--tokens", type=int, default=2048, help="FFN inputs per layer for part 1")
    ap.add_argument("--ppl-chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/reblock_error.jsonl")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from powerinfer_jax import ops
    from powerinfer_jax.checkpoint import load_checkpoint, quants
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.runtime.perplexity import chunk_tokens, perplexity
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity.profile import collect_ffn_inputs

    ops.set_num_threads(args.threads)
    ck = load_checkpoint(args.model)
    kept = load_checkpoint(args.model, keep_quantized=True).params
    c = ck.config
    base = dict(bench="reblock_error", model=args.model, commit=_cli.git_commit(),
                machine=_cli.machine_info()["cpu"],
                threads=args.threads, shared_machine="other work shared the machine (nice -n 10)")
    rows = []
    formats = [f for f in FORMATS if c.d_model % quants.block_size(f)[0] == 0]
    skipped = [f for f in FORMATS if f not in formats]

    # 1. Per-layer FFN output error on real inputs.
    model = from_params(c, ck.params)
    ids = ck.tokenizer.encode(Path(args.train).read_text(encoding="utf-8")[:200_000], add_bos=False)
    chunks = chunk_tokens(ids, 512, max(1, args.tokens // 512))
    x_lnd = collect_ffn_inputs(model, chunks, progress=False)  # [L, N, D]
    per_layer = {f: [] for f in formats}
    kernel_path = []
    for layer in range(c.n_layers):
        p = f"layers.{layer}.ffn."
        gate, up, down_t = (ck.params[p + n + ".weight"] for n in ("gate", "up", "down_t"))
        x = x_lnd[layer].astype(np.float32)
        y = _ffn_float(x, gate, up, down_t)
        norm = float(np.linalg.norm(y))
        for f in formats:
            rb = kept[p + "down_t.weight"].reblocked(f).dequantize()
            per_layer[f].append(float(np.linalg.norm(_ffn_float(x, gate, up, rb) - y)) / norm)
        g, u, dn = kept[p + "gate.weight"], kept[p + "up.weight"], kept[p + "down_t.weight"]
        own = dn.reblocked("Q8_0")  # the kernel needs rows along D; Q8_0's error is reported above
        yk, _ = ops.qsparse_ffn(jnp.asarray(x[:512]), u.blocks, own.blocks, up_qtype=u.qtype,
                                down_qtype="Q8_0", gate=g.blocks, gate_qtype=g.qtype,
                                threshold=0.0, impl="reference")
        y_own = _ffn_float(x[:512], gate, up, own.dequantize())
        kernel_path.append(float(np.linalg.norm(np.asarray(yk) - y_own)
                                 / np.linalg.norm(y_own)))
    for f in formats:
        e = np.asarray(per_layer[f])
        rows.append({**base, "part": "ffn_output_error", "down_format": f,
                     "source_type": kept["layers.0.ffn.down_t.weight"].qtype,
                     "tokens_per_layer": int(x_lnd.shape[1]), "rel_err_mean": float(e.mean()),
                     "rel_err_max": float(e.max()), "rel_err_per_layer": e.round(6).tolist()})
    k = np.asarray(kernel_path)
    rows.append({**base, "part": "ffn_output_error", "down_format": "(yardstick) int8-rounded "
                 "activations through the file's gate/up", "rel_err_mean": float(k.mean()),
                 "rel_err_max": float(k.max()), "rel_err_per_layer": k.round(6).tolist()})
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "rel_err_per_layer"}), flush=True)

    # 2. Perplexity with every layer's down rows re-blocked.
    valid_ids = ck.tokenizer.encode(Path(args.valid).read_text(encoding="utf-8"), add_bos=False)
    for f in ["file"] + formats:
        params = dict(ck.params)
        if f != "file":
            for layer in range(c.n_layers):
                name = f"layers.{layer}.ffn.down_t.weight"
                params[name] = kept[name].reblocked(f).dequantize()
        t0 = time.time()
        res = perplexity(from_params(c, params), valid_ids, ctx=512, max_chunks=args.ppl_chunks,
                         sparsity=SparsityConfig())
        row = {**base, "part": "perplexity", "down_format": f, "ctx": 512,
               "chunks": res["chunks"], "ppl": res["ppl"], "seconds": time.time() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if skipped:
        rows.append({**base, "part": "skipped", "formats": skipped,
                     "reason": f"D = {c.d_model} is not a multiple of their block size"})
    with open(args.out, "a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
