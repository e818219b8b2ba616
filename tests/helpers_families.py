"""Tiny random models of the families people run, built by transformers: Llama-3 (RoPE scaling
"llama3"), Qwen2, Qwen3, Gemma-2, Gemma-3 (text-only Gemma3ForCausalLM), Phi-3, Mistral
(sliding window). Odd sizes, grouped KV heads, several layers, seeded; each with its family's
kind of tokenizer trained here on wiki.train and its published chat template
(tests/data/chat_templates/):
  Llama-3       byte-level BPE with Llama-3's split regex, BOS added by its post-processor
  Qwen2, Qwen3  byte-level BPE with Qwen2's split regex and NFC, no BOS
  Gemma-2/3     SentencePiece BPE (byte fallback, digits split, no dummy prefix), as Gemma's
  Phi-3, Mistral  SentencePiece BPE with the dummy prefix (Llama-2's kind of tokenizer)
`build(name, dir)` saves the HF directory (config, safetensors, tokenizer.json,
tokenizer_config.json with the template, tokenizer.model for SentencePiece) and returns the
torch model; helpers_llamacpp.convert writes its GGUF with llama.cpp's converter.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import shutil
from pathlib import Path

import numpy as np

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WIKI = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki.train.txt"
BPE_VOCAB = 512
SPM_VOCAB = 600
WINDOW = 8  # sliding window of the families that have one: tests go past it
# Text the tokenizers are checked on besides wiki: emoji, CJK, digit runs, whitespace runs.
EDGE_TEXTS = ["Hello world", "🙂 emoji 🚀🦙 and ZWJ 👩\u200d💻", "日本語のテキスト、中文字符。한국어",
              "digits 1 12 123 1234 12345 3.14159 2024-11-27", "  two  spaces\t\ttabs\n\n\nlines   ",
              "it's we're I'VE they'll", "Ünïcödé — “quoted” ½", "mixed日本123abc  🙂\n end",
              "decomposed e\u0301 and A\u030a (NFC composes them)"]


def corpus() -> list[str]:
    """Training text: the first ~300 kB of wiki.train (the edge texts too, so that some of
    their characters have merges), or a small built-in text when the shared data is absent."""
    if WIKI.is_file():
        text = WIKI.read_text(encoding="utf-8")[:300_000]
    else:
        from helpers_models import CORPUS

        text = "\n".join(CORPUS * 20)
    return text.splitlines() + EDGE_TEXTS * 3


def wiki_sample(n_chars: int = 20_000) -> str:
    """Text the ids are compared on: from wiki.valid (never trained on), else wiki.train's tail."""
    valid = WIKI.with_name("wiki.valid.txt")
    if valid.is_file():
        return valid.read_text(encoding="utf-8")[:n_chars]
    return "\n".join(corpus()[-200:])[:n_chars]


# ------------------------------------------------------------------------------ tokenizers
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class TokSpec:
    kind: str  # "bpe" | "spm"
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    split: str = ""  # bpe: the pre-tokenizer regex
    nfc: bool = False  # bpe: NFC normalizer (Qwen)
    gemma: bool = False  # spm: Gemma's style (no dummy prefix, digits split, its special ids)
    pad: str | None = None
    hf_class: str = "PreTrainedTokenizerFast"


LLAMA3_TOK = TokSpec("bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                             "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                     bos="<|begin_of_text|>", eos="<|eot_id|>", split=_LLAMA3_SPLIT)
QWEN_TOK = TokSpec("bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
                           "</tool_call>", "<think>", "</think>"),
                   bos=None, eos="<|im_end|>", split=_QWEN2_SPLIT, nfc=True, pad="<|endoftext|>")
GEMMA_TOK = TokSpec("spm", ("<start_of_turn>", "<end_of_turn>"), bos="<bos>", eos="<eos>",
                    gemma=True, pad="<pad>", hf_class="GemmaTokenizer")
PHI3_TOK = TokSpec("spm", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                           "<|endoftext|>"), bos="<s>", eos="<|end|>", hf_class="LlamaTokenizer")
MISTRAL_TOK = TokSpec("spm", ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                              "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), bos="<s>",
                      eos="</s>", hf_class="LlamaTokenizer")


