"""Read (and, for tests and conversion, write) llama-architecture GGUF files.

GGUF conventions this module undoes (read) and applies (write):
  * Each tensor's `ne` lists dimensions fastest-first; the numpy shape is `ne` reversed, so a GGUF
    weight is already [out, in] like a HF Linear.
  * llama.cpp's convert script permutes the rows of attn_q / attn_k per head for its interleaved
    RoPE; we restore HF's rotate-half order (`base.rope_unpermute`).
  * ffn_down is stored [D, F]; the canonical `ffn.down_t.weight` is its transpose [F, D].
  * Tied embeddings: no `output.weight` tensor.
Tensor types read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(see `quants.py`): dequantized to float32, or kept as `QuantTensor` blocks (keep_quantized=True).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import quants
from powerinfer_jax.checkpoint.base import (Checkpoint, QuantTensor, check_params,
                                            expected_shapes, rope_permute, rope_unpermute,
                                            unsupported_architecture)
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# canonical name suffix -> GGUF name suffix, per layer ("layers.{i}." <-> "blk.{i}.")
_LAYER_NAMES = {
    "attn_norm.scale": "attn_norm.weight",
    "attn.q.weight": "attn_q.weight",
    "attn.k.weight": "attn_k.weight",
    "attn.v.weight": "attn_v.weight",
    "attn.o.weight": "attn_output.weight",
    "ffn_norm.scale": "ffn_norm.weight",
    "ffn.gate.weight": "ffn_gate.weight",
    "ffn.up.weight": "ffn_up.weight",
    "ffn.down_t.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"tok_embed": "token_embd.weight", "final_norm.scale": "output_norm.weight",
                 "lm_head": "output.weight"}


def gguf_name(canonical: str) -> str:
    if canonical in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[canonical]
    _, layer, rest = canonical.split(".", 2)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def _open(path: Path):
    """A GGUFReader on `path`, or a UserError naming the file, what is wrong and the fix: fetch
    it again for a registry model's cached file, replace or re-convert a user's own file."""
    from gguf import GGUFReader

    from powerinfer_jax.checkpoint.registry import is_registry_file
    from powerinfer_jax.errors import UserError

    if not path.is_file():
        raise UserError(f"GGUF file: expected an existing file, got {str(path)!r}")
    if is_registry_file(path):
        fix = ("it is the registry model's cached copy: delete it and run again to fetch it "
               "again")
    else:
        fix = ("this is your own file: copy or download it again, or re-convert the model "
               "(llama.cpp's convert_hf_to_gguf.py)")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # GGUFReader raises ValueError/IndexError/KeyError/OSError on bad bytes
        with open(path, "rb") as f:
            magic = f.read(4)
        what = ("not a GGUF file (it does not start with b'GGUF')"
                if magic not in (b"GGUF", b"PWRI") else "truncated or corrupt")
        raise UserError(f"GGUF file {str(path)!r}: expected a complete GGUF v2/v3 file, got one "
                        f"that cannot be parsed ({type(e).__name__}: {e}): the file is {what}; "
                        f"{fix}") from None
    size = path.stat().st_size
    for t in reader.tensors:  # a memmap past the end only fails when touched, so check up front
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise UserError(f"GGUF file {str(path)!r}: tensor {t.name!r}: expected its data to end "
                            f"within the file ({size} bytes), got an end at byte "
                            f"{int(t.data_offset) + int(t.n_bytes)}: the file is truncated; {fix}")
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata as plain python values (arrays -> lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        out[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def _require(meta: Mapping[str, Any], key: str, source: str):
    if key not in meta:
        raise ValueError(f"{source}: expected metadata key {key!r}, got none "
                         "(the file is not a complete llama GGUF)")
    return meta[key]


def config_from_metadata(meta: Mapping[str, Any], source: str,
                         vocab_size: int | None = None, tied: bool = False) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise unsupported_architecture(arch, f"{source}: general.architecture")
    a = arch + "."
    d = int(_require(meta, a + "embedding_length", source))
    n_heads = int(_require(meta, a + "attention.head_count", source))
    head_dim = int(meta.get(a + "rope.dimension_count") or meta.get(a + "attention.key_length")
                   or d // n_heads)
    if vocab_size is None:
        vocab_size = int(meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    return ModelConfig(
        arch="llama", vocab_size=vocab_size, d_model=d,
        n_layers=int(_require(meta, a + "block_count", source)),
        n_heads=n_heads, n_kv_heads=int(meta.get(a + "attention.head_count_kv", n_heads)),
        head_dim=head_dim, d_ff=int(_require(meta, a + "feed_forward_length", source)),
        max_seq_len=int(_require(meta, a + "context_length", source)),
        activation="silu", gated=True, bias=False, norm="rms",
        norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        positions="rope", rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        tie_embeddings=tied, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
    )


def _tensor_type(t) -> str:
    return t.tensor_type.name


def _read_tensor(t, expected: tuple[int, ...], source: str, keep_quantized: bool):
    """The tensor's stored matrix (numpy shape `expected`): float32, or a `QuantTensor` of its
    blocks when it is block-quantized and keep_quantized is set (no float copy is made)."""
    qtype = _tensor_type(t)
    if qtype not in quants.SUPPORTED_TYPES:
        raise ValueError(f"{source}: tensor {t.name!r}: expected type one of "
                         f"{list(quants.SUPPORTED_TYPES)}, got {qtype} (requantize the model to "
                         "one of these, e.g. with llama.cpp's llama-quantize)")
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if shape != expected:
        raise ValueError(f"{source}: tensor {t.name!r}: expected shape {expected} (numpy order) "
                         f"from the metadata, got {shape}")
    data = np.asarray(t.data)
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    if keep_quantized and qtype in quants.QUANTIZED_TYPES and len(shape) == 2:
        return QuantTensor(np.array(rows, dtype=np.uint8), qtype, shape)  # a copy: the file closes
    return quants.dequantize(rows, qtype).reshape(shape)


def _canonical(value, name: str, config: ModelConfig):
    """A stored tensor (array or QuantTensor) -> the canonical param: Q/K rows back to HF order
    (rows permute whole, so blocks permute with them), ffn_down transposed."""
    heads = {"attn.q.weight": config.n_heads, "attn.k.weight": config.n_kv_heads}
    n = heads.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
    transposed = name.endswith("ffn.down_t.weight")
    if isinstance(value, QuantTensor):
        blocks = rope_unpermute(value.blocks, n) if n is not None else value.blocks
        shape = value.shape[::-1] if transposed else value.shape
        return QuantTensor(np.ascontiguousarray(blocks), value.qtype, shape, transposed)
    if n is not None:
        value = rope_unpermute(value, n)
    return np.ascontiguousarray(value.T) if transposed else value


def load_gguf(path: str | os.PathLike, *, keep_quantized: bool = False) -> Checkpoint:
    """A GGUF file -> Checkpoint. Params are float32 arrays; with keep_quantized, the 2-D
    block-quantized tensors are `QuantTensor`s instead (each stored once, as its blocks)."""
    path = Path(path)
    source = f"GGUF file {str(path)!r}"
    reader = _open(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise unsupported_architecture(arch, f"{source}: general.architecture")
        raise ValueError(f"{source}: expected tensor 'token_embd.weight', got none")
    vocab = int(tensors["token_embd.weight"].shape[1])  # ne = [D, V]
    config = config_from_metadata(meta, source, vocab_size=vocab,
                                  tied="output.weight" not in tensors)
    params: dict[str, Any] = {}
    for name, shape in expected_shapes(config).items():
        g = gguf_name(name)
        if g not in tensors:
            raise ValueError(f"{source}: expected tensor {g!r} (for {name}, shape {shape}), got none")
        stored = shape[::-1] if name.endswith("ffn.down_t.weight") else shape
        params[name] = _canonical(_read_tensor(tensors[g], stored, source, keep_quantized), name,
                                  config)
    check_params(config, params, source)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    return Checkpoint(config=config, params=params, tokenizer=tokenizer, source=str(path))


# ------------------------------------------------------------------------------------ writer
_TOKENIZER_WRITERS = {  # tokenizer_meta key -> GGUFWriter method
    "model": "add_tokenizer_model", "pre": "add_tokenizer_pre", "tokens": "add_token_list",
    "merges": "add_token_merges", "scores": "add_token_scores", "token_type": "add_token_types",
    "bos_token_id": "add_bos_token_id", "eos_token_id": "add_eos_token_id",
    "unknown_token_id": "add_unk_token_id", "padding_token_id": "add_pad_token_id",
    "add_bos_token": "add_add_bos_token", "add_eos_token": "add_add_eos_token",
    "add_space_prefix": "add_add_space_prefix", "chat_template": "add_chat_template",
}


def write_gguf(path: str | os.PathLike, config: ModelConfig, params: Mapping[str, np.ndarray],
               tokenizer_meta: Mapping[str, Any], tensor_types: Mapping[str, str] | None = None,
               *, arch: str = "llama", default_type: str = "F32",
               overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a llama-convention GGUF from canonical params (Q/K permuted back, ffn_down [D, F]).

    tensor_types: canonical name -> GGML type name (`quants.QUANTIZABLE_TYPES`, or any type
    `gguf.quants.quantize` knows, e.g. "MXFP4" to test rejection); others `default_type`. A param
    given as a `QuantTensor` (any GGML type, e.g. random K-quant blocks) is written as its blocks.
    tokenizer_meta: keys of `_TOKENIZER_WRITERS` (e.g. {"model": "gpt2", "tokens": [...], ...}).
    `arch` only renames the metadata prefix, and `overrides` ({"block_count": 3, ...}) replaces
    model metadata values; tests use both to write inconsistent or unsupported files.
    """
    import gguf

    if config.arch != "llama" or config.bias or not config.gated:
        raise ValueError(f"write_gguf: expected a llama-family config (gated, no bias), got "
                         f"arch={config.arch!r} gated={config.gated} bias={config.bias}")
    tensor_types = dict(tensor_types or {})
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("powerinfer_jax test model")
    model_meta = {
        "context_length": config.max_seq_len, "embedding_length": config.d_model,
        "block_count": config.n_layers, "feed_forward_length": config.d_ff,
        "head_count": config.n_heads, "head_count_kv": config.n_kv_heads,
        "rope_dimension_count": config.head_dim, "key_length": config.head_dim,
        "value_length": config.head_dim, "rope_freq_base": config.rope_theta,
        "layer_norm_rms_eps": config.norm_eps, "vocab_size": config.vocab_size,
    }
    model_meta.update(overrides or {})
    for key, value in model_meta.items():  # GGUFWriter.add_<key> writes "<arch>.<gguf key>"
        getattr(w, "add_" + key)(value)
    for key, value in tokenizer_meta.items():
        if key not in _TOKENIZER_WRITERS:
            raise ValueError(f"write_gguf tokenizer_meta: expected keys in {list(_TOKENIZER_WRITERS)}, "
                             f"got {key!r}")
        getattr(w, _TOKENIZER_WRITERS[key])(value)
    for name in expected_shapes(config):
        if isinstance(params[name], QuantTensor):  # written as its blocks, in its own type
            w.add_tensor(gguf_name(name), _stored_blocks(params[name], name, config),
                         raw_dtype=gguf.GGMLQuantizationType[params[name].qtype])
            continue
        value = np.asarray(params[name], dtype=np.float32)
        if name.endswith("attn.q.weight"):
            value = rope_permute(value, config.n_heads)
        elif name.endswith("attn.k.weight"):
            value = rope_permute(value, config.n_kv_heads)
        elif name.endswith("ffn.down_t.weight"):
            value = value.T
        value = np.ascontiguousarray(value)
        qtype = tensor_types.get(name, default_type if value.ndim > 1 else "F32")
        if qtype == "F32":
            w.add_tensor(gguf_name(name), value)
        elif qtype == "F16":
            w.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]  # types we do not read: tests of rejection
            data = (quants.quantize(value, qtype) if qtype in quants.QUANTIZABLE_TYPES
                    else gguf.quants.quantize(value, kind))
            w.add_tensor(gguf_name(name), data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stored_blocks(t: QuantTensor, name: str, config: ModelConfig) -> np.ndarray:
    """A canonical QuantTensor's blocks in the file's layout (Q/K rows permuted back)."""
    if t.transposed != name.endswith("ffn.down_t.weight"):
        raise ValueError(f"write_gguf: {name}: expected a QuantTensor with transposed="
                         f"{not t.transposed} (GGUF's stored orientation), got {t.transposed}")
    heads = {"attn.q.weight": config.n_heads, "attn.k.weight": config.n_kv_heads}
    n = heads.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
    blocks = np.asarray(t.blocks, np.uint8)
    return np.ascontiguousarray(rope_permute(blocks, n) if n is not None else blocks)
