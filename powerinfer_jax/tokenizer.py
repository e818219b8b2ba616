"""Text <-> token ids, built on the `tokenizers` library.

One `Tokenizer` class, built either from a Hugging Face `tokenizer.json` (`Tokenizer.from_file`) or
from the vocabulary a GGUF file carries in its metadata (`Tokenizer.from_gguf_metadata`). The GGUF
builders reproduce what transformers' GGUF converter builds, so the ids agree with
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
  tokenizer.ggml.model == "gpt2":  byte-level BPE from tokens + merges; the split regex picked by
                                   `tokenizer.ggml.pre` (see `_PRE_SPLITS`).
  tokenizer.ggml.model == "llama": SentencePiece-style BPE with byte fallback; merges derived from the
                                   token scores; "\u2581" marks spaces; one space prepended to the text
                                   (add_space_prefix), as sentencepiece and llama.cpp do.
BOS is added by `encode` itself (never by a post-processor), so every source behaves the same.
"""
from __future__ import annotations

import datetime
import gc
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from powerinfer_jax import errors

# llama.cpp token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split digits one by one first?, split regex). llama.cpp's "smollm" splits
# every digit on its own, then applies the GPT-2 regex (as SmolLM2's own tokenizer.json does).
_PRE_SPLITS = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
# pre-tokenizers whose published tokenizer.json normalizes to NFC first (Qwen2/2.5/3's)
_NFC_PRES = ("qwen2",)
# Llama-3's: a pre-token that is itself in the vocabulary is one token, before any merge
# (tokenizer.json "ignore_merges": true; llama.cpp sets it for these names, and adds BOS)
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe")
SUPPORTED_GGUF_TOKENIZERS = ("gpt2", "llama")

# ChatML, for a model without a chat template when the caller asks for it by name
# (`resolve_chat_template`; `Tokenizer.apply_chat` says why it is never picked silently).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    """Encode/decode text; knows its BOS/EOS ids and chat template."""

    def __init__(self, backend: _Backend, *, bos_id: int | None, eos_ids: Sequence[int] = (),
                 add_bos: bool = False, chat_template: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None, *, what: str = "text") -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) stay whole.
        Text that is not a str of valid Unicode is refused naming `what` (`check_text`)."""
        check_text(text, what)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                   *, fallback: str | None = None) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's jinja chat template,
        in the environment transformers' `apply_chat_template` gives templates (`_chat_env`), with
        the special tokens it passes (bos_token, eos_token, ...).

        A model without a template (a base model) is refused with a UserError, as transformers
        and vLLM refuse it: no template is right for every model, and one the model never saw
        (ChatML's `<|im_start|>` spelled out as plain text in a vocabulary without it) gives
        fluent-looking garbage, silently. The caller may name one (`chat_template="chatml"`:
        `resolve_chat_template`); `fallback` is the template used instead of refusing (the
        sparsify samples render their chat prompts with ChatML on a base model).
        """
        source = self.chat_template or fallback
        if source is None:
            errors.fail("chat", "a model with a chat template (tokenizer.chat_template in a GGUF, "
                        "or the template in a Hugging Face directory's tokenizer_config.json)",
                        errors.raw("a model without one"),
                        "a base model: leave chat off, or name a template: "
                        "chat_template=chatml or a jinja file")
        template = _chat_env().from_string(source)
        special = {name: self.id_to_token(i) if i is not None else ""
                   for name, i in (("bos_token", self.bos_id),
                                   ("eos_token", self.eos_ids[0] if self.eos_ids else None))}
        return template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **special)

    # ----------------------------------------------------------------------------- builders
    @classmethod
    def from_file(cls, path: str | Path, *, bos_id: int | None = None, eos_ids: Sequence[int] = (),
                  add_bos: bool | None = None) -> "Tokenizer":
        """A Hugging Face `tokenizer.json`; `tokenizer_config.json` beside it (when present) supplies
        the BOS/EOS tokens, `add_bos_token` and the chat template. Explicit arguments win."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file: expected an existing tokenizer.json, got {str(path)!r}")
        backend = _Backend.from_file(str(path))
        cfg_path = path.with_name("tokenizer_config.json")
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

        def token_id(entry):
            content = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(content) if content else None

        if bos_id is None:
            bos_id = token_id(cfg.get("bos_token"))
        eos = [*eos_ids]
        cfg_eos = token_id(cfg.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos:
            eos.append(cfg_eos)
        if add_bos is None:
            add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # ask the file's post-processor whether it adds one
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(with_special) and with_special[0] == bos_id
        template = cfg.get("chat_template")
        if template is None and path.with_name("chat_template.jinja").is_file():
            template = path.with_name("chat_template.jinja").read_text()
        return cls(backend, bos_id=bos_id, eos_ids=eos, add_bos=add_bos,
                   chat_template=template if isinstance(template, str) else None)

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata: a mapping of key -> plain python value (`tokenizer.ggml.*`,
        `tokenizer.chat_template`), as `checkpoint.gguf.read_metadata` returns."""
        return cls.from_recipe(gguf_recipe(fields))

    @classmethod
    def from_recipe(cls, recipe: Mapping[str, Any]) -> "Tokenizer":
        """Build from `gguf_recipe`'s plain values (a model snapshot keeps them: rebuilding
        from them skips the Python half of the build, runtime/snapshot.py)."""
        tokens = recipe["tokens"]
        if recipe["kind"] == "gpt2":
            backend = _byte_level_bpe(tokens, recipe["pairs"], recipe["pre"])
        else:
            backend = _sentencepiece_bpe(tokens, recipe["pairs"], unk_token=recipe["unk_token"],
                                         add_space_prefix=recipe["add_space_prefix"])
        _add_special_tokens(backend, recipe["control"], recipe["user"])
        return cls(backend, bos_id=recipe["bos_id"], eos_ids=recipe["eos_ids"],
                   add_bos=recipe["add_bos"], chat_template=recipe["chat_template"])


