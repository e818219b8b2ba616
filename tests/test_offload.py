"""--ram-budget (runtime/offload.py, checkpoint/bundles.py, ops/neuron_store.py, cpu_backend/
neuron_store.h, disk_ffn.h): a synthetic sparse model (random weights) whose FFN does not fit the
budget runs from a neuron store and gives the in-memory run's tokens; the kernel gives
ops.qsparse_ffn's bits; the budget is honoured as computed; bad budgets, files and directories
are one-line errors or rebuilds. The cgroup measurements are benchmarks/offload.py's."""
import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from powerinfer_jax.checkpoint.gguf_file import GGUFFile
from powerinfer_jax.errors import UserError

# FFN large beside the dense parts (SmolLM2's vocabulary makes the embeddings ~15 MB), so budgets
# between the minimum and the whole model exist
SHAPE = ["--shape", "smollm2-135m", "--d-model", "256", "--n-layers", "4", "--n-heads", "4",
         "--n-kv-heads", "2", "--head-dim", "64", "--d-ff", "4096", "--rank", "15"]
MAX_SEQ = 64
GIB = 1 << 30


def _make(out, *args):
    from powerinfer_jax.synthetic.__main__ import main

    main([*SHAPE, "--sparsity", "0.9", "--calib-tokens", "2048", "--verify-tokens", "0",
          "--formats", "gguf,powerinfer", *args, "--out", str(out)])
    return json.loads((out / "synthetic.json").read_text())["files"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    files = _make(tmp_path_factory.mktemp("offload_model"))
    return files["gguf"], files["powerinfer"]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another model of the same shape (another seed): its bundle file must not serve `model`."""
    return _make(tmp_path_factory.mktemp("offload_other"), "--seed", "1")["gguf"]


def _build(gguf, predictors, *, budget=None, mode="powerinfer", policy="lru", cache_share=None,
           lookahead=True):
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime import session

    sp = SparsityConfig(mode=mode, predictor_file=predictors if mode == "powerinfer" else None)
    place = PlacementConfig(ram_budget_gib=None if budget is None else budget / GIB,
                            neuron_cache=policy, cache_share=cache_share, lookahead=lookahead)
    return session.build(gguf, RuntimeConfig(max_seq_len=MAX_SEQ), sp, placement=place,
                         progress=False)


def _tokens(s, n=16):
    ids = s.tokenizer.encode("The history of computing is a story of ideas")
    return list(s.engine.generate(ids, max_new_tokens=n).tokens)


def _needs(build) -> int:
    """The bytes a budget error names ("at least X GiB (N bytes ...")."""
    with pytest.raises(UserError) as e:
        build()
    return int(str(e.value).split("GiB (")[1].split(" bytes")[0])


def _minimum(gguf, predictors) -> int:
    """The smallest budget: the header's resident tensors first (checked before loading), then
    the full minimum the built model names."""
    resident = _needs(lambda: _build(gguf, predictors, budget=1 << 20))
    return _needs(lambda: _build(gguf, predictors, budget=resident))


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ------------------------------------------------------------------------------------ kernel
def _kernel_matches_in_memory(ck, hot_fraction, want_source, *, tokens=(1, 3, 40)):
    """The store's layers against ops.qsparse_ffn on the rows the in-memory model holds."""
    from powerinfer_jax.checkpoint import bundles
    from powerinfer_jax.models.qweights import SELECTED_LAYOUT, arrange
    from powerinfer_jax.ops import _ffi, reference
    from powerinfer_jax.ops.neuron_store import NeuronStore

    path, spec, order = bundles.ensure(ck, progress=False)
    assert spec.down_source == want_source
    L, F, D = spec.n_layers, spec.n_neurons, spec.dim
    rng = np.random.default_rng(int(hot_fraction * 10))
    store = NeuronStore(path, spec, order, rng.random((L, F)) < hot_fraction, cache_slots=F)
    for l in range(L):
        names = bundles.ffn_names(ck.config, l)
        gate, up = (ck.params[names[k]] for k in ("gate", "up"))
        down = arrange(ck.params[names["down"]], SELECTED_LAYOUT.down)  # as the model holds it
        assert down.layout == want_source and down.qtype == spec.down_qtype
        for t in tokens:
            x = rng.standard_normal((t, D)).astype(np.float32)
            scores = np.where(rng.random((t, F)) < 0.2, 1.0, -1.0).astype(np.float32)
            g = np.asarray(reference.qlinear(x, gate.blocks, gate.qtype, D))
            # 0, and (one token count) a FATReLU gate threshold that turns off half of the
            # positive gates
            floors = (0.0, float(np.median(g[g > 0]))) if t == tokens[1] else (0.0,)
            for floor in floors:
                for crit in ("scores", "oracle"):
                    y, n = _ffi.disk_ffn(x, scores, store=store.handle, layer=l, threshold=0.0,
                                         activation="relu", criterion=crit, gate_floor=floor)
                    want_y, want_n = _ffi.qsparse_ffn(
                        x, up.blocks, down.blocks, up_qtype=up.qtype,
                        down_qtype=down.kernel_qtype,
                        gate=gate.blocks, gate_qtype=gate.qtype, b_up=None, b_down=None,
                        scores=scores, threshold=0.0, activation="relu", criterion=crit,
                        gate_floor=floor)
                    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
                    np.testing.assert_array_equal(np.asarray(n), np.asarray(want_n))
                    if floor and crit == "oracle":  # the threshold bites: fewer active
                        assert np.all(np.asarray(n) < (g > 0).sum(-1))
    s = store.stats()
    assert s["static_hits"] + s["cache_hits"] + s["misses"] == s["requested"] > 0
    if hot_fraction < 1:
        assert s["misses"] > 0 and s["bytes_read"] >= s["misses"] * spec.slot_bytes
    else:
        assert s["misses"] == 0 and s["bytes_read"] == 0
    return spec


@pytest.mark.parametrize("hot_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("which", ["gguf", "powerinfer"])
def test_kernel_bitwise_equals_qsparse_ffn(model, hot_fraction, which):
    """The store's layer, wherever its rows are, gives ops.qsparse_ffn's bits on the rows the
    in-memory model reads: llama.cpp's ffn_down as down groups (the store: code rows and the
    groups' scale planes), PowerInfer's ffn_down_t as neuron rows; decode, small batches, prefill."""
    from powerinfer_jax.checkpoint import load_checkpoint

    ck = load_checkpoint(model[0] if which == "gguf" else model[1], keep_quantized=True)
    spec = _kernel_matches_in_memory(ck, hot_fraction,
                                     "groups" if which == "gguf" else "rows")
    assert spec.down_qtype == "Q4_0"
    assert spec.planes_stride > 0 if which == "gguf" else spec.planes_stride == 0


@pytest.mark.parametrize("qtype", [pytest.param("Q4_1", marks=pytest.mark.slow),
                                   pytest.param("Q5_0", marks=pytest.mark.slow), "Q8_0"])
def test_kernel_down_groups_of_every_format(qtype, tmp_path):
    """Down groups from code rows and planes for the other 32-weight formats: pairs (Q4_1, with
    minimums) and neuron rows (Q5_0, Q8_0)."""
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.synthetic.__main__ import main

    main(["--shape", "smollm2-135m", "--d-model", "64", "--n-layers", "2", "--n-heads", "2",
          "--n-kv-heads", "1", "--head-dim", "32", "--d-ff", "256", "--rank", "7", "--sparsity",
          "0.9", "--calib-tokens", "256", "--verify-tokens", "0", "--formats", "gguf",
          "--qtype", qtype, "--out", str(tmp_path)])
    gguf = json.loads((tmp_path / "synthetic.json").read_text())["files"]["gguf"]
    ck = load_checkpoint(gguf, keep_quantized=True)
    assert _kernel_matches_in_memory(ck, 0.3, "groups", tokens=(1, 5)).down_qtype == qtype


def test_requantized_down_rows_are_the_in_memory_models():
    from powerinfer_jax.checkpoint import bundles
    from powerinfer_jax.models import qweights

    assert bundles.DOWN_ROWS_QTYPE == qweights.DOWN_ROWS_QTYPE


def test_cache_policies_evict_as_documented():
    from powerinfer_jax.ops.neuron_store import simulate_cache

    # 2 slots; calls [0], [1], [0], [2]: LRU evicts 1 (least recent), so a final [0] hits
    calls = [[0], [1], [0], [2], [0]]
    assert simulate_cache(calls, num_keys=4, slots=2, policy="lru")["hits"] == 2
    # LFU: 0 has 2 uses, 1 has 1: [2] evicts 1; then [1] misses and evicts 2 (1 use, older
    # than... ties by last use): 0 stays
    r = simulate_cache([[0], [0], [1], [2], [1], [0]], num_keys=4, slots=2, policy="lfu")
    assert r == {"hits": 2, "misses": 4, "evictions": 2, "uncached": 0}
    # frequency: the prior decides; key 3 (prior 0.9) is never evicted for keys of prior 0.1
    prior = [0.1, 0.1, 0.1, 0.9]
    r = simulate_cache([[3], [0], [1], [2], [3]], num_keys=4, slots=2, policy="frequency",
                       prior=prior)
    assert r["hits"] == 1
    # a call's own keys are never evicted within it: 3 keys, 2 slots -> one stays uncached
    assert simulate_cache([[0, 1, 2]], num_keys=4, slots=2, policy="lru")["uncached"] == 1
    # a cyclic scan larger than the cache: LRU keeps nothing, the frequency policy its prior's
    # favourites (why the store's static part and this policy exist)
    scan = [[k] for _ in range(5) for k in range(4)]
    prior = [0.9, 0.8, 0.1, 0.1]
    assert simulate_cache(scan, num_keys=4, slots=2, policy="lru")["hits"] == 0
    # (key 0 stays from the second pass on; 1 loses its slot to each newcomer: 4 hits)
    assert simulate_cache(scan, num_keys=4, slots=2, policy="frequency", prior=prior)["hits"] == 4


def _reference_cache(calls, *, slots, policy, prior=None):
    """neuron_cache.h's policies by brute force: the victim is the least (rank, key) among the
    unpinned slots, rank = (prior or uses or 0, last use)."""
    cached, last, uses = {}, {}, {}  # key -> True; last use; uses
    out = {"hits": 0, "misses": 0, "evictions": 0, "uncached": 0}

    def rank(k):
        primary = {"lru": 0.0, "lfu": float(uses[k]),
                   "frequency": float(np.float32(prior[k])) if prior is not None else 0.0}[policy]
        return primary, last[k], k

    for tick, call in enumerate(calls, 1):
        pinned = set()
        for k in call:
            if k in cached:
                out["hits"] += 1
                if k in pinned:
                    continue
                last[k], uses[k] = tick, uses[k] + 1
                pinned.add(k)
                continue
            out["misses"] += 1
            if len(cached) >= slots:
                free = [c for c in cached if c not in pinned]
                if not free:
                    out["uncached"] += 1
                    continue
                victim = min(free, key=rank)
                del cached[victim]
                out["evictions"] += 1
            cached[k], last[k], uses[k] = True, tick, 1
            pinned.add(k)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "frequency"])
