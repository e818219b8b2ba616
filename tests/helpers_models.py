"""Test helpers: tiny configs, random canonical params, tiny tokenizers and tiny HF models on disk.

Everything is seeded, small (vocab 300, D=64) and fast (< 1 s to build).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint.base import expected_shapes
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.tokenizer import CHATML_TEMPLATE

VOCAB = 300
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs!",
    "hello world, hello there. It's 2024 and we're testing tokenizers: 3.14159 * 42",
    "Ünïcödé tëxt — “quoted” ½ 日本語 🙂 and more text for merges in the the the",
] * 5
SAMPLE_TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "the fox 12345",
                "Ünïcödé — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "it's we're"]
GGUF_ENV = "PIJ_TEST_GGUF"


def real_gguf_path() -> Path | None:
    """The real SmolLM2 GGUF for slow-ish tests: $PIJ_TEST_GGUF, else the registry cache."""
    if os.environ.get(GGUF_ENV):
        p = Path(os.environ[GGUF_ENV])
        return p if p.is_file() else None
    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, model_path

    p = model_path("smollm2-135m")
    return p if p.is_file() and p.stat().st_size == KNOWN_MODELS["smollm2-135m"].size else None


@functools.cache
def hf_smollm2(path: Path):
    """transformers' own model of the GGUF at `path` (it dequantizes the file to float32 itself,
    ~25 s on 2 cores): made once per test run and saved in the run's shared folder
    (helpers_shared.py), which every worker then reads back (~2 s), once per worker."""
    import helpers_shared
    import torch
    from transformers import AutoModelForCausalLM

    def make(d: Path) -> str:
        from safetensors.torch import save_model

        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
        # save_pretrained refuses a model read from GGUF; its config and tensors are all we need
        model.config.save_pretrained(d)
        save_model(model, str(d / "model.safetensors"))
        return str(path)

    d, _ = helpers_shared.once("hf-" + hashlib.sha1(str(path).encode()).hexdigest()[:12], make)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def tiny_llama_config(**changes) -> ModelConfig:
    base = dict(arch="llama", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=16, d_ff=96, max_seq_len=128, activation="silu", gated=True, bias=False,
                norm="rms", norm_eps=1e-5, positions="rope", rope_theta=10000.0,
                tie_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    base.update(changes)
    return ModelConfig(**base)


def random_params(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".scale"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
    return out


def trained_bpe():
    """A byte-level BPE `tokenizers.Tokenizer` with exactly VOCAB tokens, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def gpt2_tokenizer_meta(pre: str = "default") -> dict:
    """GGUF tokenizer metadata (keys of `gguf.write_gguf`'s tokenizer_meta) for `trained_bpe()`."""
    spec = json.loads(trained_bpe().to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges,
            "token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0, "add_bos_token": False,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                             "assistant\n{% endif %}"}


def spm_tokenizer_meta() -> dict:
    """A SentencePiece-style ("llama") vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces."""
    pieces = ["\u2581", "e", "t", "h", "o", "l", "r", "d", "w", "\u2581t", "he", "\u2581the",
              "ll", "\u2581h", "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "llo", "\u2581he",
              "\u2581hello", "\u2581f", "x", "\u2581fo", "\u2581fox", "!", "," , "a", "n", "\u2581a",
              "\u2581an", "\u2581and", "H", "\u2581H", "\u2581Hello", "s", "i", "\u2581i", "\u2581is"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {"model": "llama", "tokens": tokens, "scores": scores, "token_type": types,
            "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


def write_tiny_gguf(path: Path, config: ModelConfig | None = None, tensor_types=None, seed=0,
                    tokenizer_meta=None, **kwargs):
    """Write a tiny llama GGUF; returns (config, params written)."""
    from powerinfer_jax.checkpoint.gguf import write_gguf

    config = config or tiny_llama_config()
    params = random_params(config, seed)
    write_gguf(path, config, params, tokenizer_meta or gpt2_tokenizer_meta(), tensor_types, **kwargs)
    return config, params


# ------------------------------------------------------------------------ HF models on disk
def _save_tokenizer(d: Path, bos: str = "<|im_start|>", eos: str = "<|im_end|>"):
    from transformers import PreTrainedTokenizerFast

    # ChatML, as an instruct model's tokenizer carries it (its tokens are in the vocabulary):
    # chat on a model without a template is refused
    fast = PreTrainedTokenizerFast(tokenizer_object=trained_bpe(), bos_token=bos, eos_token=eos,
                                   chat_template=CHATML_TEMPLATE)
    fast.save_pretrained(d)


def save_hf_llama(d: Path, *, hidden_act="silu", tied=False, n_kv_heads=2, max_shard_size=None,
                  model_type="llama", seed=0, dtype=None) -> dict[str, np.ndarray]:
    """Save a tiny random Llama (or Mistral) to `d`; returns its HF state_dict as numpy."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM)

    torch.manual_seed(seed)
    cfg_cls, model_cls = ((LlamaConfig, LlamaForCausalLM) if model_type == "llama"
                          else (MistralConfig, MistralForCausalLM))
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=16,
                  hidden_act=hidden_act, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rope_theta=5000.0)
    model = model_cls(cfg).eval()
    if dtype is not None:  # e.g. torch.bfloat16: exercises the BF16 safetensors path
        model = model.to(getattr(torch, dtype))
    _save(model, d, max_shard_size)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def save_hf_opt(d: Path, *, max_shard_size=None, seed=0, **overrides) -> dict[str, np.ndarray]:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    model = OPTForCausalLM(OPTConfig(**kw)).eval()
    _save(model, d, max_shard_size)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _save(model, d: Path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(d, **kwargs)
    _save_tokenizer(d)


def with_mode(model, sparsity, *, thresholds=None, predictors=None):
    """`model` configured for `sparsity` (sparsity.modes.configure); returns it."""
    from powerinfer_jax.sparsity import modes

    modes.configure(model, sparsity, thresholds=thresholds, predictors=predictors)
    return model


def active_counts(model, tokens, positions):
    """(h, n_active [L, B, T] or None) of one uncached forward pass."""
    from powerinfer_jax.models.transformer import capture

    (h, _), sown = capture(lambda m: m.hidden(tokens, positions), model)
    return h, sown.get("n_active")


def ffn_run(ffn, x):
    """(y, n_active or None) of one FFN call with its installed selector."""
    from flax import nnx

    y, sown = nnx.capture(lambda f, x: f(x), nnx.Intermediate)(ffn, x)
    flat = dict(nnx.to_flat_state(sown))
    return y, (flat[("n_active",)].get_value()[-1] if ("n_active",) in flat else None)


def q4_selector(ffn, threshold, *, gate_up="full"):
    """The q4 predictor of an (unplaced) FFN as its selector: scores, or the activations."""
    from powerinfer_jax.sparsity import nibble_predictor, selectors

    pred = nibble_predictor.NibblePredictor.from_ffn(ffn)
    return (selectors.Q4Activations if gate_up == "q4" else selectors.Scores)(pred, threshold)


def small_input_calibration(monkeypatch) -> None:
    """Input sparsity's runtime calibration made small (128 tokens of 32, one loss chunk)."""
    from powerinfer_jax.sparsity import input_sparsity as isp

    monkeypatch.setattr(isp, "DEFAULT_SAMPLE_TOKENS", 128)
    monkeypatch.setattr(isp, "DEFAULT_CTX", 32)
    monkeypatch.setattr(isp, "LOSS_CHUNKS", 1)


BATCH_PROMPTS = ("the quick brown fox", "hello", "a b c d e f")


def assert_batch_decodes_as_single(llm, new_tokens: int = 6):
    """Three prompts decoded together give each one's tokens decoded alone; returns (prompt ids,
    the tokens alone)."""
    from powerinfer_jax.runtime.decode import Request

    eng = llm.session.engine
    prompts = [llm.encode(p) for p in BATCH_PROMPTS]
    alone = [eng.generate(p, max_new_tokens=new_tokens).tokens for p in prompts]
    assert [r.tokens for r in eng.run([Request(p, new_tokens) for p in prompts])] == alone
    return prompts, alone
