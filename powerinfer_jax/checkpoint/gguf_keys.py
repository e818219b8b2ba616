"""The value type of every GGUF metadata key this package reads, checked once when a file is
opened: a file whose key holds another type (a list where a count belongs, a string for a flag,
a bool for a size) is refused with the key, the type it needs and the one it has, instead of
failing later inside the config or the tokenizer with a Python error that names neither.

Keys the package does not read are not checked (GGUF files carry many). Per-architecture keys
are matched by their suffix after `<general.architecture>.`.
"""
from __future__ import annotations

from typing import Any, Mapping

from powerinfer_jax.checkpoint.gguf_arch import ACTIVATION_KEY, FATRELU_KEY
from powerinfer_jax.errors import UserError

INT, NUMBER, BOOL, STR = "an integer", "a number", "a bool", "a string"
INTS, NUMBERS, STRS = "a list of integers", "a list of numbers", "a list of strings"
INT_OR_FLAGS = "an integer or a list of flags (bools or integers)"

KEYS = {
    "general.architecture": STR, "general.alignment": INT, "general.name": STR,
    "tokenizer.ggml.model": STR, "tokenizer.ggml.pre": STR, "tokenizer.ggml.tokens": STRS,
    "tokenizer.ggml.merges": STRS, "tokenizer.ggml.token_type": INTS,
    "tokenizer.ggml.scores": NUMBERS, "tokenizer.ggml.bos_token_id": INT,
    "tokenizer.ggml.eos_token_id": INT, "tokenizer.ggml.eot_token_id": INT,
    "tokenizer.ggml.eom_token_id": INT, "tokenizer.ggml.unknown_token_id": INT,
    "tokenizer.ggml.padding_token_id": INT, "tokenizer.ggml.add_bos_token": BOOL,
    "tokenizer.ggml.add_eos_token": BOOL, "tokenizer.ggml.add_space_prefix": BOOL,
    "tokenizer.chat_template": STR, "powerinfer.sparse_threshold": NUMBER,
    "split.vram_capacity": INT, ACTIVATION_KEY: STR, FATRELU_KEY: NUMBERS,
}
ARCH_KEYS = {  # after "<arch>."
    "context_length": INT, "embedding_length": INT, "block_count": INT,
    "feed_forward_length": INT, "vocab_size": INT, "attention.head_count": INT,
    "attention.head_count_kv": INT, "attention.key_length": INT,
    "attention.value_length": INT, "rope.dimension_count": INT, "rope.freq_base": NUMBER,
    "rope.freq_base_swa": NUMBER, "attention.layer_norm_rms_epsilon": NUMBER,
    "attention.layer_norm_epsilon": NUMBER, "attn_logit_softcapping": NUMBER,
    "final_logit_softcapping": NUMBER, "attention.sliding_window": INT,
    "attention.sliding_window_pattern": INT_OR_FLAGS, "expert_count": INT,
    "expert_used_count": INT, "expert_weights_norm": BOOL, "expert_feed_forward_length": INT,
    "expert_shared_feed_forward_length": INT, "expert_gating_func": INT,
    "rope.scaling.type": STR, "rope.scaling.factor": NUMBER, "rope.scale_linear": NUMBER,
    "rope.scaling.original_context_length": INT, "rope.scaling.yarn_ext_factor": NUMBER,
    "rope.scaling.attn_factor": NUMBER, "rope.scaling.yarn_beta_fast": NUMBER,
    "rope.scaling.yarn_beta_slow": NUMBER,
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return _is_int(v) or isinstance(v, float)


_CHECKS = {
    INT: _is_int, NUMBER: _is_number, BOOL: lambda v: isinstance(v, bool),
    STR: lambda v: isinstance(v, str),
    INTS: lambda v: isinstance(v, list) and all(map(_is_int, v)),
    NUMBERS: lambda v: isinstance(v, list) and all(map(_is_number, v)),
    STRS: lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    INT_OR_FLAGS: lambda v: _is_int(v) or (isinstance(v, list)
                                            and all(isinstance(x, int) for x in v)),
}


def _kind(v) -> str:
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v})
        return f"a list of {'/'.join(kinds) or 'nothing'}"
    return f"{type(v).__name__} {v!r}"[:80]


def check_types(meta: Mapping[str, Any], source: str) -> None:
    """UserError naming `source` and the first key read by this package whose value has the
    wrong type."""
    arch = meta.get("general.architecture")
    prefix = f"{arch}." if isinstance(arch, str) else None
    for key, value in meta.items():
        rule = KEYS.get(key)
        if rule is None and prefix is not None and key.startswith(prefix):
            rule = ARCH_KEYS.get(key[len(prefix):])
        if rule is not None and not _CHECKS[rule](value):
            raise UserError(f"{source}: metadata {key}: expected {rule}, got {_kind(value)} "
                            "(a corrupt or hand-edited file)")