def gguf_recipe(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The Python half of `Tokenizer.from_gguf_metadata`: the GGUF's tokenizer metadata checked
    and turned into the plain values the tokenizers objects are made from (the vocabulary as BPE
    spells it, the merges as (left, right) pairs, the special tokens), picklable."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_GGUF_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.model: expected one of "
                         f"{list(SUPPORTED_GGUF_TOKENIZERS)}, got {kind!r} (this GGUF's "
                         "vocabulary type is not supported)")
    tokens = list(fields.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens: expected a non-empty token list, got none")
    types = list(fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    pre = fields.get("tokenizer.ggml.pre")
    control, user = _special_tokens(tokens, types, byte_level=kind == "gpt2")
    recipe = {"kind": kind, "pre": pre, "control": control, "user": user}
    if kind == "gpt2":
        recipe.update(tokens=_respell_outside_alphabet(tokens),
                      pairs=_merge_pairs(fields.get("tokenizer.ggml.merges") or ()),
                      add_bos=fields.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES))
    else:
        unk = fields.get("tokenizer.ggml.unknown_token_id")
        scores = fields.get("tokenizer.ggml.scores")
        recipe.update(tokens=tokens, pairs=_scored_merges(tokens, scores),
                      unk_token=tokens[unk] if unk is not None else None,
                      add_space_prefix=fields.get("tokenizer.ggml.add_space_prefix", True),
                      # llama.cpp adds BOS to a SentencePiece vocabulary by default
                      add_bos=fields.get("tokenizer.ggml.add_bos_token", True))
    eos_ids = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if fields.get(k) is not None]
    recipe.update(bos_id=fields.get("tokenizer.ggml.bos_token_id"),
                  eos_ids=list(dict.fromkeys(int(i) for i in eos_ids)),
                  chat_template=fields.get("tokenizer.chat_template"))
    return recipe


def _chat_env():
    """A jinja2 sandbox as transformers compiles chat templates (utils/chat_template_utils.py):
    trim_blocks, lstrip_blocks, the loop-controls extension, `raise_exception`, `strftime_now`
    (Llama-3.2's date line) and a `tojson` that does not escape HTML."""
    import jinja2.ext  # here, not at the top: only chat rendering needs it (start-up time)
    import jinja2.sandbox

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


def check_text(text, what: str = "text") -> str:
    """`text` as the tokenizer takes it: a str of valid Unicode. Text that came from invalid UTF-8
    holds lone surrogates (Python decodes a command line's bad bytes to U+DC80..U+DCFF, and JSON's
    "\\udc80" escapes make them too), which no UTF-8 tokenizer can encode: refused naming the
    position and the byte (or code point), not a TypeError from inside the tokenizer."""
    if not isinstance(text, str):
        errors.fail(what, "text (a str)", errors.shown(text))
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        got = (f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF
               else f"a lone surrogate U+{c:04X}")
        errors.fail(what, "valid UTF-8 text", errors.raw(f"{got} at character {e.start}"),
                    "invalid UTF-8 cannot be tokenized: fix or re-encode the text")
    return text


def resolve_chat_template(value: str) -> str:
    """A chat template the caller names: "chatml" (ChatML, `CHATML_TEMPLATE`) or the path of a
    jinja file; refused in one line when it is neither, or when jinja cannot parse it."""
    if value == "chatml":
        return CHATML_TEMPLATE
    path = Path(str(value)).expanduser()
    if not path.is_file():
        errors.fail("chat_template", "\"chatml\" or an existing jinja file", value)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        errors.fail("chat_template", "a readable UTF-8 jinja file", str(path),
                    f"{type(e).__name__}: {e}")
    import jinja2  # lazy: start-up (only chat rendering needs it)

    try:
        _chat_env().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        errors.fail("chat_template", "a jinja template", str(path), f"line {e.lineno}: {e.message}")
    return text


