"""--ram-budget on mixture-of-experts models (runtime/expert_offload.py, runtime/expert_file.py,
ops/expert_store.py, cpu_backend/expert_store.h, xla_ffi/expert_ffn_cpu.cc): the expert store's
kernel gives ops.moe_ffn's bits on the same experts wherever they live (pinned, cached, read now,
read ahead); a synthetic MoE model (random weights) whose experts do not fit the budget gives the
in-memory run's tokens; budgets too small, foreign or truncated expert files and read errors are
one-line errors or rebuilds, and the model file is never written. The cgroup measurements are
benchmarks/moe_offload.py's."""
import hashlib
import json
import os
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from powerinfer_jax import ops
from powerinfer_jax.checkpoint.base import QuantTensor
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.moe import arrange_stacked
from powerinfer_jax.ops import _ffi
from powerinfer_jax.ops.expert_store import ExpertStore, ExpertStoreSettings, simulate_cache
from powerinfer_jax.runtime import expert_file

GIB = 1 << 30
MAX_SEQ = 96
# experts large beside the dense parts (SmolLM2's vocabulary makes the embeddings ~6 MB at
# D = 128), so budgets between the minimum and the whole model exist
SHAPE = ["--d-model", "128", "--n-layers", "3", "--n-heads", "4", "--n-kv-heads", "4",
         "--head-dim", "32", "--d-ff", "256", "--n-experts", "24", "--top-k", "4"]


# ------------------------------------------------------------------------------ the kernel alone
def fake_ckpt(tmp_path, gate_t, down_t, activation, *, n_layers=2, e=7, k=2, d=256, f=None,
              seed=0):
    """Stacked expert blocks as a loaded GGUF holds them, and a model file to fingerprint.
    down_t: one format, or one per layer (as llama.cpp's Q4_K_M mixes Q4_K and Q6_K)."""
    rng = np.random.default_rng(seed)
    downs = (down_t,) * n_layers if isinstance(down_t, str) else tuple(down_t)
    f = f or (256 if any(t.endswith("_K") for t in downs) else 64)
    params = {}
    for l in range(n_layers):
        names = expert_file.expert_names(l)
        for m, t in (("gate", gate_t), ("up", gate_t)):
            params[names[m]] = QuantTensor(np.stack([random_blocks(t, f, d, rng)
                                                     for _ in range(e)]), t, (e, f, d))
        params[names["down_t"]] = QuantTensor(np.stack([random_blocks(downs[l], d, f, rng)
                                                        for _ in range(e)]), downs[l],
                                              (e, f, d), transposed=True)
    source = tmp_path / f"fake-{gate_t}-{'-'.join(downs)}-{activation}.gguf"
    source.write_bytes(rng.integers(0, 256, 8192, dtype=np.uint8).tobytes())
    config = SimpleNamespace(n_layers=n_layers, n_experts=e, n_experts_used=k, d_model=d,
                             d_ff=f, activation=activation)
    return SimpleNamespace(config=config, params=params, source=str(source))


def _reference(ckpt, spec, layer, x, ids, w):
    """ops.moe_ffn on the layer's experts arranged as the in-memory model arranges them."""
    c = ckpt.config
    layouts = expert_file._layouts(c.activation)
    mats = []
    for m, name in expert_file.expert_names(layer).items():
        t = ckpt.params[name]
        mats.append(arrange_stacked(np.asarray(t.blocks), t.qtype, layouts[m], t.stored_shape,
                                    t.transposed)[0])
    return np.asarray(ops.moe_ffn(x, ids, w, *mats, activation=c.activation,
                                  **spec.layer_formats(layer)))


def _store_call(store, spec, ckpt, layer, x, ids, w, **kw):
    c = ckpt.config
    return np.asarray(_ffi.expert_ffn(x, ids, w, store=store.handle, layer=layer, d_ff=c.d_ff,
                                      activation=c.activation, **spec.layer_formats(layer),
                                      **kw))


