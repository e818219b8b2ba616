"""MoE placement (issue 35 item 3): under --vram-budget the most frequently routed experts of
each layer are kept as floats for the accelerator and the others stay as the file's blocks for
the host pool's custom call (models/moe.py permute/split, sparsity/placement.py with experts
for items, runtime/vram_budget.py profiling the routers on the calibration corpus). On a CPU-only
machine both parts run on the CPU: the same code, checked here on tiny synthetic MoE files
(the generator's prescribed power law across experts) and on a float MoE layer:

  * a placed layer's output equals the unplaced one (float experts: to summation order);
  * the file with no hot expert equals the unplaced file (its greedy tokens too); every expert
    hot equals the file with float experts; a mix lies within the activation rounding of the
    part that moved and reports routed ids in the file's numbering;
  * the hot experts are the most frequently routed ones (the profile is kept and reused), the
    served share follows the power law, cold experts stay as blocks;
  * the host store an accelerator uses (cold blocks out of the model's state, run through a host
    callback) gives the inline placement's logits and tokens, jitted too, and is released with
    the model; on an accelerator everything but the experts is dequantized at load;
  * float experts (F32, F16, BF16) in the host store run there too (XLA on the CPU);
  * bad input: a budget below the dense parts, a bad permutation, hot count or store, devices
    with a budget: one-line errors; a damaged kept profile is named and measured again.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_tolerances import assert_close
from powerinfer_jax.models.moe import MoE
from powerinfer_jax.models.transformer import capture

D, F, E = 24, 40, 7
TINY = ["--d-model", "128", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4",
        "--head-dim", "32", "--d-ff", "96", "--n-experts", "16", "--top-k", "4"]
TOKENS = list(range(100, 124))


def _moe(shared=0, seed=0):
    return MoE(d_model=D, d_ff=F, n_experts=E, n_used=2, norm_topk_prob=True,
               activation="silu", d_ff_shared=shared, dtype=jnp.float32,
               rngs=nnx.Rngs(seed), kernels="xla")


@pytest.mark.parametrize("shared", [0, 16])
@pytest.mark.parametrize("n_hot", [0, 3, 7])
@pytest.mark.parametrize("tokens", [(1, 1), (2, 3), (2, 20)])  # pairs one by one; gathered
def test_a_placed_float_layer_gives_the_unplaced_output(shared, n_hot, tokens):
    m = _moe(shared)
    x = jax.random.normal(jax.random.key(3), tokens + (D,))
    want = np.asarray(nnx.jit(lambda m, x: m(x))(m, x))
    m.permute(np.random.default_rng(n_hot).permutation(E))
    m.split(n_hot)
    assert (m.n_hot, m.n_cold) == (n_hot, E - n_hot)
    assert_close(nnx.jit(lambda m, x: m(x))(m, x), want, "regrouped")
    m.set_execution("dense")  # the reference execution places the same way
    assert_close(m(x), want, "regrouped")


def test_bad_permutations_and_hot_counts_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"MoE.permute order: expected a permutation of "
                                         r"range\(7\), got 'shape \(6,\)'"):
        _moe().permute(np.arange(6))
    with pytest.raises(ValueError, match=r"MoE.split n_hot: expected an integer in \[0, 7\]"):
        _moe().split(8)
    m = _moe()
    m.split(3)
    with pytest.raises(ValueError, match=r"MoE.split n_hot: .*placed=True"):
        m.split(3)
    with pytest.raises(ValueError, match=r"MoE.permute: expected an unsplit MoE layer"):
        m.permute(np.arange(E))
    with pytest.raises(ValueError, match=r"MoE.split store: expected 'auto', 'operands' or "
                                         r"'host', got 'disk'"):
        _moe().split(3, store="disk")
    # on an accelerator the cold experts go to the host store: float experts too (below)
    m = _moe()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    m.split(3)
    assert m.host_handle is not None
    _moe().split(E)  # every expert on the device: nothing runs on the host


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tokens", [(1, 1), pytest.param((2, 3), marks=pytest.mark.slow),
                                    (2, 20)])
def test_float_cold_experts_run_from_the_host_store(dtype, tokens):
    """An F32/F16/BF16 file's cold experts in the host store an accelerator uses (kept in the
    model's dtype, run by XLA on the CPU through the host callback) give the inline placement's
    output: the GPU check's F16 file, dry-run on the CPU."""
    def placed(store):
        m = MoE(d_model=D, d_ff=F, n_experts=E, n_used=2, norm_topk_prob=True,
                activation="silu", d_ff_shared=16, dtype=dtype, rngs=nnx.Rngs(0), kernels="xla")
        m.split(3, store=store)
        return m

    host, inline = placed("host"), placed("operands")
    assert host.host_handle is not None and host.experts.gate.weight[...].shape[0] == 0
    x = jax.random.normal(jax.random.key(5), tokens + (D,))
    want = nnx.jit(lambda m, x: m(x))(inline, x)
    assert_close(nnx.jit(lambda m, x: m(x))(host, x), want, "regrouped")


