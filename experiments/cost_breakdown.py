"""Hypothesis: at decode, time goes where bytes go: the sparse FFN's share shrinks with sparsity,
and the whole step approaches the machine's read bandwidth over the bytes a token really touches.

At the model's real decode shapes and dtypes (one token, the KV prefix a decode step reads after
--prompt-tokens), each component runs as its own jitted function over all layers, on the real FFN
inputs of the prompt's last token:
  attention  attn_norm + q/k/v/o + RoPE + cached attention (cache donated, as in decode)
  predictor  the per-layer predictors (predictor mode: "q4" or "lowrank", the --modes labels)
  ffn_hot    FFN rows on the accelerator: none on a CPU-only machine (every neuron is cold there,
             DESIGN.md "Hot and cold"), so 0
  ffn_cold   the FFN through the custom call on the host pool (dense: every neuron)
  lm_head    final norm + logits + greedy pick
then the whole decode step (the Engine's executable, median per token over a generation);
overhead = whole - sum of the parts (embedding, residuals, dispatch between calls).
Bytes touched per token: attention weights, the KV prefix read, predictor weights, the FFN rows of
the active neurons (measured on the same inputs) and the lm_head; achieved GB/s = bytes / step
time, next to the read bandwidth measured in the same process (`_bench_ops.read_bandwidth_gbs`).

  python -m experiments.cost_breakdown [--threads 2] [--dtypes float32 bfloat16]  (default: all
  the CPUs this process may use)
"""
from __future__ import annotations

import argparse

import numpy as np

from experiments import _common

TARGET_SPARSITY = 0.5
MODES = ("dense", "q4", "q4gu", "lowrank")  # dense, then predictor mode with each predictor;
# q4gu: the q4 predictor with --gate-up q4 (its estimates are the activations: down rows only)


def median_ms(fn, *args, repeats: int, carry=None):
    from powerinfer_jax._bench_ops import median_seconds

    return median_seconds(fn, *args, repeats=repeats, carry=carry) * 1e3


