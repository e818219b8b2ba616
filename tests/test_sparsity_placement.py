"""Placement: budget respected exactly, optimal vs brute force, deterministic, cache invalidation."""
import itertools

import numpy as np
import pytest
from flax import nnx

from powerinfer_jax.config import ModelConfig
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.sparsity import placement as pl
from powerinfer_jax.runtime.vram_budget import load_or_place

TINY = ModelConfig(arch="llama", vocab_size=53, d_model=12, n_layers=3, n_heads=2, n_kv_heads=1,
                   head_dim=6, d_ff=37, max_seq_len=16)


def sizes(neuron_bytes, d_ff, dense=100):
    n = len(neuron_bytes)
    return pl.ModelBytes(global_dense=dense, layer_dense=(0,) * n,
                         neuron_bytes=tuple(neuron_bytes), d_ff=tuple(d_ff))


def brute_force(freqs, s: pl.ModelBytes, budget):
    """Best served mass over every hot subset (any subset, not only prefixes) within the budget."""
    items = [(l, i) for l, f in enumerate(freqs) for i in range(f.size)]
    best = 0.0
    for mask in itertools.product((0, 1), repeat=len(items)):
        cost = s.dense + sum(s.neuron_bytes[l] for (l, _), m in zip(items, mask) if m)
        if cost <= budget:
            best = max(best, sum(freqs[l][i] for (l, i), m in zip(items, mask) if m))
    return best


def served(p, freqs):
    return sum(f[list(o[:h])].sum() for f, o, h in zip(freqs, p.order, p.hot))


@pytest.mark.parametrize("seed", range(6))
def test_equal_bytes_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    freqs = [rng.random(4), rng.random(3), rng.random(4)]
    s = sizes([10, 10, 10], [4, 3, 4])
    for budget in (100, 131, 155, 199, 300):
        p = pl.place_neurons(freqs, s, budget, cold_balance=None)
        assert served(p, freqs) == pytest.approx(brute_force(freqs, s, budget), abs=1e-12)
        assert p.device_bytes <= budget


@pytest.mark.parametrize("seed", range(6))
def test_unequal_bytes_within_one_neuron_of_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    freqs = [rng.random(4), rng.random(4), rng.random(3)]
    s = sizes([7, 13, 10], [4, 4, 3])
    for budget in (100, 121, 140, 163, 200):
        p = pl.place_neurons(freqs, s, budget, cold_balance=None)
        best = brute_force(freqs, s, budget)
        assert p.device_bytes <= budget
        assert served(p, freqs) >= best - max(f.max() for f in freqs) - 1e-12


def test_budget_respected_exactly_and_filled():
    rng = np.random.default_rng(1)
    freqs = [rng.random(37) for _ in range(3)]
    s = sizes([24, 24, 24], [37, 37, 37], dense=1000)
    for budget in (1000, 1023, 1024, 1000 + 24 * 50 + 5, 1000 + 24 * 111, 10 ** 6):
        p = pl.place_neurons(freqs, s, budget)
        assert p.device_bytes <= budget
        assert p.device_bytes + p.host_bytes == s.total
        # Not a byte more could fit: the leftover is smaller than one neuron, or all is hot.
        assert budget - p.device_bytes < 24 or sum(p.hot) == 111


def test_hot_and_cold_cover_every_neuron_once_and_hot_are_most_frequent():
    rng = np.random.default_rng(2)
    freqs = [rng.power(0.3, 37) for _ in range(3)]
    p = pl.place_neurons(freqs, sizes([24] * 3, [37] * 3), 100 + 24 * 40, cold_balance=None)
    for f, o, h in zip(freqs, p.order, p.hot):
        assert sorted(o) == list(range(37))
        hot, cold = set(o[:h]), set(o[h:])
        assert not hot & cold and len(hot | cold) == 37
        if h and h < 37:
            assert f[list(o[:h])].min() >= f[list(o[h:])].max()


def test_deterministic_and_hashable():
    rng = np.random.default_rng(3)
    freqs = [np.round(rng.random(37), 1) for _ in range(3)]  # many ties
    s = sizes([24] * 3, [37] * 3)
    a = pl.place_neurons(freqs, s, 100 + 24 * 30)
    b = pl.place_neurons([f.copy() for f in freqs], s, 100 + 24 * 30)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1