# ------------------------------------------------------------------ tiny synthetic MoE files
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from powerinfer_jax.synthetic.moe import main

    out = {}
    for act, extra in (("silu", []), ("relu", ["--activation", "relu", "--sparsity", "0.8"])):
        d = tmp_path_factory.mktemp(f"moe_{act}")
        main([*TINY, *extra, "--calib-tokens", "1024", "--verify-tokens", "0", "--seed", "5",
              "--out", str(d)])
        out[act] = Path(json.loads((d / "synthetic.json").read_text())["file"])
    return out


def _load(path, **kw):
    import powerinfer_jax as pij

    return pij.load(str(path), progress=False, **kw)


def _budget_gib(s, n_experts):
    """A budget holding the dense parts and n_experts experts of each layer."""
    return (s.dense + n_experts * sum(s.neuron_bytes) + 4096) / (1 << 30)


@pytest.fixture(scope="module")
def sizes(files):
    """The tiny files' bytes as placement counts them (the two files share their shapes)."""
    return _load(files["silu"], vram_budget=1.0).session.placement.sizes


def _float_experts(path, tokens):
    """Logits of the file with its experts dequantized to float32 and everything else kept as
    blocks (an unplaced model: what a placement holding every expert computes)."""
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.checkpoint.base import QuantTensor
    from powerinfer_jax.models.transformer import from_params

    ck = load_checkpoint(path, keep_quantized=True)
    params = {k: v.dequantize() if ".ffn.experts." in k and isinstance(v, QuantTensor) else v
              for k, v in ck.params.items()}
    model = from_params(ck.config, params, dtype=jnp.float32, kernels="auto")
    return np.asarray(model(jnp.asarray([tokens])))


@pytest.mark.slow  # ~12 s; the placed file's other checks (hot experts, budgets) stay fast
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_placed_file_logits_and_tokens(files, sizes, act):
    path = files[act]
    unplaced = _load(path)
    want = unplaced.logits(TOKENS)
    want_text = unplaced.generate("The capital of France is", max_new_tokens=16).text
    # no hot expert: every routed expert through the same custom call as unplaced
    cold = _load(path, vram_budget=_budget_gib(sizes, 0))
    assert cold.session.placement.hot == (0, 0)
    assert_close(cold.logits(TOKENS), want, "moe_quantized")
    assert cold.generate("The capital of France is", max_new_tokens=16).text == want_text
    # every expert hot: the file's experts as floats, the rest as the file's blocks
    hot = _load(path, vram_budget=1.0)
    assert hot.session.placement.hot == (16, 16)
    assert_close(hot.logits(TOKENS)[None], _float_experts(path, TOKENS), "moe_dense_execution")
    # a mix: within the activation rounding of what moved. Which experts are hot follows the
    # profile of the calibration text at hand, so a near-tied top logit of these random weights
    # may flip at a position or two (a fresh clone profiled on other text did, at 1 of 24)
    mixed = _load(path, vram_budget=_budget_gib(sizes, 6))
    assert sum(mixed.session.placement.hot) == 12
    got = mixed.logits(TOKENS)
    assert_close(got, want, "moe_placed")
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    # routed ids are reported in the file's numbering (the profile reads them)
    toks = jnp.asarray([TOKENS])
    ids = [np.asarray(capture(lambda m, t: m(t), llm.session.model, toks)[1]["expert_ids"])
           for llm in (unplaced, mixed)]
    assert np.mean(ids[0] == ids[1]) > 0.98  # a near tie may flip under the other arithmetic


def test_the_hot_experts_are_the_most_routed(files, sizes):
    path = files["silu"]
    # an expert is the item: its three matrices as float32 (the model's dtype), 16 a layer
    assert sizes.d_ff == (16, 16) and sizes.neuron_bytes == (3 * 96 * 128 * 4,) * 2
    llm = _load(path, vram_budget=_budget_gib(sizes, 4))
    p = llm.session.placement
    kept = path.with_name(path.stem + ".sparsity") / "experts.npz"
    freq = np.load(kept)["frequency"]  # measured on the corpus by the model's routers
    prescribed = np.load(path.parent / "frequencies.npz")["prescribed"]
    assert freq.shape == prescribed.shape == (2, 16)
    np.testing.assert_allclose(freq.sum(axis=1), 4.0)
    for layer, (n_hot, order) in enumerate(zip(p.hot, p.order)):
        hot = set(order[:n_hot])
        assert hot == set(np.argsort(-freq[layer], kind="stable")[:n_hot])
        # the generator's power law: its hottest experts are the ones measured hottest
        assert len(hot & set(np.argsort(-prescribed[layer])[:n_hot + 2])) >= n_hot - 1
        ffn = llm.session.model.layers[layer].ffn
        assert ffn.hot.gate[...].dtype == jnp.float32 and ffn.hot.gate[...].shape[0] == n_hot
        assert ffn.experts.gate.qtype is not None  # cold experts: the file's blocks
    # 25% of the experts serve far more than 25% of the routings (hot share 0.8 prescribed)
    assert p.served_fraction > 0.5
    assert kept.is_file()
    again = _load(path, vram_budget=_budget_gib(sizes, 4)).session.placement
    assert again.order == p.order  # the kept profile gives the same placement