@functools.cache
def _bpe(spec: TokSpec):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE())
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(spec.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if spec.bos:
        bos = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    spec_json = json.loads(tok.to_str())
    # Llama-3's tokenizer.json: a pre-token already in the vocabulary is one token
    spec_json["model"]["ignore_merges"] = spec.split == _LLAMA3_SPLIT
    return json.dumps(spec_json)


@functools.cache
def _spm(spec: TokSpec) -> bytes:
    import sentencepiece as spm

    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                bos_piece="<bos>", unk_piece="<unk>") if spec.gemma
           else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="bpe",
        vocab_size=SPM_VOCAB, byte_fallback=True, split_digits=spec.gemma,
        add_dummy_prefix=not spec.gemma, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=1.0,
        user_defined_symbols=list(spec.specials), minloglevel=2, num_threads=1, **ids)
    return model.getvalue()


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def save_tokenizer(d: Path, spec: TokSpec, chat_template: str) -> None:
    """tokenizer.json + tokenizer_config.json (+ tokenizer.model for SentencePiece) in `d`."""
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    special = dict(bos_token=spec.bos, eos_token=spec.eos)
    if spec.pad:
        special["pad_token"] = spec.pad
    if spec.kind == "bpe":
        from tokenizers import Tokenizer

        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(_bpe(spec)), **special,
            additional_special_tokens=[t for t in spec.specials
                                       if t not in special.values()])
    else:
        src = d / "_spm"
        src.mkdir(exist_ok=True)
        (src / "tokenizer.model").write_bytes(_spm(spec))
        cfg = {"tokenizer_class": spec.hf_class, **special,
               "add_bos_token": True, "add_eos_token": False}
        if not spec.gemma:
            cfg.update(unk_token="<unk>", legacy=False)
        (src / "tokenizer_config.json").write_text(json.dumps(cfg))
        fast = transformers.AutoTokenizer.from_pretrained(src)
        shutil.copy(src / "tokenizer.model", d / "tokenizer.model")
        shutil.rmtree(src)
    fast.chat_template = chat_template
    fast.save_pretrained(d)
    if spec.kind == "spm" and not spec.gemma:
        _published_spm_form(d / "tokenizer.json")
    # tokenizer_config.json as published models carry it (written by transformers 4): the
    # added tokens by id, which llama.cpp's converter reads to type them in the GGUF
    spec_json = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                         "single_word", "special")}
        for t in spec_json["added_tokens"]}
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


def _published_spm_form(path: Path) -> None:
    """tokenizer.json of a dummy-prefix SentencePiece model as Llama-2's, Phi-3's and Mistral's
    are published (transformers 4): the prefix and spaces as normalizers, no pre-tokenizer.
    transformers 5's conversion of tokenizer.model writes a Metaspace pre-tokenizer instead,
    which prepends no "\u2581" to a text that starts with a space, unlike sentencepiece."""
    j = json.loads(path.read_text(encoding="utf-8"))
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    j["pre_tokenizer"] = None
    path.write_text(json.dumps(j, ensure_ascii=False, indent=2), encoding="utf-8")


# ------------------------------------------------------------------------------ the families
@dataclasses.dataclass(frozen=True)
class FamilySpec:
    config_class: str
    model_class: str
    config: dict
    tokenizer: TokSpec
    template: str
    gguf_pre: str | None = None  # tokenizer.ggml.pre for a trained BPE vocabulary
    window: int = 0  # the sliding window its config sets (0: none)


_COMMON = dict(hidden_size=160, intermediate_size=224, num_hidden_layers=3,
               max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama3": FamilySpec(
        "LlamaConfig", "LlamaForCausalLM",
        dict(_COMMON, num_attention_heads=10, num_key_value_heads=2, head_dim=16,
             tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}),
        LLAMA3_TOK, "meta-llama-Llama-3.1-8B-Instruct", gguf_pre="llama-bpe"),
    "qwen2": FamilySpec(
        "Qwen2Config", "Qwen2ForCausalLM",
        dict(_COMMON, num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True,
             rope_theta=1000000.0),
        QWEN_TOK, "Qwen-Qwen2.5-7B-Instruct", gguf_pre="qwen2"),
    "qwen3": FamilySpec(
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(_COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings=False, rope_theta=1000000.0),
        QWEN_TOK, "Qwen-Qwen3-0.6B", gguf_pre="qwen2"),
    # query_pre_attn_scalar = head_dim as in Gemma-2 2B/9B and Gemma-3 (the GGUF stores none;
    # llama.cpp derives it the same way); tests/test_families.py checks another value on HF
    "gemma2": FamilySpec(
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(_COMMON, num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1,
             head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
             attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
        GEMMA_TOK, "google-gemma-2-2b-it", window=WINDOW),
    "gemma3": FamilySpec(
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(_COMMON, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1000000.0}}),
        GEMMA_TOK, "google-gemma-3-it", window=WINDOW),
    "phi3": FamilySpec(
        "Phi3Config", "Phi3ForCausalLM",
        dict(_COMMON, num_attention_heads=10, num_key_value_heads=2, tie_word_embeddings=False),
        PHI3_TOK, "microsoft-Phi-3.5-mini-instruct"),
    "mistral": FamilySpec(
        "MistralConfig", "MistralForCausalLM",
        dict(_COMMON, num_attention_heads=10, num_key_value_heads=5, head_dim=16,
             sliding_window=WINDOW, tie_word_embeddings=False),
        MISTRAL_TOK, "mistralai-Mistral-Nemo-Instruct-2407", window=WINDOW),
}


