"""Mixture-of-experts families against transformers (issue 35): Mixtral, Qwen3-MoE, Qwen2-MoE
(shared expert) and OLMoE, tiny random models transformers builds here (helpers_moe.py), read

  * from the HF directory,
  * from the f32 GGUF llama.cpp's convert_hf_to_gguf.py writes from it (experts stacked as
    ffn_{gate,up,down}_exps, the router as ffn_gate_inp, the shared expert as *_shexp),
  * from that GGUF quantized to Q4_0 by llama-quantize (when a build is at hand), against
    transformers reading the same Q4_0 file (Qwen-MoE: the archs transformers' GGUF loader
    reads; Mixtral and OLMoE files it cannot read).

Logits equal transformers' within the families' tolerance (family_logits, helpers_tolerances.py)
at 24 positions of 2 sequences; greedy decoding equals transformers' over 32 steps; a batch of
prompts decoded together equals each decoded alone (the batch's tokens grouped by expert, a
single token's experts gathered). Bad input: a top-k larger than the number of experts, a
router whose shape does not match, mixed dense/MoE layers, each a one-line error.
"""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import helpers_families as fam  # noqa: E402
import helpers_moe as moe  # noqa: E402
from helpers_tolerances import assert_close  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.models.transformer import from_params  # noqa: E402
from powerinfer_jax.runtime.decode import Engine, Request  # noqa: E402

NAMES = list(moe.FAMILIES)
T = 24
pytestmark = pytest.mark.slow  # the four models and their GGUFs: ~1 min to build


@pytest.fixture(scope="module")
def built():
    """Each MoE family's HF directory and torch model, its f32 GGUF and Q4_0 GGUF (or why
    they are missing), built once per run for every worker."""
    return fam.built_set("moe-families", moe.FAMILIES, moe.build)


def tokens(name, built, batch=2):
    vocab = built["hf"][name].config.vocab_size
    return np.random.default_rng(len(name)).integers(10, vocab, size=(batch, T))


def ours(path, toks, **kwargs):
    ck = load_checkpoint(path, **kwargs)
    model = from_params(ck.config, ck.params)
    return np.asarray(model(jnp.asarray(toks))), ck, model


def assert_logits_close(got, want):
    assert np.abs(want).max() > 1.0
    assert_close(got, want, "family_logits")


EXPECTED = {  # what each family's config must say
    "mixtral": dict(n_experts=6, n_experts_used=2, norm_topk_prob=True, d_ff=96),
    "qwen3_moe": dict(n_experts=6, n_experts_used=2, norm_topk_prob=True, d_ff=96,
                      qk_norm=True),
    "qwen2_moe": dict(n_experts=6, n_experts_used=2, norm_topk_prob=False, d_ff=96,
                      d_ff_shared=128, qkv_bias=True),
    "olmoe": dict(n_experts=6, n_experts_used=2, norm_topk_prob=False, d_ff=96,
                  qk_norm_full=True),
}


@pytest.mark.parametrize("name", NAMES)
def test_hf_directory_logits_match_transformers(built, name):
    toks = tokens(name, built)
    got, ck, model = ours(built["dirs"][name], toks)
    for k, v in EXPECTED[name].items():
        assert getattr(ck.config, k) == v, k
    want = fam.hf_logits(built["hf"][name], toks)
    assert_logits_close(got, want)
    # the reference execution (every expert on every token) gives the same logits
    for layer in model.layers:
        layer.ffn.set_execution("dense")
    assert_close(model(jnp.asarray(toks)), got, "moe_dense_execution")


@pytest.mark.parametrize("name", NAMES)
def test_gguf_logits_match_transformers(built, name):
    if not built["gguf"]:
        pytest.skip(built["why_gguf"])
    toks = tokens(name, built)
    got, ck, _ = ours(built["gguf"][name], toks)
    want_cfg = load_checkpoint(built["dirs"][name]).config
    assert ck.config.norm_eps == pytest.approx(want_cfg.norm_eps, rel=1e-6)
    assert dataclasses.replace(ck.config, norm_eps=want_cfg.norm_eps) == want_cfg
    assert_logits_close(got, fam.hf_logits(built["hf"][name], toks))


