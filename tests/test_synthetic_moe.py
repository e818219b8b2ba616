"""The synthetic MoE generator (powerinfer_jax/synthetic/moe*.py): the router's calibration,
the prescribed routing on held-out text, the file (our loader and llama.cpp's), ReLU experts'
neuron sparsity, and bad input. Tiny shapes; the OLMoE-shaped figures are benchmark rows."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import helpers_llamacpp as llamacpp
from helpers_tolerances import assert_close
from powerinfer_jax.synthetic.build import _column_quantiles
from powerinfer_jax.synthetic.moe_build import MAX_SWEEPS, _quantile, route, router_bias
from powerinfer_jax.synthetic.profile import Locality, power_law

VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki.valid.txt"
TINY = ["--d-model", "128", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
        "--head-dim", "32", "--d-ff", "96", "--n-experts", "16", "--top-k", "4"]


def _run(out, *args):
    from powerinfer_jax.synthetic.moe import main

    main([*TINY, *args, "--out", str(out)])
    return json.loads((out / "synthetic.json").read_text())


def test_router_bias_routes_each_expert_to_its_frequency():
    rng = np.random.default_rng(3)
    n, e, k = 2000, 24, 3
    scores = rng.standard_normal((n, e)).astype(np.float32)
    x0 = rng.uniform(2.0, 4.0, n).astype(np.float32)  # the bias dim: positive, varying
    freq = power_law(e, Locality(1 - k / e, 0.25, 0.7))
    freq *= k / freq.sum()
    b, sweeps = router_bias(scores, x0, freq, k)
    got = np.bincount(route(scores + b * x0[:, None], k).ravel(), minlength=e) / n
    assert np.abs(got - freq).max() * n <= 1.0 + 1e-9 and sweeps < 60


def _routing_case(n, e, k, seed, x0_range=(2.0, 4.0), words=None):
    rng = np.random.default_rng(seed)
    if words is None:  # every token its own scores
        scores = rng.standard_normal((n, e)).astype(np.float32)
    else:  # as text: a few words' scores, repeated, near but not at ties (other positions)
        ids = np.minimum(rng.zipf(1.3, n), words) - 1
        scores = rng.standard_normal((words, e))[ids] + 0.1 * rng.standard_normal((n, e))
        scores = scores.astype(np.float32)
    x0 = rng.uniform(*x0_range, n).astype(np.float32)  # the bias dim: positive, varying
    freq = power_law(e, Locality.feasible(1 - k / e, 0.25, 0.8))
    freq = (freq * (k / freq.sum()))[rng.permutation(e)]  # as routing_frequencies
    return scores, x0, freq


def _routing_error(scores, x0, freq, k, b):
    n, e = scores.shape
    got = np.bincount(route(scores + b * x0[:, None], k).ravel(), minlength=e) / n
    return np.abs(got - freq).max() * n  # in tokens


def _recomputing_router_bias(scores, x0, freq, k):
    """router_bias as first written: every step recomputes all logits and partitions them
    without column j (O(N E^2) a sweep), the oracle of the incremental one."""
    n, e = scores.shape
    b = np.zeros(e, np.float32)
    for sweep in range(1, MAX_SWEEPS + 1):
        for j in range(e):
            logits = scores + b[None, :] * x0[:, None]
            others = np.delete(logits, j, axis=1)
            kth = np.partition(others, e - 1 - k, axis=1)[:, e - 1 - k]  # k-th largest
            b[j] = _column_quantiles(((kth - scores[:, j]) / x0)[:, None], freq[j:j + 1])[0]
        got = np.bincount(route(scores + b[None, :] * x0[:, None], k).ravel(), minlength=e) / n
        if np.max(np.abs(got - freq)) * n <= 1.0 + 1e-9:
            return b, sweep
    return b, MAX_SWEEPS


@pytest.mark.parametrize("n,e,k,words", [(1000, 24, 3, None), (600, 16, 1, None),
                                         (600, 12, 11, None), (1500, 64, 8, None),
                                         (2000, 32, 4, 100)])
def test_router_bias_is_the_recomputing_one_bit_for_bit(n, e, k, words):
    # the logits and each token's top k+1 kept up to date give the biases (and the sweeps)
    # that recomputing everything for every step gives
    scores, x0, freq = _routing_case(n, e, k, seed=e, words=words)
    b, sweeps = router_bias(scores, x0, freq, k)
    want, want_sweeps = _recomputing_router_bias(scores, x0, freq, k)
    assert sweeps == want_sweeps and b.dtype == want.dtype and np.array_equal(b, want)


def test_router_bias_at_qwen3moe_router_shape_meets_the_one_token_rule_deterministically():
    # Qwen3-30B-A3B's router: 128 experts, top 8; x_0 about the generator's (C / rms)
    n, e, k = 2048, 128, 8
    scores, x0, freq = _routing_case(n, e, k, seed=11, x0_range=(5.0, 8.0))
    b, sweeps = router_bias(scores, x0, freq, k)
    assert _routing_error(scores, x0, freq, k, b) <= 1.0 + 1e-9 and sweeps < MAX_SWEEPS
    b2, sweeps2 = router_bias(scores, x0, freq, k)  # the same inputs: the same biases
    assert sweeps2 == sweeps and np.array_equal(b2, b)


def test_one_column_quantile_is_column_quantiles():
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 100):
        w = rng.standard_normal(n).astype(np.float32)
        for p in (0.0, 1e-9, 0.5 / n, 1.5 / n, 0.3, 0.5, 1 - 0.5 / n, 1.0, *rng.uniform(0, 1, 5)):
            got, want = _quantile(w, p), _column_quantiles(w[:, None], np.array([p]))[0]
            assert got.dtype == want.dtype and got == want, (n, p)


@pytest.fixture(scope="module")
def silu_model(tmp_path_factory):
    if not VALID.is_file():
        pytest.skip(f"{VALID} not present (shared data folder): the held-out check needs it")
    out = tmp_path_factory.mktemp("synthetic_moe")
    return out, _run(out, "--calib-tokens", "4096", "--verify-tokens", "2048", "--seed", "7")


@pytest.mark.slow
def test_routing_holds_on_held_out_text(silu_model):
    out, record = silu_model
    z = np.load(out / "frequencies.npz")
    n = record["calib_tokens"]
    assert np.allclose(z["prescribed"].sum(axis=1), 4)  # k per token
    # set to one token; the router as stored sums x . r in another order: a near tie may flip
    assert np.abs(z["calibrated"] - z["prescribed"]).max() <= 2.0 / n
    check = record["verify"]
    # measured by the engine (Q4_0 blocks, int8 activations) on wiki.valid, held out
    assert check["hot_share_measured"] == pytest.approx(0.8, abs=0.03)
    # 32 experts in all, 3 a decile: the hot deciles hold; the coldest (~40 routings each in
    # 2048 tokens at D = 128) carry Poisson noise and a tail the calibration text saw less of
    errors = [abs(d["relative_error"]) for d in check["deciles"]]
    assert max(errors[:5]) < 0.1 and max(errors) < 0.7, check["deciles"]


@pytest.mark.slow
def test_the_file_is_an_olmoe_gguf_llamacpp_runs(silu_model):
    from powerinfer_jax.checkpoint import load_checkpoint

    out, record = silu_model
    path = Path(record["file"])
    c = load_checkpoint(path, keep_quantized=True).config
    assert (c.n_experts, c.n_experts_used, c.d_ff, c.qk_norm_full) == (16, 4, 96, True)
    assert c.vocab_size == 50304  # OLMoE's, the tokenizer's padded
    bench = llamacpp.binary("llama-bench")
    if bench is None:
        pytest.skip("no llama-bench (benchmarks/build_llama_bench_cpu.sh)")
    r = subprocess.run([str(bench), "-m", str(path), "-p", "0", "-n", "4", "-t", "1", "-r", "1",
                        "-o", "jsonl"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert "olmoe" in row["model_type"] and row["avg_ts"] > 0


@pytest.mark.slow
def test_relu_experts_fire_with_the_prescribed_sparsity(tmp_path):
    if not VALID.is_file():
        pytest.skip(f"{VALID} not present")
    record = _run(tmp_path, "--activation", "relu", "--sparsity", "0.8", "--calib-tokens",
                  "4096", "--verify-tokens", "512")
    assert record["calibrated_neuron_sparsity"] == pytest.approx(0.8, abs=0.01)
    assert record["verify"]["neuron_sparsity"] == pytest.approx(0.8, abs=0.03)
    # the model's experts run sparse inside (up rows and down groups of the neurons whose gate
    # fires) and give the dense logits: every expert, every neuron (the jnp reference)
    import jax.numpy as jnp

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params

    ck = load_checkpoint(Path(record["file"]), keep_quantized=True)
    model = from_params(ck.config, ck.params, dtype=jnp.float32, kernels="auto")
    assert model.layers[0].ffn.experts.down_t.layout == "groups"
    assert model.layers[0].ffn.experts.up.layout == "rows"
    tokens = jnp.asarray(np.arange(100, 124, dtype=np.int32)[None])
    sparse = np.asarray(model(tokens))
    for layer in model.layers:
        layer.ffn.set_execution("dense")
    assert_close(sparse, np.asarray(model(tokens)), "quantized_model")


@pytest.mark.slow
def test_qwen3moe_shape_writes_and_loads(tmp_path):
    from powerinfer_jax.checkpoint import load_checkpoint

    record = _run(tmp_path, "--shape", "qwen3-30b-a3b", "--n-kv-heads", "2", "--vocab-size", "0",
                  "--calib-tokens",
                  "1024", "--verify-tokens", "0")
    c = load_checkpoint(Path(record["file"]), keep_quantized=True).config
    assert c.qk_norm and c.norm_topk_prob and (c.n_experts, c.n_experts_used) == (16, 4)


@pytest.mark.parametrize("args,message", [
    (["--top-k", "20"], "--top-k: expected an integer in [1, --n-experts=16]"),
    (["--activation", "relu", "--sparsity", "1.5"], "--sparsity: expected a number in (0, 1)"),
    (["--activation", "relu"], "--sparsity: expected a number in (0, 1) with --activation relu"),
    (["--sparsity", "0.9"], "--sparsity: expected only with --activation relu"),
    (["--d-model", "100"], "--d-model: expected a multiple of 32"),
    (["--d-ff", "80"], "--d-ff: expected a multiple of 32"),
    (["--hot-share", "0.1"], "--hot-share: expected >= --hot-fraction"),
    (["--n-kv-heads", "2"], "--n-kv-heads: expected --n-heads"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "powerinfer_jax.synthetic.moe", *TINY, *args,
                        "--verify-tokens", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert message in r.stderr.strip().splitlines()[-1]
