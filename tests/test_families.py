"""The families people run, against transformers (issue 34): Llama-3 with its "llama3" RoPE
scaling, Qwen2, Qwen3, Gemma-2, Gemma-3 (text-only), Phi-3 and Mistral with a sliding window,
each a tiny random model transformers builds here (helpers_families.py), read

  * from its HF directory,
  * from the f32 GGUF llama.cpp's own convert_hf_to_gguf.py writes from that directory,
  * from that GGUF quantized to Q4_0 by llama.cpp's llama-quantize (when a build is at hand):
    the reference is transformers reading the same Q4_0 file (its own dequantization) into
    the model the directory's config.json describes.

Logits equal transformers' within the one tolerance of family logits (helpers_tolerances.py) at 24
positions, past every sliding window (8); greedy decoding equals transformers' generate over 32
steps; each family's distinguishing feature is shown to matter (dropping it moves the logits far
outside the tolerance), so a loader that ignored it would fail. A Mistral GGUF carries no sliding
window (the converter drops it and llama.cpp runs Mistral without one): from the GGUF we equal
transformers with the window off. Tokenizers (tokenizer.json and GGUF metadata) give
AutoTokenizer's ids on wiki text and on emoji, CJK, digit and whitespace runs, and the chat
template renders as transformers' apply_chat_template. The GGUF tests skip when llama.cpp's
tree is absent and cannot be fetched (helpers_llamacpp.py says why).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

import helpers_families as fam  # noqa: E402
import helpers_llamacpp as llamacpp  # noqa: E402
from helpers_tolerances import TOL, assert_close  # noqa: E402
from powerinfer_jax.checkpoint import load_checkpoint  # noqa: E402
from powerinfer_jax.checkpoint.base import expected_shapes  # noqa: E402
from powerinfer_jax.models.rope import layer_rope  # noqa: E402
from powerinfer_jax.models.transformer import from_params  # noqa: E402
from powerinfer_jax.runtime.decode import Engine  # noqa: E402

NAMES = list(fam.FAMILIES)
T = 24  # positions compared: three sliding windows long


@pytest.fixture(scope="module")
def built(families_built):  # conftest.py: built once per session, shared with the sparse tests
    return families_built


def tokens(name: str, built) -> np.ndarray:
    vocab = built["hf"][name].config.vocab_size
    return np.random.default_rng(len(name)).integers(10, vocab, size=(2, T))


def ours(path, toks, **kwargs):
    ck = load_checkpoint(path, **kwargs)
    model = from_params(ck.config, ck.params)
    return np.asarray(model(jnp.asarray(toks))), ck, model


def assert_logits_close(got, want):
    assert np.abs(want).max() > 1.0  # randomized weights: logits far from zero
    assert_close(got, want, "family_logits")


def _features(c) -> dict:
    return {k: getattr(c, k) for k in ("qkv_bias", "qk_norm", "post_norms", "activation",
                                       "attn_softcap", "final_softcap", "layer_windows",
                                       "rope_local_theta", "tie_embeddings")}


EXPECTED = {  # what each family's config must say (a loader that missed a feature fails here)
    "llama3": lambda c: c.rope_scaling is not None and c.rope_scaling.kind == "llama3",
    "qwen2": lambda c: c.qkv_bias and c.tie_embeddings,
    "qwen3": lambda c: c.qk_norm and c.head_dim * c.n_heads != c.d_model,
    "gemma2": lambda c: (c.post_norms and c.activation == "gelu" and c.attn_softcap == 5.0
                         and c.final_softcap == 8.0 and c.layer_windows == (8, 0, 8, 0)),
    "gemma3": lambda c: (c.qk_norm and c.post_norms and c.layer_windows == (8,) * 5 + (0, 8)
                         and c.rope_local_theta == 10000.0 and c.rope_scaling.kind == "linear"),
    "phi3": lambda c: c.n_kv_heads == 2 and not c.tie_embeddings,
    "mistral": lambda c: c.layer_windows == (8,) * 3,
}
# Dropping each family's features: the logits must move far outside the tolerance.
ABLATIONS = {
    "llama3": dict(rope_scaling=None),
    "qwen2": dict(qkv_bias=False),
    "qwen3": dict(qk_norm=False),
    "gemma2": dict(layer_windows=(), attn_softcap=0.0),
    "gemma3": dict(layer_windows=(), rope_local_theta=None),
    "mistral": dict(layer_windows=()),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_hf_directory_logits_match_transformers(built, name):
    toks = tokens(name, built)
    want = fam.hf_logits(built["hf"][name], toks)
    got, ck, _ = ours(built["dirs"][name], toks)
    assert EXPECTED[name](ck.config), _features(ck.config)
    assert_logits_close(got, want)
    if name in ABLATIONS:
        config = ck.config.replace(**ABLATIONS[name])
        changed = from_params(config, {k: v for k, v in ck.params.items()
                                       if k in expected_shapes(config)})
        moved = np.abs(np.asarray(changed(jnp.asarray(toks))) - want).max()
        assert moved > 100 * TOL["family_logits"].atol


@pytest.mark.slow
def test_gemma2_query_pre_attn_scalar_and_tied_head_from_hf(tmp_path):
    """query_pre_attn_scalar other than head_dim (Gemma-2 27B's kind; a GGUF cannot say it)."""
    hf = fam.build("gemma2", tmp_path, query_pre_attn_scalar=20)
    toks = np.random.default_rng(1).integers(10, hf.config.vocab_size, size=(1, T))
    got, ck, _ = ours(tmp_path, toks)
    assert ck.config.query_scale == pytest.approx(20 ** -0.5)
    assert_logits_close(got, fam.hf_logits(hf, toks))


def _gguf_reference(built, name, path=None):
    """transformers' model for a GGUF of `name`: the directory's model, or, for a quantized
    file, transformers reading that file (its dequantization) with the directory's config; a
    Mistral GGUF has no sliding window (module docstring)."""
    d = built["dirs"][name]
    cfg = transformers.AutoConfig.from_pretrained(d)
    if name == "mistral":
        cfg.sliding_window = None
    if path is None and name != "mistral":
        return built["hf"][name]
    if path is None:
        model = getattr(transformers, fam.FAMILIES[name].model_class)(cfg).eval()
        model.load_state_dict(built["hf"][name].state_dict())
        return model
    # Mistral's file is a llama GGUF: transformers builds its Llama from the file alone
    kw = {} if name == "mistral" else {"config": cfg}
    return transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=str(path), dtype=torch.float32, **kw).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_gguf_logits_match_transformers(built, name):
    if not built["gguf"]:
        pytest.skip(built["why_gguf"])
    toks = tokens(name, built)
    got, ck, _ = ours(built["gguf"][name], toks)
    hf_ck = load_checkpoint(built["dirs"][name])
    want_cfg = hf_ck.config.replace(layer_windows=()) if name == "mistral" else hf_ck.config
    # the same model: every field (eps stored as float32; Llama-3's scaling as the rope_freqs
    # tensor, so compare each layer's frequencies)
    assert ck.config.norm_eps == pytest.approx(want_cfg.norm_eps, rel=1e-6)
    assert dataclasses.replace(ck.config, norm_eps=want_cfg.norm_eps,
                               rope_scaling=want_cfg.rope_scaling) == want_cfg
    for i in range(want_cfg.n_layers):
        a, b = layer_rope(ck.config, i), layer_rope(want_cfg, i)
        assert_close(a.inv_freq, b.inv_freq, "ulps")
        assert a.attention_factor == b.attention_factor
    assert_logits_close(got, fam.hf_logits(_gguf_reference(built, name), toks))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_quantized_gguf_matches_transformers_on_the_same_file(built, name):
    if not built["q"]:
        pytest.skip(built["why_q"])
    path = built["q"][name]
    toks = tokens(name, built)
    want = fam.hf_logits(_gguf_reference(built, name, path), toks)
    # the file's blocks dequantized: the same weights as transformers', f32 math
    got, ck, _ = ours(path, toks)
    assert_logits_close(got, want)
    # the runtime's default on a quantized file: the custom calls on the blocks, 8-bit
    # activations as llama.cpp computes (each kernel's own bound: tests/test_ops_qlinear*.py)
    blocks, ckq, _ = ours(path, toks, keep_quantized=True)
    assert any(type(v).__name__ == "QuantTensor" for v in ckq.params.values())
    assert np.abs(blocks - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers(built, name):
    """32 greedy steps after a 7-token prompt: 39 positions, past every sliding window, through
    the decode custom call (q/k norms, soft-cap, window inside it)."""
    hf = built["hf"][name]
    prompt = tokens(name, built)[0, :7].tolist()
    want = fam.hf_greedy(hf, prompt, 32)
    ck = load_checkpoint(built["dirs"][name])
    got = Engine(from_params(ck.config, ck.params), max_seq_len=64).generate(
        prompt, max_new_tokens=32, stop_ids=()).tokens
    assert got == want


# ------------------------------------------------------------------------------ tokenizers
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi 🙂, what is 12345 + 1?"},
            {"role": "assistant", "content": "12346."}, {"role": "user", "content": "日本語で?"}]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_ids_and_chat_template_match_transformers(built, name):
    from powerinfer_jax.checkpoint.gguf import _open, read_metadata
    from powerinfer_jax.tokenizer import Tokenizer

    d = built["dirs"][name]
    ref = transformers.AutoTokenizer.from_pretrained(d)
    ours_by_source = {"tokenizer.json": load_checkpoint(d).tokenizer}
    if built["gguf"]:
        ours_by_source["gguf"] = Tokenizer.from_gguf_metadata(
            read_metadata(_open(built["gguf"][name])))
    messages = MESSAGES[1:] if name.startswith("gemma") else MESSAGES  # no system role there
    want_chat = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for source, tok in ours_by_source.items():
        for text in fam.EDGE_TEXTS + [fam.wiki_sample()]:
            assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False), \
                (source, text[:60])
            ids = tok.encode(text, add_bos=False)
            assert tok.decode(ids) == ref.decode(ids), (source, text[:60])
        assert tok.encode("Hello") == ref.encode("Hello"), source  # BOS as the model adds it
        assert tok.apply_chat(messages) == want_chat, source
        chat_ids = tok.encode(want_chat, add_bos=False)  # special tokens in the text stay whole
        assert chat_ids == ref.encode(want_chat, add_special_tokens=False), source
        assert ref.eos_token_id in tok.eos_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_sentencepiece_families_tokenize_as_sentencepiece(built, name):
    """The SentencePiece families' ids (tokenizer.json and GGUF) are sentencepiece's own on its
    tokenizer.model: leading spaces, byte fallback, digits."""
    import sentencepiece

    d = built["dirs"][name]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    tok = load_checkpoint(d).tokenizer
    for text in fam.EDGE_TEXTS + [fam.wiki_sample(4000)]:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text[:60]