def _blocks_match_their_reference(path, toks):
    """The runtime's default on a quantized file (attention, head and experts through the
    custom calls on the file's blocks, int8 activations). Each layer's experts custom call,
    on that layer's FFN inputs from the run, equals the op's jnp reference (every expert on
    every token): per token to float rounding, except where a hidden activation sits on an
    int8 rounding edge (the kernel's SiLU and XLA's differ in the last bit, so it can round
    one step apart: ~1e-2 of the output's range on that token). Returns the logits."""
    from powerinfer_jax.models.transformer import capture

    ck = load_checkpoint(path, keep_quantized=True)
    kinds = {type(v).__name__ for k, v in ck.params.items() if "experts" in k}
    assert kinds == {"QuantTensor"}, kinds
    model = from_params(ck.config, ck.params)
    logits, sown = capture(lambda m, t: m(t), model, jnp.asarray(toks))
    errs = []
    for layer, x in zip(model.layers, sown["ffn_in"]):
        got = np.asarray(layer.ffn(x))
        layer.ffn.kernels = "xla"  # the experts through ops.moe_ffn's reference
        want = np.asarray(layer.ffn(x))
        layer.ffn.kernels = "ffi"
        errs.append(np.abs(got - want).max(axis=-1) / np.abs(want).max())
    errs = np.stack(errs)  # [L, B, T]
    assert np.mean(errs < 1e-5) > 0.9 and errs.max() < 5e-2, errs
    return np.asarray(logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_quantized_gguf_matches_transformers_on_the_same_file(built, name):
    if not built["q"]:
        pytest.skip(built["why_q"])
    path = built["q"][name]
    cfg = transformers.AutoConfig.from_pretrained(built["dirs"][name])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        built["dirs"][name], gguf_file=str(path), dtype=torch.float32, config=cfg).eval()
    toks = tokens(name, built)
    want = fam.hf_logits(ref, toks)
    got, ck, _ = ours(path, toks)  # the file's blocks dequantized: transformers' weights
    assert_logits_close(got, want)
    # int8 activations move hidden states enough to flip a near-tied routing now and then: the
    # blocks path is checked against its own reference, and only loosely against transformers
    blocks = _blocks_match_their_reference(path, toks)
    assert np.mean(blocks.argmax(-1) == want.argmax(-1)) > 0.8


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_quantized_gguf_experts_are_the_files_values(built, name):
    """Mixtral's and OLMoE's Q4_0 files (transformers reads neither): each stacked expert
    tensor and the router, dequantized by us, equal the gguf package's own dequantization of
    the file's tensors (the f32 path of the same loader equals transformers: the tests above);
    the blocks path equals its jnp reference."""
    if not built["q"]:
        pytest.skip(built["why_q"])
    import gguf

    path = built["q"][name]
    ck = load_checkpoint(path)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    types = set()
    for i in range(ck.config.n_layers):
        for ours_name, file_name, swap in (("gate", "ffn_gate_exps", False),
                                           ("up", "ffn_up_exps", False),
                                           ("down_t", "ffn_down_exps", True)):
            t = tensors[f"blk.{i}.{file_name}.weight"]
            types.add(t.tensor_type.name)
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            want = np.swapaxes(want, -1, -2) if swap else want
            np.testing.assert_array_equal(ck.params[f"layers.{i}.ffn.experts.{ours_name}.weight"],
                                          want)
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        np.testing.assert_array_equal(ck.params[f"layers.{i}.ffn.router.weight"],
                                      gguf.quants.dequantize(router.data, router.tensor_type))
    assert types & {"Q4_0", "Q8_0", "Q4_1", "Q5_0", "Q6_K", "Q4_K"}, types
    _blocks_match_their_reference(path, tokens(name, built))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers(built, name):
    hf = built["hf"][name]
    prompt = tokens(name, built)[0, :7].tolist()
    want = fam.hf_greedy(hf, prompt, 32)
    ck = load_checkpoint(built["dirs"][name])
    got = Engine(from_params(ck.config, ck.params), max_seq_len=64).generate(
        prompt, max_new_tokens=32, stop_ids=()).tokens
    assert got == want


