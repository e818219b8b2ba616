"""`python -m powerinfer_jax.synthetic`: write a SYNTHETIC sparse llama model (random weights,
for speed measurements only) whose FFN neurons fire with prescribed frequencies on text, with
exact low-rank predictors, as a llama GGUF, a PowerInfer GGUF and an HF directory; then measure
the frequencies and the predictors' recall on held-out text with the engine.

    python -m powerinfer_jax.synthetic --shape llama2-7b --sparsity 0.9 --out DIR
        [--formats gguf,powerinfer,hf] [--qtype Q4_0] [--activation relu|drelu] [--rank 63]
        [--hot-fraction 0.25 --hot-share 0.8] [--seed 0] [--calib-tokens 2048]
        [--verify-tokens 512] [--d-model ... --n-layers ... (any llama shape)]

The model's vocabulary and tokenizer are SmolLM2's (the default model's GGUF): text is real text
to both llama.cpp and PowerInfer. Files in DIR: <stem>.gguf, <stem>.powerinfer.gguf, hf/,
frequencies.npz (prescribed, calibrated, measured [L, F]) and synthetic.json (what was built,
how long it took, the per-decile frequency check and the predictors' recall).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from powerinfer_jax import _cli, ops
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.checkpoint.gguf import tokenizer_metadata
from powerinfer_jax.checkpoint.powerinfer import load_predictors
from powerinfer_jax.errors import fail
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.sparsity import profile
from powerinfer_jax.synthetic.build import SHAPES, Spec, build, config_for
from powerinfer_jax.synthetic.profile import (Locality, decile_errors, hot_share,
                                             layer_frequencies)
from powerinfer_jax.synthetic.text import (TOKENIZER_MODEL, add_shape_flags,
                                          calibration_and_held_out, load_tokenizer,
                                          shape_fields)
from powerinfer_jax.synthetic.write import Sinks

FORMATS = ("gguf", "powerinfer", "hf")
QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, SHAPES, SHAPE_FIELDS, "llama2-7b")
    p.add_argument("--sparsity", type=float, required=True,
                   help="1 - the mean firing frequency of a layer's neurons, in (0, 1)")
    p.add_argument("--hot-fraction", type=float, default=0.25)
    p.add_argument("--hot-share", type=float, default=None,
                   help="share of activations in the top --hot-fraction of neurons (default 0.8, "
                        "or 95%% of the most a low sparsity allows)")
    p.add_argument("--activation", choices=("relu", "drelu"), default="relu")
    p.add_argument("--rank", type=int, default=63, help="the gate's low rank R (predictors: "
                                                       "hidden size 2 (R + 1))")
    p.add_argument("--qtype", choices=QTYPES, default="Q4_0")
    p.add_argument("--formats", default="gguf,powerinfer,hf",
                   help=f"comma-separated subset of {','.join(FORMATS)}")
    p.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib-text", default=None, metavar="FILE",
                   help="training text the frequencies are set on (default: the project's "
                        "corpus, ../shared/data/wiki.train.txt)")
    p.add_argument("--calib-tokens", type=int, default=2048,
                   help="wiki.train tokens the frequencies are set on")
    p.add_argument("--verify-tokens", type=int, default=512,
                   help="held-out tokens the engine measures them on (0: skip)")
    p.add_argument("--tokenizer", default=TOKENIZER_MODEL, metavar="GGUF",
                   help="a GGUF whose tokenizer the model takes (default: the registry's "
                        "SmolLM2, whose vocabulary llama.cpp and PowerInfer both read)")
    p.add_argument("--verify-only", action=argparse.BooleanOptionalAction, default=False,
                   help="measure files this command wrote before (same flags) without building")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="output directory")
    return p


def _formats(spec: str) -> tuple[str, ...]:
    got = tuple(s.strip() for s in spec.split(",") if s.strip())
    bad = [s for s in got if s not in FORMATS]
    if not got or bad:
        fail("--formats", f"a comma-separated subset of {list(FORMATS)}", spec)
    return got


def verify(model_path: Path, powerinfer_path: Path | None, ids: np.ndarray, prescribed,
           log) -> tuple[dict, np.ndarray]:
    """Measure each neuron's firing frequency with the engine on the llama GGUF (its quantized
    blocks and 8-bit activations, as decode computes) and, where the PowerInfer GGUF exists,
    its predictors' recall and precision against the true active sets."""
    import jax.numpy as jnp

    ckpt = load_checkpoint(model_path, keep_quantized=True)
    model = from_params(ckpt.config, ckpt.params, dtype=jnp.float32, kernels="auto")
    log(f"verify: dense forward over {ids.size} held-out tokens")
    x = profile.collect_ffn_inputs(model, ids, progress=False)  # [L, N, D]
    prof = profile.profile_activations(model, x, progress=False)
    measured = prof.frequency
    out = {"tokens": int(ids.size), "sparsity": float(1 - measured.mean()),
           "deciles": decile_errors(prescribed, measured),
           "hot_share_measured": float(np.mean([hot_share(m, 0.25) for m in measured]))}
    out["max_decile_error"] = max(abs(d["relative_error"]) for d in out["deciles"])
    if powerinfer_path is not None:
        preds = load_predictors(powerinfer_path, ckpt.config)
        masks = profile.active_masks(model, x, np.zeros(ckpt.config.n_layers), progress=False)
        tp = fn = fp = 0
        for l in range(ckpt.config.n_layers):
            # the residual before ffn_norm is x * rms / scale; with unit norm scales (as built)
            # a positive multiple of x: the predictor's sign is the same on either
            h = np.maximum(x[l] @ np.asarray(preds.fc1[l], np.float32).T, 0.0)
            pred = h @ np.asarray(preds.fc2[l], np.float32).T >= preds.threshold
            tp += int((pred & masks[l]).sum())
            fn += int((~pred & masks[l]).sum())
            fp += int((pred & ~masks[l]).sum())
        out["predictor"] = {"recall": tp / max(tp + fn, 1), "precision": tp / max(tp + fp, 1),
                            "predicted_active": (tp + fp) / masks.size,
                            "form": "the PowerInfer GGUF's fc1/fc2 (dequantized), float32"}
    return out, measured


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    formats = _formats(args.formats)
    if args.threads:
        ops.set_num_threads(args.threads)

    tokenizer, tok_path = load_tokenizer(args.tokenizer)
    fields = shape_fields(args, SHAPES, SHAPE_FIELDS)
    config = config_for(fields, vocab_size=tokenizer.vocab_size, activation=args.activation,
                        bos=tokenizer.bos_id, eos=tokenizer.eos_ids)
    if args.hot_share is None:
        locality = Locality.feasible(args.sparsity, args.hot_fraction)
    else:
        locality = Locality(args.sparsity, args.hot_fraction, args.hot_share)
    spec = Spec(config, locality, rank=args.rank, seed=args.seed, qtype=args.qtype)

    calib, held = calibration_and_held_out(args, tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"synthetic-{args.shape}-{args.activation}-s{args.sparsity:g}-{args.qtype}"
    paths = {"gguf": out / f"{stem}.gguf", "powerinfer": out / f"{stem}.powerinfer.gguf",
             "hf": out / "hf"}

    def log(msg):
        print(f"synthetic: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    calibrated = []
    if args.verify_only:  # the same flags give the same prescription (seeded)
        for k in formats:
            if not paths[k].exists():
                fail("--verify-only", f"the files a build with these flags wrote", str(paths[k]),
                     "run without --verify-only first")
        prescribed = layer_frequencies(config.n_layers, config.d_ff, locality, args.seed)
        build_s = None
    else:
        sinks = Sinks(config, args.qtype, args.rank,
                      gguf_path=paths["gguf"] if "gguf" in formats else None,
                      powerinfer_path=paths["powerinfer"] if "powerinfer" in formats else None,
                      hf_dir=paths["hf"] if "hf" in formats else None, tokenizer=tokenizer,
                      tokenizer_meta=tokenizer_metadata(tok_path), hf_dtype=args.hf_dtype,
                      name=f"powerinfer_jax SYNTHETIC {stem} (random weights, seed {args.seed})")
        prescribed = build(spec, calib, on_global=sinks.on_global,
                           on_layer=lambda i, layer: (calibrated.append(layer.calibrated),
                                                      sinks.on_layer(i, layer)),
                           progress=log)
        written = sinks.close()
        build_s = round(time.perf_counter() - t0, 1)
        log(f"wrote {', '.join(str(p) for p in written)} in {build_s:.0f} s")
    record = {"synthetic": "random weights: for speed measurements only",
              "command": "python -m powerinfer_jax.synthetic " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "commit": _cli.git_commit(), "machine": _cli.machine_info(),
              "config": {k: getattr(config, k) for k in ("vocab_size", "d_model", "n_layers",
                                                          "n_heads", "n_kv_heads", "head_dim",
                                                          "d_ff", "activation")},
              "sparsity": args.sparsity, "hot_fraction": locality.hot_fraction,
              "hot_share": locality.hot_share, "rank": args.rank, "qtype": args.qtype,
              "seed": args.seed, "calib_tokens": int(calib.size), "build_s": build_s,
              "files": {k: str(paths[k]) for k in formats},
              "calibrated_sparsity": float(1 - np.mean(calibrated)) if calibrated else None}
    measured = np.zeros_like(prescribed)
    if held is not None and "gguf" in formats:
        check, measured = verify(paths["gguf"], paths["powerinfer"] if "powerinfer" in formats
                                 else None, held, prescribed, log)
        record["verify"] = check
        log(f"held-out sparsity {check['sparsity']:.4f} (prescribed {args.sparsity}); largest "
            f"decile error {check['max_decile_error']:.3f}"
            + (f"; predictor recall {check['predictor']['recall']:.4f}, precision "
               f"{check['predictor']['precision']:.4f}" if "predictor" in check else ""))
    np.savez_compressed(out / "frequencies.npz", prescribed=prescribed,
                        calibrated=np.stack(calibrated) if calibrated else np.zeros_like(prescribed),
                        measured=measured)
    (out / "synthetic.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("files", "calibrated_sparsity", "build_s")}
                     | ({"verify": {k: v for k, v in record["verify"].items() if k != "deciles"}}
                        if "verify" in record else {})))


if __name__ == "__main__":
    _cli.run_main(main)
