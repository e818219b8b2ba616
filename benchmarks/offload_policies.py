"""The neuron cache's split and eviction policy (runtime/offload.py), measured on a real decode
trace: which neurons each layer's predictor asked for at every token, replayed through the
store's own cache code (cpu_backend/neuron_cache.h via ops.neuron_store.simulate_cache).

    python benchmarks/offload_policies.py --model M.gguf --predictors M.powerinfer.gguf \
        --tokens 128 --out benchmarks/offload_policies.jsonl

The trace: greedy decode of --tokens tokens after a short prompt with --sparsity powerinfer under
a --ram-budget (whatever the budget: the store records the ids asked for, not where they were
found; the prefill call is dropped). For each neuron memory (a fraction of all neurons) and each
dynamic share (of the memory above the minimum one layer's worth of slots) the static part is
the most frequent neurons by the model's profile, as runtime/offload.split chooses it, and the
rest of the trace runs through a cache of the remaining slots under each policy. Rows: hit rate
= (static + cache hits) / requested, per-token reads. No timing: this is cheap and exact.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def trace(a):
    import powerinfer_jax as pij
    from powerinfer_jax.runtime import offload

    from powerinfer_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(a.model, keep_quantized=True)
    budget = offload.file_bytes(ckpt)  # just below "fits": a disk store with a large static part
    llm = pij.load(a.model, sparsity="powerinfer", predictors=a.predictors, dtype=a.dtype,
                   ram_budget=budget / (1 << 30), max_seq_len=a.prompt_tokens + a.tokens + 8,
                   threads=a.threads, progress=False)
    off = llm.session.offload
    assert off.summary["mode"] == "disk", off.summary
    store = off.store
    from powerinfer_jax.sparsity.corpus import SHARED_DATA

    text = Path(a.text) if a.text else SHARED_DATA / "wiki.valid.txt"
    ids = llm.tokenizer.encode(text.read_text(encoding="utf-8")[:4000],
                               add_bos=False)[:a.prompt_tokens]
    store.trace(True)
    llm.session.engine.generate(ids, max_new_tokens=a.tokens)
    calls = store.take_trace()
    freqs, source = offload.neuron_frequencies(ckpt, None)
    return calls[ckpt.config.n_layers:], freqs, source, ckpt.config


def replay(calls, freqs, config, *, memory: int, share: float, policy: str):
    from powerinfer_jax.ops.neuron_store import simulate_cache

    L, F = config.n_layers, config.d_ff
    static = min(int((memory - F) * (1.0 - share)), L * F)
    hot = np.zeros(L * F, bool)
    hot[np.argsort(-freqs.ravel(), kind="stable")[:static]] = True
    slots = max(memory - static, int((F - hot.reshape(L, F).sum(1)).max()))
    cold = [c[~hot[c]] for c in calls]
    total = sum(c.size for c in calls)
    static_hits = total - sum(c.size for c in cold)
    r = simulate_cache(cold, num_keys=L * F, slots=slots, policy=policy, prior=freqs)
    tokens = len(calls) / L
    return {"memory_neurons": memory, "static": static, "slots": slots,
            "hit_rate": (static_hits + r["hits"]) / total,
            "static_hit_rate": static_hits / total, "misses_per_token": r["misses"] / tokens,
            "requested_per_token": total / tokens}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--predictors", required=True)
    p.add_argument("--text", default=None, help="prompt text (default: the corpus' wiki.valid)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--memory", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5],
                   help="neuron memory, as fractions of all neurons")
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "offload_policies.jsonl"))
    p.add_argument("--trace-file", default=None,
                   help="an .npz to keep the trace in (replayed from it when it exists)")
    a = p.parse_args(argv)
    trace_file = Path(a.trace_file) if a.trace_file else None
    if trace_file is not None and trace_file.exists():  # a trace recorded before: replay only
        from powerinfer_jax.checkpoint import load_checkpoint
        from powerinfer_jax.runtime import offload

        ckpt = load_checkpoint(a.model, keep_quantized=True)
        config = ckpt.config
        freqs, source = offload.neuron_frequencies(ckpt, None)
        with np.load(trace_file) as z:
            calls = np.split(z["keys"], z["ends"][:-1])
    else:
        calls, freqs, source, config = trace(a)
        if trace_file is not None:
            ends = np.cumsum([c.size for c in calls])
            np.savez_compressed(trace_file, keys=np.concatenate(calls), ends=ends)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    head = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "model": a.model, "synthetic": "synthetic" in a.model,
            "tokens": len(calls) // config.n_layers, "frequencies": source}
    L, F = config.n_layers, config.d_ff
    with open(a.out, "a", encoding="utf-8") as f:
        for frac in a.memory:
            memory = max(int(frac * L * F), F)
            for share in a.shares:
                for policy in ("lru", "lfu", "frequency"):
                    row = {**head, "memory_fraction": frac, "share": share, "policy": policy,
                           **replay(calls, freqs, config, memory=memory, share=share,
                                    policy=policy)}
                    f.write(json.dumps(row) + "\n")
                    print(f"memory {frac:.2f} share {share:.2f} {policy:9s} hit "
                          f"{row['hit_rate']:.3f} (static {row['static_hit_rate']:.3f}) "
                          f"misses/token {row['misses_per_token']:.0f}", flush=True)


if __name__ == "__main__":
    main()