def _randomize(model, seed: int, gemma: bool):
    """Weights large enough that logits spread (HF's init gives near-uniform outputs); norms
    around 1 (Gemma's around 0: it multiplies by 1 + w)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.2 * noise + (0.0 if gemma else 1.0))
            elif p.ndim == 2:
                p.copy_(1.5 * noise * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.3 * noise)
    return model


def build(name: str, d: Path, *, seed: int = 0, **overrides):
    """Save family `name`'s tiny model and tokenizer to `d`; returns the torch model (eval)."""
    import torch
    import transformers

    spec = FAMILIES[name]
    save_tokenizer(d, spec.tokenizer, template(spec.template))
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = {k: tok.convert_tokens_to_ids(getattr(spec.tokenizer, k))
           for k in ("bos", "eos", "pad") if getattr(spec.tokenizer, k)}
    torch.manual_seed(seed)
    cfg = getattr(transformers, spec.config_class)(
        **{**spec.config, **overrides}, vocab_size=len(tok), bos_token_id=ids.get("bos"),
        eos_token_id=ids["eos"], pad_token_id=ids.get("pad"))
    model = getattr(transformers, spec.model_class)(cfg).eval()
    _randomize(model, seed, gemma=name.startswith("gemma"))
    model.save_pretrained(d)
    return model


def built_set(key: str, specs: dict, build) -> dict:
    """Every model of `specs` saved by `build(name, dir)`, its f32 GGUF (llama.cpp's converter,
    one process for all) and Q4_0 GGUF (llama-quantize), made once per test run for all
    workers (helpers_shared.py), or why the GGUFs are missing. Returns {"dirs", "hf" (the torch
    models, read back from their directories), "gguf", "q", "why_gguf", "why_q"}."""
    import helpers_llamacpp as llamacpp
    import helpers_shared
    import torch
    import transformers

    def make(root: Path) -> dict:
        for name in specs:
            build(name, root / name)
        src, why = llamacpp.tree()
        if src is None:
            return {"why_gguf": why, "why_q": why}
        llamacpp.convert([(root / n, root / f"{n}.gguf", specs[n].gguf_pre, "f32")
                          for n in specs])
        if llamacpp.binary("llama-quantize") is None:
            return {"why_gguf": "", "why_q": "no llama-quantize build ($PIJ_LLAMA_CPP_BIN or "
                    "<cache>/peers/llamacpp-cpu-native: benchmarks/build_llama_bench_cpu.sh)"}
        for n in specs:
            llamacpp.quantize(root / f"{n}.gguf", root / f"{n}.q4_0.gguf", "Q4_0")
        return {"why_gguf": "", "why_q": ""}

    root, why = helpers_shared.once(key, make)
    return {"dirs": {n: root / n for n in specs},
            "hf": {n: getattr(transformers, specs[n].model_class).from_pretrained(
                root / n, dtype=torch.float32).eval() for n in specs},
            "gguf": {} if why["why_gguf"] else {n: root / f"{n}.gguf" for n in specs},
            "q": {} if why["why_q"] else {n: root / f"{n}.q4_0.gguf" for n in specs},
            **why}


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers with its KV cache, no stop token (generate() stops at
    the config's EOS; min_new_tokens would instead forbid it, which ours may pick)."""
    import torch

    out, ids = [], torch.tensor([prompt])
    past = None
    # transformers 5.2x names the cache `cache` (`past_key_values` before)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, use_cache=True, **{key: past})
            past = getattr(res, key)
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out