def test_cache_victims_equal_a_brute_force_reference(policy):
    """The lazy heap (stale entries re-ranked, pinned slots set aside only when they surface)
    evicts what a scan of every slot would, call for call."""
    from powerinfer_jax.ops.neuron_store import simulate_cache

    rng = np.random.default_rng(3)
    num_keys = 60
    prior = rng.choice([0.0, 0.1, 0.2, 0.5], size=num_keys).astype(np.float32)  # many ties
    for slots in (1, 7, 20):
        calls = [np.unique(rng.choice(num_keys, size=rng.integers(1, 12),
                                      p=np.linspace(1, 3, num_keys) / np.linspace(1, 3, num_keys).sum()))
                 for _ in range(300)]
        want = _reference_cache(calls, slots=slots, policy=policy, prior=prior)
        got = simulate_cache(calls, num_keys=num_keys, slots=slots, policy=policy, prior=prior)
        assert got == want, slots


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.parametrize("which", ["gguf", "powerinfer"])
def test_tokens_equal_in_memory_at_several_budgets(model, which):
    """llama.cpp's GGUF (the store sums down groups) and PowerInfer's (neuron rows), each with
    the PowerInfer file's predictors: the in-memory run's tokens at every budget."""
    gguf, predictors = model
    if which == "powerinfer":
        gguf = predictors
    before = _sha256(gguf)
    want = _tokens(_build(gguf, predictors))
    lo = _minimum(gguf, predictors)
    full = _build(gguf, predictors, budget=1 << 40).offload.summary["resident_bytes"]
    assert full > lo
    seen_static = False
    for budget in (lo, (lo + full) // 2, full - (1 << 20)):
        s = _build(gguf, predictors, budget=budget)
        summary = s.offload.summary
        assert summary["mode"] == "disk"
        assert summary["resident_bytes"] <= budget
        got = _tokens(s)
        assert got == want, budget
        stats = s.offload.stats()
        assert stats["misses"] > 0 and stats["per_token"]["tokens"] > 0
        seen_static |= summary["static_neurons"] > 0
        del s
    assert seen_static
    assert _sha256(gguf) == before  # nothing written to the model file


@pytest.mark.slow
def test_a_fatrelu_model_runs_from_the_store_as_in_memory(model, tmp_path):
    """The store's layers apply a FATReLU model's per-layer gate thresholds (our GGUF key) as
    the in-memory model does: equal tokens, which differ from the same weights' plain ReLU."""
    from helpers_gguf_edit import rewrite
    from powerinfer_jax.checkpoint.gguf_arch import FATRELU_KEY

    gguf, predictors = model
    fat = rewrite(gguf, tmp_path / "fatrelu.gguf", set_keys={FATRELU_KEY: [0.2] * 4})
    plain = _tokens(_build(gguf, predictors))
    want = _tokens(_build(fat, predictors))
    s = _build(fat, predictors, budget=_minimum(gguf, predictors))  # the same tensors
    assert s.offload.summary["mode"] == "disk"
    assert s.config.fatrelu_thresholds == (0.2,) * 4 or np.allclose(s.config.fatrelu_thresholds,
                                                                     0.2)
    assert _tokens(s) == want != plain


def test_dense_mode_reads_every_neuron_and_matches(model):
    """The store's dense mode is the custom call over every neuron at threshold 0: the in-memory
    oracle mode's arithmetic (f32 down rows), not the in-memory dense matvec's (8-bit activations
    into ffn_down, as llama.cpp), so it gives the oracle run's tokens bitwise; the two in-memory
    paths round differently and may part on a random-weight model's near ties."""
    gguf, predictors = model
    want = _tokens(_build(gguf, predictors, mode="oracle"), 8)
    s = _build(gguf, predictors, mode="dense", budget=_minimum(gguf, predictors) + (1 << 20))
    assert _tokens(s, 8) == want
    st = s.offload.stats()
    # every call asks for every neuron of its layer
    assert st["requested"] == st["calls"] * s.config.d_ff


@pytest.mark.parametrize("policy,lookahead", [
    ("frequency", True), ("lru", True), pytest.param("lfu", False, marks=pytest.mark.slow),
    pytest.param("lru", False, marks=pytest.mark.slow)])
def test_every_policy_gives_the_same_tokens(model, policy, lookahead):
    gguf, predictors = model
    want = _tokens(_build(gguf, predictors), 8)
    s = _build(gguf, predictors, budget=_minimum(gguf, predictors) + (1 << 20), policy=policy,
               lookahead=lookahead)
    assert s.offload.summary["mode"] == "disk"
    assert _tokens(s, 8) == want
    assert s.offload.summary["policy"] == policy
    assert s.offload.summary["lookahead"] == lookahead
    st = s.offload.stats()
    # the next layer's guess is read ahead, and most of what it reads is then asked for
    assert (st["prefetched"] > 0 and st["prefetch_hits"] > st["prefetched"] // 2) if lookahead \
        else st["prefetched"] == 0


def test_budget_accounting_adds_up(model):
    """resident_bytes = the model's arrays (counted here from its state) + the KV cache + the
    store's slots and tables, and it fits the budget."""
    from flax import nnx

    gguf, predictors = model
    budget = _minimum(gguf, predictors) + (1 << 20)
    s = _build(gguf, predictors, budget=budget)
    summ = s.offload.summary
    assert summ["mode"] == "disk"
    arrays = sum(int(np.prod(v.get_value().shape)) * v.get_value().dtype.itemsize
                 for _, v in nnx.iter_graph(s.model) if isinstance(v, nnx.Variable)
                 and hasattr(v.get_value(), "dtype"))
    c = s.config
    kv = 2 * c.n_layers * MAX_SEQ * c.n_kv_heads * c.head_dim * 4  # float32 cache, batch 1
    assert summ["dense_bytes"] == arrays + kv - summ["file_view_bytes"]
    slots = summ["static_neurons"] + summ["cache_slots"]
    assert summ["resident_bytes"] == summ["dense_bytes"] + summ["table_bytes"] + \
        slots * summ["slot_bytes"]
    assert summ["resident_bytes"] <= budget
    # the store's arenas: its slots and (llama.cpp's GGUF: down groups) the scale planes
    assert summ["planes_bytes"] > 0
    assert s.offload.stats()["resident_bytes"] == slots * summ["slot_bytes"] + summ["planes_bytes"]
    assert summ["copied_from_file_bytes"] >= 0


def test_budget_below_the_minimum_names_it(model, monkeypatch):
    """Below the tensors that stay in memory: refused from the file's header before anything
    loads; between that and the full minimum: refused once built, naming the minimum."""
    import powerinfer_jax.checkpoint as checkpoint

    gguf, predictors = model
    resident = sum(t.n_bytes for t in GGUFFile(gguf).tensors
                   if t.name.rsplit(".", 2)[-2] not in ("ffn_gate", "ffn_up", "ffn_down"))
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("loaded"))
        with pytest.raises(UserError, match=r"--ram-budget: expected at least [0-9.]+ GiB "
                                            rf"\({resident} bytes of tensors that stay in memory"):
            _build(gguf, predictors, budget=resident - 1)
    with pytest.raises(UserError, match=r"--ram-budget: expected at least [0-9.]+ GiB \(\d+ "
                                        r"bytes: the dense parts"):
        _build(gguf, predictors, budget=resident)
    lo = _minimum(gguf, predictors)
    assert _build(gguf, predictors, budget=lo).offload.summary["mode"] == "disk"
    with pytest.raises(UserError, match="expected at least"):
        _build(gguf, predictors, budget=lo - 1)


def test_header_check_counts_powerinfer_down_rows_as_ffn(model):
    """A PowerInfer GGUF stores the down projection as ffn_down_t [F, D]: an FFN matrix the store
    keeps on disk like llama.cpp's ffn_down, so the header's minimum leaves it out (counted as
    resident it would refuse budgets the store serves)."""
    from powerinfer_jax.runtime.offload import check_budget_from_header

    _, predictors = model
    tensors = GGUFFile(predictors).tensors
    assert any(t.name.endswith("ffn_down_t.weight") for t in tensors)
    ffn = ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t")
    resident = sum(t.n_bytes for t in tensors if t.name.rsplit(".", 2)[-2] not in ffn)
    check_budget_from_header(predictors, resident)  # enough: no error
    with pytest.raises(UserError, match=rf"\({resident} bytes of tensors that stay in memory"):
        check_budget_from_header(predictors, resident - 1)


def test_a_corrupt_file_under_a_budget_is_the_loaders_one_line_error(model, tmp_path):
    """The header check reads the file as the loader does: a damaged GGUF is a UserError that
    names the file, not a parser's traceback."""
    gguf, predictors = model
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(UserError, match=r"bad\.gguf"):
        _build(str(bad), predictors, budget=1 << 30)


@pytest.mark.parametrize("which", ["gguf", "powerinfer"])
def test_a_budget_that_holds_the_model_runs_it_in_memory(model, which):
    """The rule (runtime/offload.py fits_in_memory): a budget of the model's bytes (its tensors,
    predictors included, and the KV cache) loads it in memory, one byte less offloads its FFN;
    the bytes counted are at least the arrays the model then holds."""
    from flax import nnx

    gguf, predictors = model
    if which == "powerinfer":
        gguf = predictors
    s = _build(gguf, predictors, budget=1 << 40)
    assert s.offload.summary["mode"] == "memory" and s.offload.store is None
    assert s.describe()["offload"]["mode"] == "memory"
    need = s.offload.summary["resident_bytes"]
    c = s.config
    arrays = sum(int(np.prod(v.get_value().shape)) * v.get_value().dtype.itemsize
                 for _, v in nnx.iter_graph(s.model) if isinstance(v, nnx.Variable)
                 and hasattr(v.get_value(), "dtype"))
    kv = 2 * c.n_layers * MAX_SEQ * c.n_kv_heads * c.head_dim * 4  # float32 cache, batch 1
    assert arrays + kv <= need
    del s
    assert _build(gguf, predictors, budget=need).offload.summary["mode"] == "memory"
    assert _build(gguf, predictors, budget=need - 1).offload.summary["mode"] == "disk"


def test_a_budget_that_holds_the_model_keeps_its_compiled_steps(model, tmp_path, monkeypatch):
    """In memory, a budgeted run's steps are the unbudgeted run's: a second run loads them
    instead of compiling (XLA's compile memory came on top of the model's at every run) and
    gives the same tokens; a run that offloads compiles its own (its store's handle is in them)."""
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    gguf, predictors = model
    first = _build(predictors, predictors, budget=1 << 40)
    tokens = _tokens(first)
    assert first.engine.compile_count > 0 and first.store is not None
    del first
    again = _build(predictors, predictors, budget=1 << 40)
    assert _tokens(again) == tokens
    assert (again.engine.compile_count, again.engine.loaded_count) == (0, 2)
    del again
    need = _build(predictors, predictors, budget=1 << 40).offload.summary["resident_bytes"]
    offloaded = _build(predictors, predictors, budget=need - 1)
    assert offloaded.offload.summary["mode"] == "disk" and offloaded.store is None


def test_modes_that_read_rows_are_refused(model):
    gguf, predictors = model
    lo = _minimum(gguf, predictors)
    with pytest.raises(UserError, match="--sparsity with --ram-budget: expected one of"):
        _build(gguf, predictors, budget=lo, mode="threshold")


# ------------------------------------------------------------------------------------ bundle files
def _bundle(gguf):
    from powerinfer_jax.checkpoint import bundles

    return bundles.candidates(gguf)[0]


@pytest.mark.slow
def test_bundle_from_another_model_or_damaged_is_rebuilt(model, other_model, capsys):
    import shutil

    from powerinfer_jax.checkpoint import bundles, load_checkpoint

    gguf = model[0]
    ck = load_checkpoint(gguf, keep_quantized=True)
    for p in bundles.candidates(gguf):  # an earlier test's file has its frequencies' order:
        p.unlink(missing_ok=True)  # each rebuild below is made as this one, without them
    path, spec, order = bundles.ensure(ck, progress=False)
    good = open(path, "rb").read()
    other = load_checkpoint(other_model, keep_quantized=True)
    other_path = bundles.ensure(other, progress=False)[0]
    cases = {
        "another model": lambda: shutil.copyfile(other_path, path),
        "truncated": lambda: open(path, "r+b").truncate(len(good) - 512),
        "header": lambda: open(path, "r+b").write(
            b"PIJNEURB" + bundles.VERSION.to_bytes(4, "little") + b"\x10\x00\x00\x00"),
        "not a bundle file": lambda: open(path, "wb").write(b"GGUF" + bytes(100)),
    }
    cases["an older format"] = lambda: open(path, "r+b").write(b"PIJNEURB\x01\x00\x00\x00")
    notes = {"another model": "for another model", "truncated": "truncated",
             "an older format": "format version 1, this build reads 2",
             "header": "header checksum mismatch", "not a bundle file": "not a neuron bundle"}
    for name, damage in cases.items():
        damage()
        capsys.readouterr()
        path2, spec2, order2 = bundles.ensure(ck, progress=False)
        err = capsys.readouterr().err
        assert notes[name] in err, (name, err)
        assert path2 == path and spec2 == spec and np.array_equal(order2, order)
        assert open(path, "rb").read() == good, name  # rebuilt to the same bytes
    with pytest.raises(bundles.BundleError, match="truncated"):
        open(path, "r+b").truncate(len(good) - 1)
        bundles.read_header(path)
    bundles.ensure(ck, progress=False)


def test_unwritable_model_dir_falls_back_to_the_cache_dir(model, tmp_path, monkeypatch, capsys):
    """A model directory that refuses the file (EACCES: root ignores mode bits, so the write is
    made to fail) -> the cache directory; both refusing (a full disk) -> one-line UserError."""
    import errno
    import shutil

    from powerinfer_jax.checkpoint import bundles, load_checkpoint

    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ro"
    src.mkdir()
    gguf = src / "m.gguf"
    shutil.copyfile(model[0], gguf)
    ck = load_checkpoint(str(gguf), keep_quantized=True)
    real = bundles._write_file

    def refuse_model_dir(dest, *a, **k):
        if dest.parent == src:
            raise PermissionError(errno.EACCES, "Permission denied", str(dest))
        return real(dest, *a, **k)

    monkeypatch.setattr(bundles, "_write_file", refuse_model_dir)
    path, spec, _ = bundles.ensure(ck, progress=False)
    assert path.parent == tmp_path / "cache" / "neurons"
    assert f"cannot write the neuron bundle file in {src}" in capsys.readouterr().err
    # nothing left in the model's directory but the build lock
    assert sorted(p.name for p in src.iterdir()) == [".m.gguf.pij-neurons.lock", "m.gguf"]
    path.unlink()

    class Usage:
        free = 0

    monkeypatch.setattr(bundles, "_write_file", real)
    monkeypatch.setattr(bundles.shutil, "disk_usage", lambda p: Usage())
    with pytest.raises(UserError) as e:
        bundles.ensure(ck, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--ram-budget neuron bundle file: expected a "
                                              "writable directory with room for")
    assert str(src) in msg and "bytes needed" in msg


@pytest.mark.slow
def test_two_processes_building_at_once(model, tmp_path):
    """The second process waits on the build lock, then reuses the first's file."""
    import shutil

    from powerinfer_jax import cache
    from powerinfer_jax.checkpoint import bundles, load_checkpoint

    gguf = tmp_path / "m.gguf"
    shutil.copyfile(model[0], gguf)
    path = bundles.candidates(gguf)[0]
    script = textwrap.dedent(f"""
        from powerinfer_jax.checkpoint import bundles, load_checkpoint
        ck = load_checkpoint({str(gguf)!r}, keep_quantized=True)
        print(bundles.ensure(ck, progress=False)[0])
    """)
    with cache.lock(path):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        # the child reaches the lock while this process holds it and builds meanwhile
        import time

        deadline = time.time() + 120
        while not any("waiting for another process" in line for line in
                      _peek(child)) and time.time() < deadline:
            time.sleep(0.2)
        ck = load_checkpoint(str(gguf), keep_quantized=True)
        got = bundles.ensure(ck, progress=False)[0]
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert out.strip() == str(got) == str(path)
    assert "waiting for another process" in _PEEKED[id(child)] + err
    assert "writing the neuron bundle file" not in _PEEKED[id(child)] + err  # it reused
    bundles.read_header(path)


_PEEKED: dict[int, str] = {}


def _peek(child) -> list[str]:
    """Lines the child wrote to stderr so far (non-blocking)."""
    import os
    import select

    buf = _PEEKED.setdefault(id(child), "")
    fd = child.stderr.fileno()
    os.set_blocking(fd, False)
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk.decode(errors="replace")
    os.set_blocking(fd, True)
    _PEEKED[id(child)] = buf
    return buf.splitlines()


def test_store_rejects_bad_tables(model):
    from powerinfer_jax.checkpoint import bundles, load_checkpoint
    from powerinfer_jax.ops.neuron_store import NeuronStore

    ck = load_checkpoint(model[0], keep_quantized=True)
    path, spec, order = bundles.ensure(ck, progress=False)
    L, F = spec.n_layers, spec.n_neurons
    cold = np.zeros((L, F), bool)
    with pytest.raises(ValueError, match=r"cache_slots: expected at least 4096"):
        NeuronStore(path, spec, order, cold, cache_slots=F - 1)
    bad = np.array(order)
    bad[0, 0] = bad[0, 1]
    with pytest.raises(ValueError, match=r"position\[0\]: expected a permutation"):
        NeuronStore(path, spec, bad, cold, cache_slots=F)
    import dataclasses

    # (one more layer's planes too: the data starts a stride later)
    longer = dataclasses.replace(spec, n_layers=L + 1,
                                 data_offset=spec.data_offset + spec.planes_stride)
    with pytest.raises(ValueError, match="truncated"):
        NeuronStore(path, longer, np.concatenate([order, order[:1]]), np.zeros((L + 1, F), bool),
                    cache_slots=F)


# ------------------------------------------------------------------------------------ reporting
@pytest.mark.slow
def test_json_and_metrics_report_the_store(model, capsys):
    from prometheus_client import CollectorRegistry, generate_latest

    from powerinfer_jax import generate
    from powerinfer_jax.server.offload_metrics import OffloadCollector

    gguf, predictors = model
    lo = _minimum(gguf, predictors)
    generate.main(["--model", gguf, "--sparsity", "powerinfer", "--predictors", predictors,
                   "--prompt", "Hello there", "--max-new-tokens", "6", "--max-seq-len",
                   str(MAX_SEQ), "--ram-budget", str(lo / GIB * 1.01), "--json", "--no-stream"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    off = row["offload"]
    assert off["mode"] == "disk" and 0 <= off["stats"]["hit_rate"] <= 1
    assert off["stats"]["per_token"]["tokens"] > 0 and off["stats"]["per_token"]["bytes_read"] > 0
    s = _build(gguf, predictors, budget=lo)
    _tokens(s, 4)
    reg = CollectorRegistry()
    reg.register(OffloadCollector(s.offload))
    text = generate_latest(reg).decode()
    for name in ("pij_neuron_misses_total", "pij_neuron_hit_rate",
                 "pij_neuron_read_bytes_per_token", "pij_neuron_read_bytes_total"):
        assert name in text


def test_a_budget_check_does_not_make_deferred_blocks():
    """fits_in_memory sums the checkpoint's bytes from shapes and types: a deferred tensor (Q/K
    rows in RoPE order, made on first use) is not made by it (that copy, ~600 MB on a 7B, set a
    --ram-budget run's peak above the in-memory run's)."""
    from powerinfer_jax.checkpoint.base import DeferredQuantTensor, QuantTensor

    def never():
        raise AssertionError("the blocks were made")

    t = DeferredQuantTensor(never, "Q4_0", (96, 64))
    assert t.nbytes == 96 * 2 * 18
    stacked = QuantTensor(np.zeros((3, 64, 4 * 34), np.uint8), "Q8_0", (3, 128, 64),
                          transposed=True)  # experts' down: stored [E, D=64, F=128]
    assert stacked.nbytes == stacked.blocks.nbytes