def test_cold_balance_caps_the_worst_layer():
    # Layer 0 is rare everywhere, layer 1 dense everywhere: the unconstrained optimum leaves all
    # of layer 2's cold work and none elsewhere; the cap spreads it.
    freqs = [np.full(10, 0.1), np.full(10, 0.9), np.full(10, 0.5)]
    s = sizes([10] * 3, [10] * 3, dense=0)
    free = pl.place_neurons(freqs, s, 150, cold_balance=None)
    capped = pl.place_neurons(freqs, s, 150, cold_balance=1.0)
    work = lambda p: [b * f[list(o[h:])].sum() for f, o, h, b in
                      zip(freqs, p.order, p.hot, s.neuron_bytes)]
    assert max(work(capped)) <= max(work(free))
    assert max(work(capped)) <= capped.cold_cap + 1e-9
    assert sum(capped.hot) == sum(free.hot) == 15
    assert served(free, freqs) >= served(capped, freqs)


def test_budget_too_small_for_dense_parts():
    s = sizes([24] * 3, [37] * 3, dense=5000)
    with pytest.raises(ValueError, match=r"vram_budget: expected at least 5000 bytes.*got 4999"):
        pl.place_neurons([np.ones(37)] * 3, s, 4999)
    with pytest.raises(ValueError, match="placement budget"):
        pl.place_neurons([np.ones(37)] * 3, s, -1)


def test_model_bytes_are_exact():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    s = pl.model_bytes(model, kv_len=16)
    params = nnx.state(model, nnx.Param)
    total = sum(v.size * v.dtype.itemsize for v in __import__("jax").tree.leaves(params))
    kv = 3 * 2 * 16 * 1 * 6 * 4
    assert s.total == total + kv
    assert s.neuron_bytes == (3 * 12 * 4,) * 3 and s.d_ff == (37,) * 3


def test_layers_mode_fills_whole_layers():
    # dense = 50 + 3 * 20 = 110; each whole FFN 20 bytes
    s = pl.ModelBytes(global_dense=50, layer_dense=(20, 20, 20), neuron_bytes=(2, 2, 2),
                      d_ff=(10, 10, 10))
    assert pl.place_layers(None, s, 110).hot == (0, 0, 0)
    p = pl.place_layers(None, s, 110 + 20 * 2 + 19)
    assert p.hot == (10, 10, 0) and p.device_bytes == 150 <= p.budget_bytes
    p = pl.place_layers(None, s, 10 ** 6)
    assert p.hot == (10, 10, 10) and p.device_bytes == s.total
    with pytest.raises(ValueError, match="dense parts"):
        pl.place_layers(None, s, 109)


def test_layers_and_hybrid_hold_the_same_device_bytes_for_a_budget():
    s = pl.ModelBytes(global_dense=50, layer_dense=(20, 20, 20), neuron_bytes=(2, 2, 2),
                      d_ff=(10, 10, 10))
    freqs = [np.linspace(1, 0, 10)] * 3
    for budget in (110, 131, 150, 170):
        lay, hyb = pl.place_layers(freqs, s, budget), pl.place_neurons(freqs, s, budget)
        assert lay.device_bytes <= budget and hyb.device_bytes <= budget
        assert budget - lay.device_bytes < 20 and budget - hyb.device_bytes < 2


def test_cache_invalidated_by_budget_model_or_stats(tmp_path):
    freqs = [np.linspace(0, 1, 37)] * 3
    s = sizes([24] * 3, [37] * 3)
    calls = []

    def run(budget, model="m1", f=freqs):
        key = pl.cache_key(model_fingerprint=model, mode="hybrid", budget_bytes=budget, sizes=s,
                           stats=pl.stats_fingerprint(f), cold_balance=2.0)
        return load_or_place(tmp_path, key, lambda: calls.append(1) or pl.place_neurons(f, s,
                                                                                       budget))

    p1, hit = run(1000)
    assert not hit and len(calls) == 1
    p2, hit = run(1000)
    assert hit and p2 == p1 and len(calls) == 1
    p3, hit = run(2000)  # budget changed
    assert not hit and p3.budget_bytes == 2000 and len(calls) == 2
    _, hit = run(2000, model="m2")  # model changed
    assert not hit and len(calls) == 3
    _, hit = run(2000, model="m2", f=[f[::-1].copy() for f in freqs])  # stats changed
    assert not hit and len(calls) == 4