@pytest.mark.parametrize("gate_t,down_t,activation", [("Q4_0", "Q4_0", "silu"),
                                                      ("Q8_0", "Q8_0", "silu"),
                                                      ("Q4_K", ("Q6_K", "Q4_K"), "silu"),
                                                      ("Q4_0", "Q4_0", "relu"),
                                                      ("Q4_0", ("Q6_K", "Q4_0"), "relu")])
def test_store_kernel_bitwise_equals_moe_ffn(tmp_path, gate_t, down_t, activation):
    """Calls of 1, 3 and 12 tokens, one after another through a store with two pinned experts
    and the minimum cache (misses, evictions, reads ahead, pieces of 4 KiB in flight): each
    call's y is ops.moe_ffn's bits on the in-memory arrangement of the same experts; formats
    mixed by layer (a Q4_K_M file's Q4_K and Q6_K down projections) too."""
    ckpt = fake_ckpt(tmp_path, gate_t, down_t, activation)
    c = ckpt.config
    if gate_t != "Q4_K":
        assert expert_file.plan(ckpt, "x").formats[0][0].endswith("x16")  # interleaved
    path, spec = expert_file.ensure(ckpt, progress=False)
    downs = (down_t,) * 2 if isinstance(down_t, str) else down_t
    for l, fmt in enumerate(spec.formats):  # groups where a ReLU expert's down format has them
        assert fmt[3] == ("groups" if activation == "relu" and downs[l] != "Q6_K" else "rows")
    pinned = np.zeros((c.n_layers, c.n_experts), bool)
    pinned[0, 1] = pinned[1, 5] = True
    store = ExpertStore(path, spec, pinned, c.n_experts - 1,
                        settings=ExpertStoreSettings(policy="lru", read_bytes=4096, readers=3))
    rng = np.random.default_rng(1)
    for step, n in enumerate([1, 3, 12, 1, 1, 2]):
        layer = step % c.n_layers
        x = rng.standard_normal((n, c.d_model)).astype(np.float32)
        ids = np.stack([rng.permutation(c.n_experts)[:c.n_experts_used]
                        for _ in range(n)]).astype(np.int32)
        w = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
        nxt = rng.integers(0, c.n_experts, (n, 3)).astype(np.int32)
        got = _store_call(store, spec, ckpt, layer, x, ids, w, next_ids=nxt)
        np.testing.assert_array_equal(got, _reference(ckpt, spec, layer, x, ids, w))
    st = store.stats()
    assert st["misses"] > 0 and st["pinned_hits"] > 0 and st["read_failures"] == 0
    assert st["direct"] == (os.uname().sysname == "Linux" and st["direct"])  # (tmpfs: buffered)


def test_a_read_error_is_one_line_and_no_hang(tmp_path):
    """The expert file cut short after the store opened: the call that needs a lost expert
    fails with one line naming the file and the byte (no hang, no crash), and a call whose
    experts are in memory still runs."""
    ckpt = fake_ckpt(tmp_path, "Q4_0", "Q4_0", "silu")
    c = ckpt.config
    path, spec = expert_file.ensure(ckpt, progress=False)
    pinned = np.zeros((c.n_layers, c.n_experts), bool)
    pinned[0, :2] = True
    store = ExpertStore(path, spec, pinned, c.n_experts)
    os.truncate(path, spec.data_offset + spec.slot_bytes * c.n_experts)  # layer 1 gone
    x = np.ones((1, c.d_model), np.float32)
    w = np.ones((1, 2), np.float32)
    with pytest.raises(Exception) as e:
        _store_call(store, spec, ckpt, 1, x, np.array([[3, 4]], np.int32), w)
    line = str(e.value).strip().splitlines()[0]
    assert "reading experts" in line and path.name in line and "read at byte" in line
    got = _store_call(store, spec, ckpt, 0, x, np.array([[0, 1]], np.int32), w)
    np.testing.assert_array_equal(got, _reference(ckpt, spec, 0, x, np.array([[0, 1]], np.int32),
                                                  w))