LLAMA_CPP_VOCABS = ("llama-bpe", "qwen2", "phi-3", "llama-spm")


@pytest.mark.slow
@pytest.mark.parametrize("vocab", LLAMA_CPP_VOCABS)
def test_published_vocabularies_give_llama_cpp_reference_ids(vocab):
    """The real Llama-3, Qwen2, Phi-3 and Llama-2 vocabularies as GGUF metadata (llama.cpp's
    models/ggml-vocab-*.gguf) give the ids of llama.cpp's tokenizer test files (made with each
    model's own tokenizer: whitespace runs, emoji, CJK, digits, accents, code)."""
    from powerinfer_jax.checkpoint.gguf import _open, read_metadata
    from powerinfer_jax.tokenizer import Tokenizer

    src, why = llamacpp.tree()
    if src is None:
        pytest.skip(why)
    path = src / "models" / f"ggml-vocab-{vocab}.gguf"
    tok = Tokenizer.from_gguf_metadata(read_metadata(_open(path)))
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split(
        "\n__ggml_vocab_test__\n")
    outs = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(texts) > 40
    for text, ids in zip(texts, outs):
        assert tok.encode(text, add_bos=False) == [int(i) for i in ids.split()], repr(text)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.slow
def test_an_architecture_we_do_not_run_names_itself_and_the_list(built, tmp_path):
    d = built["dirs"]["qwen3"]
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "neox"
    bad.mkdir()
    for f in d.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox",
                                                 "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architecture: expected one of .*qwen3.*gemma2.*phi3.*"
                                         r"got 'GPTNeoXForCausalLM' \(model_type 'gpt_neox'\)"):
        load_checkpoint(bad)