@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_batched_decode_equals_single(built, name):
    ck = load_checkpoint(built["dirs"][name])
    model = from_params(ck.config, ck.params)
    toks = tokens(name, built, batch=4)
    prompts = [toks[i, :n].tolist() for i, n in enumerate((5, 9, 3, 7))]
    alone = [Engine(model, max_seq_len=64).generate(p, max_new_tokens=12, stop_ids=()).tokens
             for p in prompts]
    together = Engine(model, max_seq_len=64, max_batch=4).run(
        [Request(p, 12) for p in prompts])
    assert [r.tokens for r in together] == alone


def test_batched_decode_equals_single_on_quantized_experts(built):
    """A Q4_0 file's experts through the custom call: a batch's tokens grouped by expert give
    each sequence the tokens it gets alone (the row products do not depend on the batch)."""
    if not built["q"]:
        pytest.skip(built["why_q"])
    ck = load_checkpoint(built["q"]["qwen2_moe"], keep_quantized=True)
    model = from_params(ck.config, ck.params)
    toks = tokens("qwen2_moe", built, batch=4)
    prompts = [toks[i, :n].tolist() for i, n in enumerate((5, 9, 3, 7))]
    alone = [Engine(model, max_seq_len=64).generate(p, max_new_tokens=12, stop_ids=()).tokens
             for p in prompts]
    together = Engine(model, max_seq_len=64, max_batch=4).run(
        [Request(p, 12) for p in prompts])
    assert [r.tokens for r in together] == alone


def test_fused_expert_tensors_read_as_per_expert_ones(built, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2F, D], down_proj
    [E, D, F]) in a safetensors file gives the same model as the per-expert tensors."""
    from safetensors.numpy import load_file, save_file

    src = built["dirs"]["qwen3_moe"]
    d = _copy_dir(src, tmp_path / "fused")
    tensors = load_file(str(src / "model.safetensors"))
    cfg = load_checkpoint(src).config
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        get = [[tensors[f"{p}{e}.{w}_proj.weight"] for e in range(cfg.n_experts)]
               for w in ("gate", "up", "down")]
        out[p + "gate_up_proj"] = np.concatenate([np.stack(get[0]), np.stack(get[1])], axis=1)
        out[p + "down_proj"] = np.stack(get[2])
    save_file(out, str(d / "model.safetensors"))
    toks = tokens("qwen3_moe", built)
    want, _, _ = ours(src, toks)
    got, _, _ = ours(d, toks)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
def test_expert_frequencies_are_transformers_routing(built, name):
    """Per layer, how often each expert is routed to (sparsity/expert_profile.py) equals the
    count from transformers' own router logits on the same tokens (softmax, top-k)."""
    from powerinfer_jax.sparsity.expert_profile import expert_counts, expert_frequency

    toks = tokens(name, built)
    ck = load_checkpoint(built["dirs"][name])
    model = from_params(ck.config, ck.params)
    got = expert_counts(model, [toks[:1], toks[1:]])
    with torch.no_grad():
        out = built["hf"][name](torch.tensor(toks), output_router_logits=True)
    want = np.stack([np.bincount(torch.topk(torch.softmax(r.float(), -1), 2, dim=-1).indices
                                 .numpy().ravel(), minlength=6) for r in out.router_logits])
    np.testing.assert_array_equal(got, want)
    freq = expert_frequency(model, [toks])
    assert_close(freq.sum(axis=1), 2.0, "float_equal")
    with pytest.raises(ValueError, match=r"expert_counts model: expected a mixture-of-experts"):
        dense = ck.config.replace(n_experts=0, n_experts_used=0, d_ff_shared=0)
        from powerinfer_jax.checkpoint.base import expected_shapes
        expert_counts(from_params(dense, {k: np.zeros(v, np.float32) for k, v in
                                          expected_shapes(dense).items()}), [toks])