def test_store_rejects_bad_tables_and_files(tmp_path):
    ckpt = fake_ckpt(tmp_path, "Q4_0", "Q4_0", "silu")
    c = ckpt.config
    path, spec = expert_file.ensure(ckpt, progress=False)
    none = np.zeros((c.n_layers, c.n_experts), bool)
    with pytest.raises(ValueError, match=r"cache_slots: expected at least 7 \(a layer's "
                                         r"unpinned experts"):
        ExpertStore(path, spec, none, c.n_experts - 1)
    with pytest.raises(ValueError, match="expert cache policy: expected one of"):
        ExpertStoreSettings(policy="fifo")
    with pytest.raises(ValueError, match="frequency policy"):
        ExpertStore(path, spec, none, c.n_experts, settings=ExpertStoreSettings("frequency"))
    os.truncate(path, spec.file_bytes - 4096)
    with pytest.raises(ValueError, match=r"size: expected at least \d+ bytes .* \(truncated\?\)"):
        ExpertStore(path, spec, none, c.n_experts)


def _brute_force(calls, *, slots, policy, pinned, prior=None, probs=None, tau=16.0,
                 n_layers=1, n_experts=1):
    """The policies as documented (neuron_cache.h), by brute force: victim = the least rank."""
    cached, last, uses = {}, {}, {}
    score = {}
    hits = misses = 0
    for c, (layer, ids) in enumerate(calls):
        tick = c + 1
        if policy == "score" and probs is not None:
            now = tick / n_layers / tau
            for e, p in enumerate(probs[c]):
                if p > 0:
                    key = layer * n_experts + e
                    v = np.log(np.float32(p)) + now
                    old = score.get(key, -np.inf)
                    score[key] = np.logaddexp(old, v)
        held = set()
        for e in ids:
            key = layer * n_experts + int(e)
            if pinned.ravel()[key]:
                continue
            if key in cached:
                hits += 1
                if key not in held:
                    last[key], uses[key] = tick, uses[key] + 1
            else:
                misses += 1
                if len(cached) >= slots:
                    def rank(k):
                        primary = {"lru": 0.0, "lfu": uses[k],
                                   "frequency": prior.ravel()[k] if prior is not None else 0,
                                   "score": score.get(k, -np.inf)}[policy]
                        return (primary, last[k], k)
                    victim = min((k for k in cached if k not in held), key=rank)
                    del cached[victim]
                cached[key] = True
                last[key], uses[key] = tick, 1
            held.add(key)
    return hits, misses


@pytest.mark.parametrize("policy", ["lru", "lfu", "frequency", "score"])
def test_cache_policies_evict_as_documented(policy):
    rng = np.random.default_rng(4)
    n_layers, n_experts = 3, 9
    pinned = np.zeros((n_layers, n_experts), bool)
    pinned[1, 2] = True
    prior = rng.uniform(0, 1, (n_layers, n_experts))
    calls, probs = [], []
    for c in range(200):
        layer = c % n_layers
        p = rng.dirichlet(np.ones(n_experts) * 0.3)
        calls.append((layer, np.argsort(-p)[:3]))
        probs.append(p)
    probs = np.asarray(probs, np.float32)
    for slots in (4, 6, 10):
        got = simulate_cache(calls, n_layers=n_layers, n_experts=n_experts, slots=slots,
                             policy=policy, pinned=pinned, prior=prior, probs=probs)
        want = _brute_force(calls, slots=slots, policy=policy, pinned=pinned,
                            prior=prior.astype(np.float32), probs=probs, n_layers=n_layers,
                            n_experts=n_experts)
        assert (got["hits"], got["misses"]) == want, slots


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from powerinfer_jax.synthetic.moe import main

    out = tmp_path_factory.mktemp("moe_offload")
    main([*SHAPE, "--calib-tokens", "1024", "--verify-tokens", "0", "--out", str(out)])
    return str(next(out.glob("*.gguf")))