@pytest.mark.slow
@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, r"rope type: expected one of "
     r"\['default', 'linear', 'llama3', 'yarn'\], got 'dynamic'"),
    ({"rope_type": "longrope", "rope_theta": 1e4}, r"got 'longrope'.*not implemented"),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}, r"expected key 'low_freq_factor'"),
])
def test_an_unknown_or_incomplete_rope_scaling_is_an_error(built, tmp_path, rope, match):
    d = built["dirs"]["llama3"]
    for f in d.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(tmp_path)


def test_rope_scaling_config_refuses_unknown_kinds():
    from powerinfer_jax.config import RopeScaling

    with pytest.raises(ValueError, match=r"RopeScaling.kind: expected one of \['linear', "
                                         r"'llama3', 'yarn', 'factors'\], got 'ntk'"):
        RopeScaling("ntk", factor=2.0)


@pytest.mark.slow
def test_gguf_bad_files_name_what_is_wrong(built, tmp_path):
    """A missing tensor, a missing metadata key, an unknown RoPE scaling type and an
    architecture we do not run, each in a copy of a converter-written file."""
    if not built["gguf"]:
        pytest.skip(built["why_gguf"])
    from helpers_gguf_edit import rewrite

    src = built["gguf"]["qwen3"]
    cases = [
        (dict(drop_tensors=["blk.1.attn_q_norm.weight"]),
         r"expected tensor 'blk.1.attn_q_norm.weight' \(for layers.1.attn.q_norm.scale"),
        (dict(drop_keys=["qwen3.attention.head_count"]),
         r"metadata key 'qwen3.attention.head_count': expected present"),
        (dict(set_keys={"qwen3.rope.scaling.type": "longrope"}),
         r"qwen3.rope.scaling.type: expected one of \['none', 'linear', 'yarn'\], got 'longrope'"),
        (dict(set_keys={"general.architecture": "mamba"}),
         r"general.architecture: architecture: expected one of .*qwen3.*got 'mamba'"),
    ]
    for i, (edit, match) in enumerate(cases):
        path = rewrite(src, tmp_path / f"bad{i}.gguf", **edit)
        with pytest.raises(ValueError, match=match):
            load_checkpoint(path)