# ------------------------------------------------------------------------------ bad input
def _copy_dir(src, dst, **config):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_bad_moe_configs_and_shapes_are_one_line_errors(built, tmp_path):
    d = built["dirs"]["qwen3_moe"]
    cases = [
        (dict(num_experts_per_tok=7), r"num_experts_per_tok: expected an integer in \[1, "
                                      r"num_local_experts=6\] \(experts routed per token\), got 7"),
        (dict(mlp_only_layers=[1]), r"mlp_only_layers / decoder_sparse_step: expected \[\] and 1"),
        (dict(num_local_experts=5), r"layers.0.ffn.experts.(gate|up|down_t).weight: expected "
                                    r"experts 0..4, got missing \[\], unexpected \[5\]"),
    ]
    for i, (change, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match) as e:
            load_checkpoint(_copy_dir(d, tmp_path / f"bad{i}", **change))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"mixtral.*num_experts_per_tok: expected an integer in "
                                         r"\[1, num_local_experts=6\]"):
        load_checkpoint(_copy_dir(built["dirs"]["mixtral"], tmp_path / "mixtral",
                                  num_experts_per_tok=9))


def test_bad_moe_gguf_files_name_what_is_wrong(built, tmp_path):
    if not built["gguf"]:
        pytest.skip(built["why_gguf"])
    from helpers_gguf_edit import rewrite

    src = built["gguf"]["qwen3_moe"]
    cases = [
        (dict(set_keys={"qwen3moe.expert_used_count": 8}),
         r"qwen3moe.expert_used_count: expected an integer in \[1, qwen3moe.expert_count=6\]"),
        (dict(set_keys={"qwen3moe.expert_count": 4}),
         r"tensor 'blk.0.ffn_gate_inp.weight': expected shape \(4, 160\)"),
        (dict(drop_tensors=["blk.2.ffn_down_exps.weight"]),
         r"expected tensor 'blk.2.ffn_down_exps.weight' \(for layers.2.ffn.experts.down_t"),
        (dict(drop_keys=["qwen3moe.expert_count"]),
         r"metadata key 'qwen3moe.expert_count': expected present"),
    ]
    for i, (edit, match) in enumerate(cases):
        path = rewrite(src, tmp_path / f"bad{i}.gguf", **edit)
        with pytest.raises(ValueError, match=match) as e:
            load_checkpoint(path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_input_sparsity_at_target_zero_is_the_dense_model(built, name):
    """Input sparsity on the float experts of each family's HF directory: with every threshold
    0 the logits are the model's own; with calibrated thresholds (both rules) the routed
    executions (a batch's experts gathered, one token's pairs alone) equal every expert on every
    token under the same masks, up to a down input on its threshold's edge (the executions sum
    in other orders), and the masks change the logits."""
    from powerinfer_jax.sparsity import input_sparsity as isp

    toks = tokens(name, built)
    got, _, model = ours(built["dirs"][name], toks)
    # bytes a dense token reads, from the parameters themselves: every block matrix (experts:
    # n_used of E), the LM head, one embedding row; a shared expert's down and the router
    # included (read whole, outside the masks' sites)
    from flax import nnx

    want = 0
    for layer in model.layers:
        share = layer.ffn.n_used / layer.ffn.n_experts
        for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
            a = np.asarray(v.get_value())
            if a.ndim >= 2:
                want += a.nbytes * (share if "experts" in map(str, path) else 1)
    head = model.lm_head.weight[...] if model.lm_head is not None else model.tok_embed[...]
    embed = np.asarray(model.tok_embed[...])
    want += np.asarray(head).nbytes + embed.nbytes // embed.shape[0]
    assert isp.bytes_per_token(model, None) == pytest.approx(want, abs=8 * len(model.layers))
    isp.install(model, isp.zero_thresholds(model))
    assert_close(model(jnp.asarray(toks)), got, "regrouped")
    for rule in isp.RULES:
        arts = isp.calibrate(model, toks.astype(np.int32), rule=rule, target=0.4,
                             sample_tokens=48, how="uniform")
        isp.install(model, arts)
        routed, one = model(jnp.asarray(toks)), model(jnp.asarray(toks[:1, :2]))
        for layer in model.layers:
            layer.ffn.set_execution("dense")
        assert_close(model(jnp.asarray(toks)), routed, "one_neuron")
        assert_close(model(jnp.asarray(toks[:1, :2])), one, "one_neuron")
        for layer in model.layers:
            layer.ffn.set_execution("routed")
        assert np.abs(np.asarray(routed) - got).max() > 1e-2