class StreamDecoder:
    """Incremental detokenizer: `feed(ids)` returns only the text completed so far.

    Text is decoded over a window starting a few tokens back and diffed against the previous decode,
    so spacing rules that depend on context (SentencePiece's leading space) come out as in a full
    decode; text ending in U+FFFD (a multi-byte UTF-8 character split across tokens) is held back
    until the next token completes it. `flush()` returns whatever is still held.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been returned

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:stop], skip_special=self.skip_special)

    def feed(self, ids: int | Iterable[int]) -> str:
        self._ids.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        return text[len(done):]


# --------------------------------------------------------------------------------- GGUF helpers
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _respell_outside_alphabet(tokens: list[str]) -> list[str]:
    """A token written outside the byte alphabet (a mislabelled special token) respelled
    byte-wise. One regex pass over the concatenated vocabulary finds them (a set check per token
    was 20 ms of SmolLM2's load); a hit's token is found from the tokens' start offsets."""
    spelling = _bytes_to_unicode()
    outside = re.compile(f"[^{re.escape(''.join(spelling.values()))}]")
    hits = [m.start() for m in outside.finditer("".join(tokens))]
    if not hits:
        return tokens
    starts = np.cumsum([0] + [len(t) for t in tokens[:-1]])
    tokens = list(tokens)
    for i in sorted(set(np.searchsorted(starts, hits, side="right") - 1)):
        tokens[i] = "".join(spelling[b] for b in tokens[i].encode())
    return tokens


def _byte_level_bpe(tokens: list[str], pairs: list[tuple[str, str]], pre: str | None
                    ) -> _Backend:
    """tokens: the vocabulary as BPE spells it (`_respell_outside_alphabet`)."""
    vocab = dict(zip(tokens, range(len(tokens))))
    backend = _bpe_backend(vocab, pairs, ignore_merges=pre in _LLAMA3_PRES)
    digits, split = _PRE_SPLITS.get(pre or "default", (False, None))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None or split == _GPT2_SPLIT:  # unknown `pre`: GPT-2's split, as transformers does
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    if pre in _NFC_PRES:
        backend.normalizer = normalizers.NFC()
    return backend


_MERGES_RULE = "tokenizer.ggml.merges: expected \"left right\" pairs of vocabulary tokens, got"


def _merge_pairs(merges: Iterable[str]) -> list[tuple[str, str]]:
    """"left right" merges -> (left, right) pairs. The ~50k tuples are made with the cycle
    collector paused: in a fresh process after jax's imports that many tracked allocations set
    off ~60 collections over jax's heap, a full one among them (counted with gc.get_stats), and
    they hold no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
    finally:
        if enabled:
            gc.enable()
    bad = next((" ".join(p) for p in pairs if len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"{_MERGES_RULE} {bad!r}")
    return pairs


def _bpe_backend(vocab: dict[str, int], pairs: list[tuple[str, str]], *,
                 ignore_merges: bool = False) -> _Backend:
    """A byte-level BPE backend from its vocabulary and merge pairs (`models.BPE`).

    Why not a tokenizer.json text through `Tokenizer.from_str` (as before): tokenizers parses
    that into a generic JSON tree first, one BTreeMap insert per vocabulary entry, 0.09 s of
    SmolLM2's 0.13 s tokenizer build on a 2-core Xeon against 0.045 s for the dict and pairs
    here."""
    try:
        return _Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises a bare Exception naming the token
        raise ValueError(f"{_MERGES_RULE} a list tokenizers rejects ({e})") from None


def _scored_merges(tokens: list[str], scores: Sequence[float] | None) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges: every split of a token into two known tokens is a merge,
    ranked by the merged token's score (best first), ties by the pieces' lengths then ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    ranked = []
    for token, score in zip(tokens, scores):
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked.extend((float(score), len(l), len(r), l, r) for l, r in splits)
    # Stable sort, descending on (score, len(left), len(right)); equal keys keep the id order above.
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(l, r) for _, _, _, l, r in ranked]


def _sentencepiece_bpe(tokens: list[str], pairs: list[tuple[str, str]], *,
                       unk_token: str | None, add_space_prefix: bool) -> _Backend:
    """SentencePiece's BPE as its published tokenizer.json spells it: spaces are "\u2581", and
    with add_space_prefix (Llama-2, Phi-3, Mistral; not Gemma) one is prepended to every text,
    also to one that starts with a space, as sentencepiece and llama.cpp do (transformers 5
    converting a tokenizer.model instead prepends only where the text does not start with one).
    pairs: `_scored_merges`."""
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True,
                                  byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _special_tokens(tokens: list[str], types: list[int], *, byte_level: bool
                    ) -> tuple[list[str], list[str]]:
    """(control, user-defined) tokens: control tokens become special (never split, skippable on
    decode); user-defined ones are matched whole. In a byte-level vocabulary a control token
    outside the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does)."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    kinds = np.asarray(types[:len(tokens)])  # one vectorised pass over ~50k-150k tokens
    control = [tokens[i] for i in np.flatnonzero(kinds == _CONTROL).tolist()
               if alphabet is None or set(tokens[i]) <= alphabet]
    user = [tokens[i] for i in np.flatnonzero(kinds == _USER_DEFINED).tolist()]
    return control, user


def _add_special_tokens(backend: _Backend, control: list[str], user: list[str]) -> None:
    """`_special_tokens`' lists into the backend."""
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in control])
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