def _build(gguf, *, budget=None, policy="lru", lookahead=True, cache_share=None,
           max_seq=MAX_SEQ):
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime import session

    place = PlacementConfig(ram_budget_gib=None if budget is None else budget / GIB,
                            neuron_cache=policy, lookahead=lookahead, cache_share=cache_share)
    return session.build(gguf, RuntimeConfig(max_seq_len=max_seq), SparsityConfig(mode="dense"),
                         placement=place, progress=False)


def _tokens(s, n=64, prompt="The history of computing is a story of ideas"):
    ids = s.tokenizer.encode(prompt)
    return list(s.engine.generate(ids, max_new_tokens=n).tokens)


def _needs(build) -> int:
    with pytest.raises(UserError) as e:
        build()
    return int(str(e.value).split("GiB (")[1].split(" bytes")[0])


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.slow
def test_tokens_equal_in_memory_at_the_minimum_budget(model):
    """64 greedy tokens at the smallest budget (the cache holds one layer's experts, nothing
    pinned) equal the in-memory run's; the budget below it is refused naming the bytes, as a
    mode that selects neurons."""
    from prometheus_client import CollectorRegistry, generate_latest

    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime import session
    from powerinfer_jax.server.offload_metrics import OffloadCollector

    before = _sha256(model)
    want = _tokens(_build(model))
    lo = _needs(lambda: _build(model, budget=_needs(lambda: _build(model, budget=1 << 20))))
    s = _build(model, budget=lo)
    summary = s.offload.summary
    assert summary["mode"] == "disk" and summary["resident_bytes"] <= lo
    assert summary["cache_slots"] == 24 and summary["pinned_experts"] == 0
    assert _tokens(s) == want
    st = s.offload.stats()
    assert st["misses"] > 0 and st["per_token"]["tokens"] >= 60
    assert 0 <= st["per_token"]["readahead_recall"] <= 1
    with pytest.raises(UserError, match=r"--ram-budget: expected at least [0-9.]+ GiB "
                                        rf"\({lo} bytes: what stays in memory .* one layer's 24 "
                                        "routed experts"):
        _build(model, budget=lo - 1)
    with pytest.raises(UserError, match="--sparsity with --ram-budget on an MoE model: "
                                        "expected dense"):
        session.build(model, RuntimeConfig(max_seq_len=MAX_SEQ), SparsityConfig(mode="oracle"),
                      placement=PlacementConfig(ram_budget_gib=lo / GIB), progress=False)
    # the server's metrics read the expert store
    reg = CollectorRegistry()
    reg.register(OffloadCollector(s.offload))
    text = generate_latest(reg).decode()
    for name in ("pij_expert_misses_total", "pij_expert_hit_rate", "pij_expert_readahead_recall",
                 "pij_expert_read_bytes_per_token"):
        assert name in text
    assert _sha256(model) == before  # nothing written to the model file


@pytest.mark.slow
def test_the_cli_reports_the_store_in_json(model, capsys):
    from powerinfer_jax import generate

    generate.main(["--model", model, "--prompt", "Hello there", "--max-new-tokens", "6",
                   "--max-seq-len", str(MAX_SEQ), "--ram-budget", "0.0105", "--neuron-cache",
                   "score", "--json", "--no-stream"])
    off = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["offload"]
    assert off["mode"] == "disk" and off["kind"] == "experts" and off["policy"] == "score"
    pt = off["stats"]["per_token"]
    assert pt["tokens"] > 0 and 0 <= pt["hit_rate"] <= 1 and 0 <= pt["readahead_recall"] <= 1


