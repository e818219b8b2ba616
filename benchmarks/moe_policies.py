"""Which expert cache policy, and how much of the expert memory left to the cache (the rest
pinned by the routing profile): a decode's routing replayed through the expert store's own cache
(ops.expert_store.simulate_cache: cpu_backend/neuron_cache.h, the store's code) at several
memory sizes. Issue 52's "eviction policy chosen by measurement".

    python -m benchmarks.moe_policies --model-dir ~/.cache/powerinfer_jax/synthetic-moe/DIR \
        --out benchmarks/moe_offload_policies.jsonl

The trace: the model's own routing (each layer's top-k, and its router probabilities for the
"score" policy) on (a) the benchmark's decode, bench.py's prompt and --tokens greedy tokens, and
(b) --text-tokens tokens of held-out text (../shared/data/wiki.valid.txt: evaluation text),
each token one call per layer, in order. The model runs under --ram-budget (--budget-fraction
of the file) or in memory (--budget-fraction 0): routing does not depend on where experts live.
Pinned experts: the profile's most frequent over all layers (runtime/expert_offload.py
`split`), from the generator's calibration routing. Rows: per trace, memory fraction (expert
slots / all experts), cache share and policy, the hit rate (pinned + cache hits / routed).
SYNTHETIC models (random weights with prescribed routing): the figures are for that routing.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
VALID = REPO.parent / "shared" / "data" / "wiki.valid.txt"
POLICIES = ("lru", "lfu", "frequency", "score")


def trace(model, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, L, k], probs [T, L, E]) of one forward over `tokens` (causal: each position's
    routing is what decoding it computes)."""
    import jax

    from powerinfer_jax.models.transformer import capture

    _, sown = capture(lambda m, t: m(t), model, jnp.asarray([tokens]))
    c = model.config
    ids = np.asarray(sown["expert_ids"]).reshape(c.n_layers, -1, c.n_experts_used)
    logits = np.asarray(sown["router_logits"]).reshape(c.n_layers, -1, c.n_experts)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return ids.transpose(1, 0, 2), probs.transpose(1, 0, 2)


def replay(ids, probs, freqs, *, memory: float, share: float, policy: str) -> dict:
    from powerinfer_jax.ops.expert_store import simulate_cache
    from powerinfer_jax.runtime.expert_offload import split

    t, n_layers, _ = ids.shape
    n_experts = probs.shape[2]
    slots = max(int(memory * n_layers * n_experts), n_experts)
    pinned, cache_slots = split(freqs, n_layers, n_experts, slots, share)
    calls = [(l, ids[i, l]) for i in range(t) for l in range(n_layers)]
    pr = probs.reshape(t * n_layers, n_experts)
    got = simulate_cache(calls, n_layers=n_layers, n_experts=n_experts, slots=cache_slots,
                         policy=policy, pinned=pinned, prior=freqs, probs=pr)
    routed = got["hits"] + got["pinned_hits"] + got["misses"]
    return {"hit_rate": (got["hits"] + got["pinned_hits"]) / routed,
            "pinned_hit_rate": got["pinned_hits"] / routed, "pinned": int(pinned.sum()),
            "cache_slots": cache_slots, **got}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="--ram-budget the model runs at, a fraction of the file (0: in memory)")
    p.add_argument("--tokens", type=int, default=120)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--memory", type=float, nargs="+", default=[0.2, 0.3, 0.45, 0.6, 0.75])
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "moe_offload_policies.jsonl"))
    a = p.parse_args(argv)
    from powerinfer_jax import _cli, ops
    from powerinfer_jax.bench import prompt_ids
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime import session as sess

    ops.set_num_threads(a.threads)
    d = Path(a.model_dir).expanduser()
    rec = json.loads((d / "synthetic.json").read_text())
    model_file = rec["file"]
    with np.load(d / "frequencies.npz") as z:
        freqs = np.asarray(z["calibrated"], np.float64)
    budget = a.budget_fraction * Path(model_file).stat().st_size
    place = PlacementConfig(ram_budget_gib=budget / (1 << 30) if budget else None)
    n_ctx = a.prompt_tokens + a.tokens
    s = sess.build(model_file, RuntimeConfig(max_seq_len=max(n_ctx, a.text_tokens) + 8),
                   SparsityConfig(mode="dense"), placement=place, progress=False)
    ids = prompt_ids(s.tokenizer, a.prompt_tokens)
    out = list(s.engine.generate(ids, max_new_tokens=a.tokens).tokens)
    text = s.tokenizer.encode(VALID.read_text()[:200_000], add_bos=False)[:a.text_tokens]
    traces = {"decode": trace(s.model, ids + out), "wiki_valid": trace(s.model, text)}
    head = {"bench": "moe_offload_policies", "commit": _cli.git_commit(),
            "machine": _cli.machine_info(), "model": model_file, "synthetic": True,
            "config": rec["config"], "profile": "frequencies.npz (calibrated)"}
    with open(a.out, "a", encoding="utf-8") as f:
        for name, (t_ids, t_probs) in traces.items():
            for memory in a.memory:
                for share in a.shares:
                    for policy in POLICIES:
                        t0 = time.perf_counter()
                        r = replay(t_ids, t_probs, freqs, memory=memory, share=share,
                                   policy=policy)
                        row = {**head, "trace": name, "tokens": int(t_ids.shape[0]),
                               "memory_fraction": memory, "cache_share": share,
                               "policy": policy, **r,
                               "replay_s": round(time.perf_counter() - t0, 3)}
                        f.write(json.dumps(row) + "\n")
                        print(json.dumps({k: row[k] for k in ("trace", "memory_fraction",
                                                              "cache_share", "policy",
                                                              "hit_rate")}), flush=True)


if __name__ == "__main__":
    main()
