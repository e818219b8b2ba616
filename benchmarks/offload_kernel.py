"""The neuron store's layer (ops._ffi.disk_ffn over a store whose neurons are all in memory)
against the in-memory kernel (ops._ffi.qsparse_ffn) on the same rows: what the store's own path
costs (lookups, the cache's bookkeeping, its kernel) when nothing is read from the disk. Issue 36.

    flock -x /tmp/pij_cpu.lock python benchmarks/offload_kernel.py \
        --model /work/models/s90/synthetic-llama2-7b-relu-s0.9-Q4_0.powerinfer.gguf --threads 2

Per round, one program runs `--layers` layers back to back (each layer's x and selection its
own), in-memory and store programs interleaved; first the two are checked bit for bit on every
layer. The selection: each layer's neurons drawn with the model's activation frequencies
(frequencies.npz beside it, as the store's static part is chosen), about --active of them, a
fresh draw per layer; x random normal; --precision of them with a positive gate (a
predictor's precision: the rest do not fire), so the kernel's work is a real decode's (random
selections fire half the time). Static fraction: --static of each layer's neurons (the
most frequent) in the store's static part, the rest in its cache (read once before timing).
Rows: median ms per layer of each, their ratio, and the bytes the in-memory kernel's rows
amount to per layer (napkin: GB/s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a quantized GGUF (llama.cpp's or PowerInfer's)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--active", type=float, default=0.1, help="share of a layer's neurons selected")
    p.add_argument("--static", type=float, default=0.75,
                   help="share of each layer's neurons in the store's static part")
    p.add_argument("--precision", type=float, default=0.9,
                   help="share of the selected neurons whose gate fires (the synthetic 7B's "
                        "predictors: about 0.9)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from powerinfer_jax import _cli
    from powerinfer_jax.checkpoint import bundles, load_checkpoint
    from powerinfer_jax.models.qweights import SELECTED_LAYOUT, arrange
    from powerinfer_jax.ops import _ffi
    from powerinfer_jax.ops.neuron_store import NeuronStore
    from powerinfer_jax.runtime.offload import neuron_frequencies

    _ffi.set_num_threads(a.threads)
    ck = load_checkpoint(a.model, keep_quantized=True)
    c = ck.config
    freqs, _ = neuron_frequencies(ck, None)
    path, spec, order = bundles.ensure(ck, freqs)
    L, F, D = spec.n_layers, spec.n_neurons, spec.dim
    layers = list(range(min(a.layers, L)))
    rng = np.random.default_rng(0)
    prior = freqs if freqs is not None else np.ones((L, F))
    hot = np.zeros((L, F), bool)
    for l in layers:
        hot[l, np.argsort(-prior[l], kind="stable")[:int(a.static * F)]] = True
    store = NeuronStore(path, spec, order, hot, cache_slots=max(F, L * F // 4), prior=prior)
    weights, xs, scores = [], [], []
    for l in layers:
        names = bundles.ffn_names(c, l)
        down = arrange(ck.params[names["down"]], SELECTED_LAYOUT.down)
        weights.append((jnp.asarray(np.asarray(ck.params[names["gate"]].blocks)),
                        jnp.asarray(np.asarray(ck.params[names["up"]].blocks)),
                        jnp.asarray(np.asarray(down.blocks)), down.kernel_qtype))
        x = rng.standard_normal((a.tokens, D)).astype(np.float32)
        fires = (ck.params[names["gate"]].dequantize() @ x[0]) > 0
        k = int(a.active * F)
        chosen = []
        for want, pool in ((round(a.precision * k), fires), (k - round(a.precision * k), ~fires)):
            pl = np.where(pool, prior[l] + 1e-9, 0.0)
            chosen.append(rng.choice(F, size=want, replace=False, p=pl / pl.sum()))
        s = np.full((a.tokens, F), -1.0, np.float32)
        s[:, np.concatenate(chosen)] = 1.0
        scores.append(jnp.asarray(s))
        xs.append(jnp.asarray(x))
    qt = {"gate": ck.params[bundles.ffn_names(c, 0)["gate"]].qtype,
          "up": ck.params[bundles.ffn_names(c, 0)["up"]].qtype}

    def in_memory(ws, xs, ss):
        out = []
        for (g, u, d, dq), x, s in zip(ws, xs, ss):
            out.append(_ffi.qsparse_ffn(x, u, d, up_qtype=qt["up"], down_qtype=dq, gate=g,
                                        gate_qtype=qt["gate"], b_up=None, b_down=None, scores=s,
                                        threshold=0.0, activation="relu",
                                        criterion="scores")[0])
        return out

    def from_store(xs, ss):
        return [_ffi.disk_ffn(x, s, store=store.handle, layer=l, threshold=0.0,
                              activation="relu", criterion="scores")[0]
                for l, x, s in zip(layers, xs, ss)]

    mem_fn = jax.jit(lambda xs, ss: in_memory(weights, xs, ss))
    disk_fn = jax.jit(from_store)
    want = [np.asarray(y) for y in mem_fn(xs, scores)]
    got = [np.asarray(y) for y in disk_fn(xs, scores)]  # also reads the cache's neurons once
    equal = all(np.array_equal(w, g) for w, g in zip(want, got))
    if not equal:
        print(json.dumps({"error": "the store's layers differ from the in-memory kernel's",
                          "max_abs": max(float(np.max(np.abs(w - g))) for w, g in zip(want, got))}))
    store.reset_stats()
    times = {"memory": [], "store": []}
    for _ in range(a.rounds):
        for name, fn in (("memory", lambda: mem_fn(xs, scores)),
                         ("store", lambda: disk_fn(xs, scores))):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - t0) / len(layers) * 1e3)
    st = store.stats()
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"bench": "offload_kernel", "commit": _cli.git_commit(), "machine": _cli.machine_info(),
           "threads": a.threads, "model": a.model, "synthetic": "synthetic" in Path(a.model).name,
           "down_source": spec.down_source, "down_qtype": spec.down_qtype, "layers": len(layers),
           "active": a.active, "precision": a.precision, "static": a.static,
           "tokens": a.tokens, "rounds": a.rounds,
           "bitwise_equal": equal, "memory_ms_per_layer": med["memory"],
           "store_ms_per_layer": med["store"], "store_over_memory": med["store"] / med["memory"],
           "store_misses": st["misses"], "store_requested": st["requested"],
           "times_ms": times, "tag": a.tag}
    print(json.dumps({k: row[k] for k in ("bitwise_equal", "memory_ms_per_layer",
                                          "store_ms_per_layer", "store_over_memory",
                                          "store_misses")}))
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