@pytest.mark.slow
def test_every_policy_and_budget_gives_the_same_tokens(model):
    """Pinned experts (the generator's calibrated routing) and a cache under each policy, with
    and without read-ahead, at a third of the way from the minimum to the whole model and just
    below the whole model: the in-memory tokens."""
    want = _tokens(_build(model))
    lo = _needs(lambda: _build(model, budget=_needs(lambda: _build(model, budget=1 << 20))))
    full = _build(model, budget=1 << 40).offload.summary["resident_bytes"]
    low, high = lo + (full - lo) // 3, full - (1 << 20)
    for budget, policy, lookahead in ((low, "lru", True), (low, "score", True),
                                      (high, "frequency", False), (high, "lfu", True)):
        s = _build(model, budget=budget, policy=policy, lookahead=lookahead)
        summary = s.offload.summary
        assert summary["mode"] == "disk" and summary["pinned_experts"] > 0
        assert summary["frequencies"].endswith("(calibrated)")
        assert summary["policy"] == policy
        assert _tokens(s) == want, (budget, policy)


def test_an_expert_file_of_another_model_or_truncated_is_rebuilt(tmp_path, capsys):
    """A foreign header and a cut file each get a one-line note and a new file beside the model;
    the model file is never written."""
    ck = fake_ckpt(tmp_path, "Q4_0", "Q4_0", "silu")
    path, spec = expert_file.ensure(ck, progress=False)
    assert path.name.endswith(".gguf.pij-experts") and path.parent == tmp_path
    good = _sha256(path)
    before = _sha256(ck.source)
    other = expert_file.dataclasses.replace(spec, model_fingerprint="0" * 64)
    with open(path, "r+b") as f:
        f.write(expert_file._header_bytes(other))
    assert expert_file.ensure(ck, progress=False)[0] == path
    assert "for another model" in capsys.readouterr().err
    os.truncate(path, spec.file_bytes - 4096)
    expert_file.ensure(ck, progress=False)
    assert "truncated" in capsys.readouterr().err
    assert _sha256(path) == good and _sha256(ck.source) == before


def test_float_experts_are_refused(tmp_path):
    ckpt = fake_ckpt(tmp_path, "Q4_0", "Q4_0", "silu")
    ckpt.params["layers.1.ffn.experts.up.weight"] = np.zeros((7, 64, 256), np.float16)
    with pytest.raises(UserError, match=r"--ram-budget model: expected a GGUF with "
                                        r"block-quantized experts .* got 'layers\.1\.ffn\."
                                        r"experts\.up\.weight as float16'"):
        expert_file.check_quantized(ckpt)


@pytest.mark.slow
def test_moe_families_give_the_in_memory_tokens_under_a_budget(tmp_path):
    """The MoE families of test_families_moe.py (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared
    expert, OLMoE), quantized to Q4_0 by llama-quantize: 64 greedy tokens at the smallest budget
    and between it and the whole model equal the in-memory run's; the file is not written."""
    import shutil

    import helpers_families as fam
    import helpers_moe as moe

    built = fam.built_set("moe-families", moe.FAMILIES, moe.build)
    if not built["q"]:
        pytest.skip(built["why_q"])
    # a short context: the MoE kernel's scratch for a whole prompt at once counts in the budget,
    # and these models are ~1 MB
    kw = dict(max_seq=68)
    for name, src in built["q"].items():
        path = tmp_path / src.name  # the expert file goes beside it, not into the shared set
        shutil.copy(src, path)
        before = _sha256(path)
        want = _tokens(_build(str(path), **kw), prompt="Hi")
        lo = _needs(lambda: _build(str(path), budget=_needs(
            lambda: _build(str(path), budget=4096, **kw)), **kw))
        s = _build(str(path), budget=lo, **kw)
        assert s.offload.summary["mode"] == "disk", name
        assert _tokens(s, prompt="Hi") == want, name
        assert s.offload.stats()["misses"] > 0, name
        assert _sha256(path) == before, name
