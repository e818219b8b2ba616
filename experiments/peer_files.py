"""A real (trained) ReLU-family model as the files `benchmarks/sparse_7b.py` compares the systems
on, beside the synthetic ones (`python -m powerinfer_jax.synthetic`): a llama GGUF at --qtype
for llama.cpp and ours, and PowerInfer's GGUF of the same model with PowerInfer-shape predictors
trained here on the model's own active sets (experiments/peers_powerinfer.py: exported as F16,
quantized by PowerInfer's own `quantize`), plus `peer_model.json` naming them with the model's
measured FFN sparsity.

A FATReLU model (sparsify's fatrelu variant) keeps its per-layer thresholds in both GGUFs (our key
`powerinfer_jax.fatrelu_thresholds`): ours applies them in every mode; llama.cpp and PowerInfer
ignore the key and run plain ReLU, which costs them nothing in speed (llama.cpp reads every row
whatever the activation) but is another model in quality (see the model's final rows).

  python -m experiments.peer_files --model DIR --out DIR [--qtype Q4_0] [--powerinfer-src PATH]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments import _common

MATRICES = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
            "ffn.gate.weight", "ffn.up.weight", "ffn.down_t.weight")


def measured_sparsity(model_dir: Path, text: Path, n_tokens: int = 4096) -> float:
    """The model's FFN sparsity (exact zeros, at its FATReLU thresholds when it has them) on the
    first n_tokens of `text`, in its own dense forward."""
    import jax.numpy as jnp

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity.profile import collect_ffn_inputs

    ck = load_checkpoint(model_dir)
    model = from_params(ck.config, ck.params, kernels="xla")
    ids = ck.tokenizer.encode(text.read_text(encoding="utf-8")[:100_000], add_bos=False)
    chunk = 256
    n = min(n_tokens, len(ids)) // chunk * chunk
    x = collect_ffn_inputs(model, np.asarray(ids[:n], np.int32).reshape(-1, chunk))
    zeros = [float(np.mean(np.asarray(layer.ffn.activations(jnp.asarray(x[i][None]))) == 0))
             for i, layer in enumerate(model.layers)]
    return float(np.mean(zeros))


def write(model_dir: Path, out: Path, *, qtype: str, powerinfer_src: str, rank: int,
          train_tokens: int, steps: int) -> Path:
    from experiments.peers_powerinfer import build, export_stem, exports, gguf_tokenizer_meta
    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import cache_dir, load_checkpoint
    from powerinfer_jax.checkpoint.gguf import write_gguf

    out.mkdir(parents=True, exist_ok=True)
    ck = load_checkpoint(model_dir)
    stem = export_stem(str(model_dir), model_dir, ck.config)
    gguf = out / f"{stem}-{qtype}.gguf"
    if not gguf.is_file():
        types = {"tok_embed": qtype, "lm_head": qtype} | {
            f"layers.{i}.{m}": qtype for i in range(ck.config.n_layers) for m in MATRICES}
        tmp = gguf.with_suffix(".tmp")
        write_gguf(tmp, ck.config, ck.params, gguf_tokenizer_meta(model_dir, ck.tokenizer),
                   {k: v for k, v in types.items() if k in ck.params})
        tmp.replace(gguf)
    binary, _ = build(powerinfer_src, cache_dir() / "peers")
    pwri = exports(out, str(model_dir), _common.DATA / "wiki.train.txt", rank=rank,
                   train_tokens=train_tokens, steps=steps, weights=qtype,
                   quantize=binary.with_name("quantize"), source_config=ck.config)["predictor"]
    sparsity = measured_sparsity(model_dir, _common.DATA / "wiki.train.txt")
    record = {"synthetic": False, "source": str(model_dir),
              "command": "python -m experiments.peer_files --model " + str(model_dir),
              "commit": _cli.git_commit(), "config": {"vocab_size": ck.config.vocab_size,
                                                      "d_model": ck.config.d_model,
                                                      "n_layers": ck.config.n_layers,
                                                      "d_ff": ck.config.d_ff,
                                                      "activation": ck.config.activation,
                                                      "fatrelu": bool(ck.config.fatrelu_thresholds)},
              "sparsity": sparsity, "qtype": qtype,
              "files": {"gguf": str(gguf), "powerinfer": str(pwri)}}
    path = out / "peer_model.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a ReLU-family HF directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--qtype", default="Q4_0", choices=("Q4_0",))
    p.add_argument("--powerinfer-src", default="/work/.mirror/SJTU-IPADS+PowerInfer/repo")
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--train-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args(argv)
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"--model {a.model}: expected an HF directory with config.json")
    print(write(a.model, a.out, qtype=a.qtype, powerinfer_src=a.powerinfer_src, rank=a.rank,
                train_tokens=a.train_tokens, steps=a.steps))


if __name__ == "__main__":
    main()