def components(model, x_l11d: np.ndarray, *, position: int, kv_len: int, max_seq_len: int,
               repeats: int) -> dict:
    """Per-token ms of each component (all layers) of a built model in its configured mode, and
    the active neurons per layer. x_l11d: each layer's FFN input of one token [L, 1, 1, D]."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.ffn import Selection
    from powerinfer_jax.models.transformer import init_cache

    c = model.config
    graphdef, state = nnx.split(model)
    pos_bt = jnp.full((1, 1), position, jnp.int32)
    dense = model.layers[0].ffn.selector is None

    def attention(state, x, caches):
        m = nnx.merge(graphdef, state)
        ys, new = [], []
        for l, layer in enumerate(m.layers):
            y, cache = layer.attn(layer.attn_norm(x[l]), pos_bt, caches[l], position, kv_len)
            ys.append(y)
            new.append(cache)
        return jnp.stack(ys), new

    def predictor(state, x):  # the selectors' scores (the q4 estimates: signed activations)
        m = nnx.merge(graphdef, state)
        return jnp.stack([layer.ffn.selector.select(layer.ffn, x[l]).scores
                          for l, layer in enumerate(m.layers)])

    def ffn(state, x, scores):
        m = nnx.merge(graphdef, state)
        if dense:
            return jnp.stack([layer.ffn.backend.dense(layer.ffn, x[l])
                              for l, layer in enumerate(m.layers)])
        return jnp.stack([layer.ffn.backend.sparse(layer.ffn, x[l], Selection(
            sel.criterion, sel.threshold, scores[l]))[0]
            for l, (layer, sel) in enumerate(zip(m.layers, selections))])

    def head(state, x):
        m = nnx.merge(graphdef, state)
        return jnp.argmax(m.logits(m.final_norm(x)), axis=-1)

    caches = init_cache(c, batch=1, max_len=max_seq_len, dtype=model.dtype)
    x = jnp.asarray(x_l11d)
    out = {"attention_ms": median_ms(jax.jit(attention, donate_argnums=2), state, x, caches,
                                     repeats=repeats, carry=2)}
    scores = None
    if not dense:
        pred = jax.jit(predictor)
        out["predictor_ms"] = median_ms(pred, state, x, repeats=repeats)
        scores = pred(state, x)  # [L, 1, 1, F]
        selections = [layer.ffn.selector.select(layer.ffn, x[l])
                      for l, layer in enumerate(model.layers)]
        out["active_per_layer"] = [int(sel.active().sum()) for sel in selections]
    else:
        out["predictor_ms"] = 0.0
        out["active_per_layer"] = [c.d_ff] * c.n_layers
    out["ffn_hot_ms"] = 0.0
    out["ffn_cold_ms"] = median_ms(jax.jit(ffn), state, x, scores, repeats=repeats)
    out["lm_head_ms"] = median_ms(jax.jit(head), state, x[-1], repeats=repeats)
    return out


def bytes_per_token(model, *, active_per_layer, kv_len: int, predictor: bool,
                    down_only: bool = False) -> dict:
    """Bytes a decode step reads: weights actually used and the KV prefix. down_only: active
    neurons read only their down rows (--gate-up q4)."""
    import jax.numpy as jnp

    from powerinfer_jax.models.layers import cache_storage_dtype

    c = model.config
    item = jnp.dtype(model.dtype).itemsize
    attn = (c.d_model * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.d_model) * item * c.n_layers
    kv = 2 * kv_len * c.kv_dim * jnp.dtype(cache_storage_dtype(model.dtype)).itemsize * c.n_layers
    rows = 1 if down_only else (3 if c.gated else 2)
    ffn = sum(int(a) for a in active_per_layer) * rows * c.d_model * item
    pred = 0
    if predictor:  # every selector array at its stored dtype (robust to layout changes)
        from flax import nnx

        pred = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                   for layer in model.layers
                   for _, v in nnx.to_flat_state(nnx.state(layer.ffn.selector)))
    head = c.vocab_size * c.d_model * item
    total = attn + kv + ffn + pred + head
    return {"attention_weights": attn, "kv_cache": kv, "ffn_rows": ffn, "predictor": pred,
            "lm_head": head, "total": total}


def child(args) -> None:
    import jax.numpy as jnp

    from powerinfer_jax import _bench_ops, _cli
    from powerinfer_jax.bench import prompt_ids
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.models.transformer import capture
    from powerinfer_jax.runtime.session import build

    threads = _cli.configure_threads(args.child_threads)
    bandwidth = _bench_ops.read_bandwidth_gbs()
    ckpt = load_checkpoint(args.model)
    ids = prompt_ids(ckpt.tokenizer, args.prompt_tokens)
    max_len = len(ids) + args.new_tokens
    for dtype in args.dtypes:
        for mode in args.modes:
            head = _common.header("cost_breakdown", threads=threads, dtype=dtype,
                                  model=args.model, config={"sparsity": mode,
                                                            "prompt_tokens": len(ids),
                                                            "repeats": args.repeats},
                                  quick=args.quick)
            try:
                sparsity = SparsityConfig()
                if mode != "dense":  # predictor mode with the q4 or low-rank predictor
                    sparsity = SparsityConfig(mode="predictor", target_sparsity=TARGET_SPARSITY,
                                              predictor="q4" if mode == "q4gu" else mode,
                                              gate_up="q4" if mode == "q4gu" else "full")
                session = build(args.model, RuntimeConfig(dtype=dtype, max_seq_len=max_len,
                                                          weights="dtype"),
                                sparsity, checkpoint=ckpt, progress=False)
                model, eng = session.model, session.engine
                kv_len = eng.kv_bucket(len(ids))
                step = _common.bench_engine(eng, ckpt.tokenizer, prompt_tokens=len(ids),
                                            new_tokens=args.new_tokens, repeats=3,
                                            max_seconds=args.max_seconds, prompt=ids)
                tokens = jnp.asarray([ids])
                positions = jnp.arange(len(ids))[None]
                _, sown = capture(lambda m: m.hidden(tokens, positions), model)
                x = sown["ffn_in"][:, :, -1:]  # [L, 1, 1, D]: the prompt's last token
                parts = components(model, np.asarray(x), position=len(ids), kv_len=kv_len,
                                   max_seq_len=max_len, repeats=args.repeats)
                step_ms = step["decode_ms_per_token"]
                summed = sum(parts[k] for k in ("attention_ms", "predictor_ms", "ffn_hot_ms",
                                                "ffn_cold_ms", "lm_head_ms"))
                nbytes = bytes_per_token(model, active_per_layer=parts["active_per_layer"],
                                         kv_len=kv_len, predictor=mode != "dense",
                                         down_only=mode == "q4gu")
                achieved = nbytes["total"] / (step_ms * 1e-3) / 1e9
                row = {**head, "status": "ok", "sparsity": mode, "kv_len": kv_len, **parts,
                       "step_ms": step_ms, "overhead_ms": step_ms - summed,
                       "ffn_sparsity": 1.0 - float(np.mean(parts["active_per_layer"]))
                       / ckpt.config.d_ff,
                       "bytes_per_token": nbytes, "achieved_gbs": achieved,
                       "read_bandwidth_gbs": bandwidth, "bandwidth_fraction": achieved / bandwidth,
                       "bandwidth_bound_tok_s": bandwidth * 1e9 / nbytes["total"],
                       "decode_tok_s": step["decode_tok_s"]}
                print(f"threads={threads} {dtype:9s} {mode:9s} step {step_ms:6.2f} ms: attn "
                      f"{parts['attention_ms']:.2f} pred {parts['predictor_ms']:.2f} ffn "
                      f"{parts['ffn_cold_ms']:.2f} head {parts['lm_head_ms']:.2f} other "
                      f"{row['overhead_ms']:.2f}; {nbytes['total'] / 1e6:.1f} MB/token, "
                      f"{achieved:.1f} of {bandwidth:.1f} GB/s", flush=True)
            except Exception as e:
                row = {**head, "status": "failed", "sparsity": mode,
                       "reason": f"{type(e).__name__}: {e}"}
            _common.emit(row)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="default 20 (quick: 5)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="whole-step timing budget per configuration (default 6, quick: 2)")
    p.add_argument("--out", default=str(_common.RESULTS / "cost_breakdown.jsonl"))
    args = p.parse_args(argv)
    q = args.quick
    args.prompt_tokens = args.prompt_tokens or (16 if q else 64)
    args.new_tokens = args.new_tokens or (16 if q else 64)
    args.repeats = args.repeats or (5 if q else 20)
    args.max_seconds = args.max_seconds or (2.0 if q else 6.0)
    if args.child_threads is not None:
        return child(args)
    threads = args.threads or [max(_common.available_threads())]  # --threads 1 2 for both
    child_args = ["--model", args.model, "--dtypes", *args.dtypes, "--modes", *args.modes,
                  "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
                  str(args.new_tokens), "--repeats", str(args.repeats), "--max-seconds",
                  str(args.max_seconds)] + (["--quick"] if q else [])
    rows = _common.run_children("experiments.cost_breakdown", threads, child_args)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