def test_bad_budgets_are_one_line_errors(files, sizes):
    with pytest.raises(ValueError, match=r"vram_budget: expected at least \d+ bytes .* to hold "
                                         r"the dense parts"):
        _load(files["silu"], vram_budget=(sizes.dense - (1 << 20)) / (1 << 30))
    from powerinfer_jax.config import PlacementConfig
    from powerinfer_jax.runtime.vram_budget import place_model

    model = _load(files["silu"]).session.model
    with pytest.raises(ValueError, match=r"--vram-budget with --devices: expected a dense "
                                         r"model .* got '16 experts over 2 devices'"):
        place_model(model, PlacementConfig(vram_budget_gib=1.0), kv_len=64,
                    model_fingerprint={}, artifacts_dir=None, cache_dir=None, shards=2)


def _placed_model(path, n_hot, store):
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.models.transformer import from_params

    ck = load_checkpoint(path, keep_quantized=True)
    model = from_params(ck.config, ck.params, dtype=jnp.float32, kernels="auto")
    for i, layer in enumerate(model.layers):
        layer.ffn.permute(np.random.default_rng(i).permutation(ck.config.n_experts))
        layer.ffn.split(n_hot, store=store)
    return model


@pytest.mark.slow  # ~14 s; test_float_cold_experts_run_from_the_host_store stays fast
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_the_host_store_gives_the_inline_placement(files, act):
    """What an accelerator runs (the cold experts' blocks in the host store, one host callback
    per layer and call) equals the CPU-only placement (the same custom call inline)."""
    import gc

    from powerinfer_jax.models import moe
    from powerinfer_jax.runtime.decode import Engine

    inline = _placed_model(files[act], 5, "operands")
    host = _placed_model(files[act], 5, "host")
    ffn = host.layers[0].ffn
    assert ffn.host_handle in moe._HOST and ffn.experts.gate.weight[...].shape[0] == 0
    toks = jnp.asarray([TOKENS])
    assert_close(host(toks), inline(toks), "moe_quantized")
    prompt = TOKENS[:7]
    want = Engine(inline, max_seq_len=64).generate(prompt, max_new_tokens=12, stop_ids=()).tokens
    got = Engine(host, max_seq_len=64).generate(prompt, max_new_tokens=12, stop_ids=()).tokens
    assert got == want
    handles = [layer.ffn.host_handle for layer in host.layers]
    del host, ffn
    gc.collect()
    assert not set(handles) & set(moe._HOST)


def test_an_accelerator_load_keeps_only_the_experts_as_blocks(files):
    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.checkpoint.base import QuantTensor
    from powerinfer_jax.runtime.ram_plan import floats_but_experts, is_moe_gguf

    assert is_moe_gguf(files["silu"]) and not is_moe_gguf(files["silu"].parent)
    ck = load_checkpoint(files["silu"], keep_quantized=True)
    floats_but_experts(ck)
    kinds = {name: isinstance(t, QuantTensor) for name, t in ck.params.items()}
    assert all(q == (".ffn.experts." in name) for name, q in kinds.items()), kinds
    assert sum(kinds.values()) == 3 * ck.config.n_layers


@pytest.mark.parametrize("damage", [pytest.param(b"not a zip file", marks=pytest.mark.slow),
                                    pytest.param("shape", marks=pytest.mark.slow), "nan"])
def test_a_damaged_expert_profile_is_measured_again(files, sizes, tmp_path, damage, capsys):
    """A kept experts.npz that is truncated, of another model's shape or not finite is named on
    stderr and measured again: the placement equals the one from a fresh profile."""
    import shutil

    path = tmp_path / files["silu"].name
    shutil.copy(files["silu"], path)
    want = _load(path, vram_budget=_budget_gib(sizes, 4)).session.placement.order
    kept = path.with_name(path.stem + ".sparsity") / "experts.npz"
    if damage == "shape":
        np.savez(kept, frequency=np.ones((3, 5)))
    elif damage == "nan":
        np.savez(kept, frequency=np.full((2, 16), np.nan))
    else:
        kept.write_bytes(damage)
    for stale in kept.parent.glob("placement*.json"):  # placements are cached by profile
        stale.unlink()
    capsys.readouterr()
    got = _load(path, vram_budget=_budget_gib(sizes, 4)).session.placement.order
    err = capsys.readouterr().err
    assert f"ignoring {kept}: expected finite frequencies >= 0 of shape (2, 16)" in err
    assert got == want
    assert np.load(kept)["frequency"].shape == (2, 16)  # measured again and kept
