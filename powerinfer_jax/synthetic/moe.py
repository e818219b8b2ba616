"""`python -m powerinfer_jax.synthetic.moe`: write a SYNTHETIC mixture-of-experts model (random
weights, for speed measurements only) whose routers pick each layer's experts with prescribed
power-law frequencies on text, optionally with ReLU experts whose neurons fire with a prescribed
sparsity inside, as a GGUF llama.cpp reads (arch olmoe or qwen3moe); then measure the routing
frequencies (and the neuron sparsity) on held-out text with the engine.

    python -m powerinfer_jax.synthetic.moe --shape olmoe-1b-7b --out DIR [--seed 0]
        [--hot-fraction 0.25 --hot-share 0.8] [--activation relu --sparsity 0.9]
        [--qtype Q4_0] [--calib-tokens 4096] [--verify-tokens 512]
        [--n-layers ... --n-experts ... --top-k ... (any field of the shape)]

How the router is set: moe_build.py. Text: synthetic/text.py (wiki.train through SmolLM2's
tokenizer, padded to the shape's vocabulary). Files in DIR: <stem>.gguf, frequencies.npz
(prescribed, calibrated, measured routing [L, E]) and synthetic.json (what was built, how long
it took, the per-decile routing check).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from powerinfer_jax import _cli, ops
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.checkpoint.gguf import tokenizer_metadata
from powerinfer_jax.errors import check, fail
from powerinfer_jax.models.transformer import capture, from_params
from powerinfer_jax.synthetic.moe_build import (SHAPES, MoeSpec, build, config_for,
                                                expert_locality, routing_frequencies)
from powerinfer_jax.synthetic.profile import Locality, decile_errors, hot_share
from powerinfer_jax.synthetic.text import (TOKENIZER_MODEL, add_shape_flags,
                                          calibration_and_held_out, load_tokenizer,
                                          shape_fields)
from powerinfer_jax.synthetic.write import MoeSink

QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16")
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "n_experts", "vocab_size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.synthetic.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, SHAPES, SHAPE_FIELDS, "olmoe-1b-7b")
    p.add_argument("--top-k", type=int, default=None, help="experts routed per token")
    p.add_argument("--hot-fraction", type=float, default=0.25,
                   help="the hot experts' share of a layer's experts")
    p.add_argument("--hot-share", type=float, default=None,
                   help="share of routings to the hot experts (default 0.8, or 95%% of the "
                        "most the cap allows)")
    p.add_argument("--activation", choices=("silu", "relu"), default="silu",
                   help="the experts' (relu: sparse inside, --sparsity)")
    p.add_argument("--sparsity", type=float, default=None,
                   help="relu: 1 - the mean firing frequency of an expert's neurons on its "
                        "tokens, in (0, 1)")
    p.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib-text", default=None, metavar="FILE",
                   help="training text the frequencies are set on (default: the project's "
                        "corpus, ../shared/data/wiki.train.txt)")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--verify-tokens", type=int, default=512,
                   help="held-out tokens the engine measures the routing on (0: skip)")
    p.add_argument("--tokenizer", default=TOKENIZER_MODEL, metavar="GGUF")
    p.add_argument("--verify-only", action=argparse.BooleanOptionalAction, default=False,
                   help="measure the file this command wrote before (same flags)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="output directory")
    return p


def spec_from_args(args, tokenizer) -> tuple[str, MoeSpec]:
    fields = shape_fields(args, SHAPES, SHAPE_FIELDS)
    if args.top_k is not None:
        fields["n_experts_used"] = args.top_k
    arch, config = config_for(fields, vocab_size=tokenizer.vocab_size,
                              activation=args.activation, bos=tokenizer.bos_id,
                              eos=tokenizer.eos_ids)
    neurons = None
    if args.activation == "relu":
        check(args.sparsity is not None, "--sparsity", "a number in (0, 1) with --activation relu",
              None)
        neurons = Locality.feasible(args.sparsity)
    elif args.sparsity is not None:
        fail("--sparsity", "only with --activation relu (SiLU experts are dense inside)",
             args.sparsity)
    return arch, MoeSpec(config, expert_locality(config, args.hot_fraction, args.hot_share),
                         neurons, seed=args.seed, qtype=args.qtype)


def verify(path: Path, ids: np.ndarray, prescribed: np.ndarray, log) -> tuple[dict, np.ndarray]:
    """Routing frequencies [L, E] measured by the engine on the GGUF (its quantized blocks and
    8-bit activations, as decode computes) over held-out token ids; for ReLU experts, the share
    of a routed expert's neurons that fire."""
    ckpt = load_checkpoint(path, keep_quantized=True)
    c = ckpt.config
    model = from_params(c, ckpt.params, dtype=jnp.float32, kernels="auto")
    log(f"verify: forward over {ids.size} held-out tokens")
    counts = np.zeros((c.n_layers, c.n_experts))
    xs, routes = [], []
    for chunk in ids:
        _, sown = capture(lambda m, t: m(t), model, jnp.asarray(chunk[None]))
        routed = np.asarray(sown["expert_ids"]).reshape(c.n_layers, -1, c.n_experts_used)
        for layer in range(c.n_layers):
            counts[layer] += np.bincount(routed[layer].ravel(), minlength=c.n_experts)
        if c.activation == "relu":
            xs.append(np.asarray(sown["ffn_in"]).reshape(c.n_layers, -1, c.d_model))
            routes.append(routed)
    fired = total = 0
    if xs:  # relu: each routed expert's gate on its tokens, one layer's gate at a time
        x, routed = np.concatenate(xs, axis=1), np.concatenate(routes, axis=1)
        for layer in range(c.n_layers):
            gate = ckpt.params[f"layers.{layer}.ffn.experts.gate.weight"].dequantize()
            for e in range(c.n_experts):
                tokens = np.nonzero((routed[layer] == e).any(axis=1))[0]
                pre = x[layer, tokens] @ gate[e].T  # [n_e, F]
                fired += int((pre > 0).sum())
                total += pre.size
    measured = counts / ids.size
    out = {"tokens": int(ids.size), "deciles": decile_errors(prescribed, measured),
           "hot_share_measured": float(np.mean([hot_share(m, 0.25) for m in measured])),
           "hot_share_prescribed": float(np.mean([hot_share(m, 0.25) for m in prescribed]))}
    out["max_decile_error"] = max(abs(d["relative_error"]) for d in out["deciles"])
    if total:
        out["neuron_sparsity"] = 1.0 - fired / total
    return out, measured


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        ops.set_num_threads(args.threads)
    tokenizer, tok_path = load_tokenizer(args.tokenizer)
    arch, spec = spec_from_args(args, tokenizer)
    c = spec.config
    calib, held = calibration_and_held_out(args, tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    act = "silu" if spec.neurons is None else f"relu-s{spec.neurons.sparsity:g}"
    stem = (f"synthetic-{args.shape}-e{c.n_experts}k{c.n_experts_used}-h"
            f"{spec.experts.hot_share:.2g}-{act}-{args.qtype}")
    path = out / f"{stem}.gguf"

    def log(msg):
        print(f"synthetic-moe: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    kept = {}
    routed = []
    fired = []
    if args.verify_only:
        if not path.is_file():
            fail("--verify-only", "the file a build with these flags wrote", str(path),
                 "run without --verify-only first")
        prescribed = routing_frequencies(spec)
        build_s = None
        if (out / "synthetic.json").is_file():  # the build's record: kept, the check redone
            before = json.loads((out / "synthetic.json").read_text())
            build_s = before.get("build_s")
            kept = {k: before[k] for k in ("calibrated_deciles", "calibrated_neuron_sparsity")
                    if before.get(k) is not None}
    else:
        sink = MoeSink(path, c, arch, args.qtype, tokenizer_metadata(tok_path),
                       name=f"powerinfer_jax SYNTHETIC {stem} (random weights, seed {args.seed})")

        def on_layer(i, layer):
            routed.append(layer.routed)
            if layer.fired is not None:
                fired.append(float((layer.fired.mean(axis=1) * layer.routed).sum()
                                   / layer.routed.sum()))
            sink.on_layer(i, layer)

        prescribed = build(spec, calib, on_global=sink.write, on_layer=on_layer, progress=log)
        sink.close()
        build_s = round(time.perf_counter() - t0, 1)
        log(f"wrote {path} in {build_s:.0f} s")
    record = {"synthetic": "random weights: for speed measurements only",
              "command": "python -m powerinfer_jax.synthetic.moe " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "commit": _cli.git_commit(), "machine": _cli.machine_info(), "arch": arch,
              "config": {k: getattr(c, k) for k in ("vocab_size", "d_model", "n_layers",
                                                     "n_heads", "n_kv_heads", "head_dim",
                                                     "d_ff", "n_experts", "n_experts_used",
                                                     "norm_topk_prob", "activation")},
              "hot_fraction": spec.experts.hot_fraction, "hot_share": spec.experts.hot_share,
              "neuron_sparsity": None if spec.neurons is None else spec.neurons.sparsity,
              "qtype": args.qtype, "seed": args.seed, "calib_tokens": int(calib.size),
              "build_s": build_s, "file": str(path),
              "calibrated_neuron_sparsity": 1 - float(np.mean(fired)) if fired else None}
    record.update(kept)
    if routed:
        record["calibrated_deciles"] = decile_errors(prescribed, np.stack(routed))
    measured = np.zeros_like(prescribed)
    if held is not None:
        check_, measured = verify(path, held, prescribed, log)
        record["verify"] = check_
        log(f"held-out routing: hot share {check_['hot_share_measured']:.3f} (prescribed "
            f"{check_['hot_share_prescribed']:.3f}); largest decile error "
            f"{check_['max_decile_error']:.3f}"
            + (f"; neuron sparsity {check_['neuron_sparsity']:.3f}"
               if "neuron_sparsity" in check_ else ""))
    np.savez_compressed(out / "frequencies.npz", prescribed=prescribed,
                        calibrated=np.stack(routed) if routed else np.zeros_like(prescribed),
                        measured=measured)
    (out / "synthetic.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("file", "build_s")}
                     | ({"verify": {k: v for k, v in record["verify"].items() if k != "deciles"}}
                        if "verify" in record else {})))


if __name__ == "__main__":
    _cli.run_main(main)
