"""Read (and, for tests and conversion, write) GGUF files: llama.cpp's and PowerInfer's ("PWRI").

GGUF conventions this module undoes (read) and applies (write):
  * Each tensor's `ne` lists dimensions fastest-first; the numpy shape is `ne` reversed, so a GGUF
    weight is already [out, in] like a HF Linear.
  * llama.cpp's convert script permutes the rows of attn_q / attn_k per head for its interleaved
    RoPE; we restore HF's rotate-half order (`base.rope_unpermute`).
  * ffn_down is stored [D, F]; the canonical `ffn.down_t.weight` is its transpose [F, D].
    PowerInfer files store `ffn_down_t` [F, D] instead.
  * Tied embeddings: no `output.weight` tensor.
  * PowerInfer files are GGUF v3 whose first four bytes read "PWRI"; they also hold predictor
    tensors (`blk.i.fc1/fc2`, read by checkpoint/powerinfer.py, ignored here).
Architectures (llama, bamboo, falcon, opt; qwen2, qwen3, gemma2, gemma3, phi3 as llama.cpp's
converter writes them: gguf_families.py) and which activation a file means: gguf_arch.py.
Tensor types read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
(see `quants.py`): dequantized to float32, or kept as `QuantTensor` blocks (keep_quantized=True).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import gguf_arch, gguf_keys, quants
from powerinfer_jax.checkpoint.gguf_file import (GGUFFile, GGUFFormatError,
                                                 release_mapped_pages)
from powerinfer_jax.checkpoint.base import (Checkpoint, DeferredQuantTensor, QuantTensor,
                                            check_params, expected_shapes, rope_permute,
                                            rope_unpermute, unsupported_architecture)
from powerinfer_jax.checkpoint.registry import is_registry_file
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import UserError
from powerinfer_jax.tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHITECTURES = gguf_arch.ARCHITECTURES
GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"  # PowerInfer's files: a GGUF v3 with these first four bytes


def file_magic(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _open(path: Path) -> GGUFFile:
    """The parsed header of `path` (`gguf_file.GGUFFile`), or a UserError naming the file, what
    is wrong and the fix: fetch it again for a registry model's cached file, replace or
    re-convert a user's own file."""
    if not path.is_file():
        raise UserError(f"GGUF file: expected an existing file, got {str(path)!r}")
    if is_registry_file(path):
        fix = ("it is the registry model's cached copy: delete it and run again to fetch it "
               "again")
    else:
        fix = ("this is your own file: copy or download it again, or re-convert the model "
               "(llama.cpp's convert_hf_to_gguf.py)")
    try:
        reader = GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as e:
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
    gguf_keys.check_types(reader.metadata, f"GGUF file {str(path)!r}")
    return reader


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value metadata as plain python values (arrays -> lists)."""
    return dict(reader.metadata)


def _tensor_type(t) -> str:
    return t.tensor_type.name


def _read_stored(t, expected: tuple[int, ...], source: str, keep_quantized: bool):
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
    if keep_quantized and qtype in quants.QUANTIZED_TYPES and len(shape) == 3:  # experts
        return QuantTensor(data.reshape(shape[:-1] + (-1,)), qtype, shape)
    if keep_quantized and qtype in quants.QUANTIZED_TYPES and len(shape) == 2:
        # the file's own pages (a read-only view of its mmap, which stays mapped while the model
        # uses it, as llama.cpp maps its files): nothing is copied where the model's arrays can
        # alias the view (models/qweights.host_blocks: 64-byte aligned, true of every tensor of
        # a 64-aligned file); rows that move (Q/K's RoPE order) and misaligned data are copied
        # there. Like llama.cpp's mmap, a file truncated in place under a running model faults.
        return QuantTensor(rows, qtype, shape)
    return quants.dequantize(rows, qtype).reshape(shape)


def _canonical(value, src):
    """A stored tensor (array or QuantTensor) -> the canonical param, per its layout source:
    llama.cpp's RoPE rows back to HF order, a fused tensor's rows, ffn_down transposed. Rows
    move whole, so a QuantTensor's blocks move with them."""
    quantized = isinstance(value, QuantTensor)
    data = value.blocks if quantized else value
    if quantized and src.kind == "rope" and data.ndim == 2:
        # a copy, made only where the rows are read (not where the model maps them already
        # arranged: checkpoint/interleaved_file.py); the file's pages it reads leave the resident
        # set once it is made, as the interleaved copies' do
        def unpermuted(rows=data, heads=src.heads):
            out = np.ascontiguousarray(rope_unpermute(rows, heads))
            release_mapped_pages(rows)
            return out

        return DeferredQuantTensor(unpermuted, value.qtype, tuple(value.shape))
    if src.kind == "rope":
        data = rope_unpermute(data, src.heads)
    elif src.kind == "rows":
        data = data[src.start:src.stop]
    transposed = src.kind == "transposed"
    if src.kind == "vector":  # a [D] tensor read as the canonical [1, D]
        data = data.reshape(1, -1)
    if not quantized:  # transposed: the last two axes (stacked experts: [E, D, F] -> [E, F, D])
        return np.ascontiguousarray(np.swapaxes(data, -1, -2) if transposed else data)
    if data.ndim == 3:  # stacked experts: canonical = the last two axes swapped when transposed
        s = value.shape
        return QuantTensor(data, value.qtype, s[:-2] + s[:-3:-1] if transposed else s,
                           transposed)
    rows, cols = data.shape[0], value.shape[1]
    return QuantTensor(np.ascontiguousarray(data), value.qtype,
                       (cols, rows) if transposed else (rows, cols), transposed)


def _tied(tensors) -> bool:
    """No `output.weight`, or one byte-identical to `token_embd.weight` (PowerInfer's loaders
    require the tensor, so files written for it carry a copy of the embeddings)."""
    out, emb = tensors.get("output.weight"), tensors["token_embd.weight"]
    if out is None:
        return True
    return (out.tensor_type == emb.tensor_type and out.shape.tolist() == emb.shape.tolist()
            and _same_bytes(np.asarray(out.data), np.asarray(emb.data)))


def _same_bytes(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether two arrays hold the same bytes, compared a chunk at a time up to the first
    difference: np.array_equal compared all of them, so every load of an untied 7B GGUF touched
    both matrices' pages (216 MiB of the file, 5% of the process's peak memory) to find that
    their first bytes differ."""
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False
    return all(np.array_equal(a[i:i + chunk], b[i:i + chunk]) for i in range(0, a.size, chunk))


def read_config(path: str | os.PathLike) -> ModelConfig:
    """A GGUF file's ModelConfig from its header alone (no tensor is read but Llama-3's small
    rope_freqs): what `load_gguf(path).config` is."""
    path = Path(path)
    reader = _open(path)
    return _config(path, read_metadata(reader), {t.name: t for t in reader.tensors})


def _config(path: Path, meta: dict, tensors: dict) -> ModelConfig:
    source = f"GGUF file {str(path)!r}"
    powerinfer = file_magic(path) == PWRI_MAGIC
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise unsupported_architecture(arch, f"{source}: general.architecture")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{source}: expected tensor 'token_embd.weight', got none")
    blocks = meta.get(f"{arch}.block_count")
    if isinstance(blocks, int) and blocks > len(tensors):  # each layer has tensors of its own:
        # a corrupt count must fail here, not after a per-layer layout of billions of entries
        raise UserError(f"{source}: metadata {arch}.block_count: expected at most {len(tensors)} "
                        f"(the file's tensors; every layer has its own), got {blocks} (a "
                        "corrupt or hand-edited file)")
    pos = tensors.get("position_embd.weight")
    freqs = tensors.get("rope_freqs.weight")  # Llama-3's scaled RoPE (gguf_families.py)
    with _naming(source):
        return gguf_arch.config_from_metadata(
            meta, source, vocab_size=_vocab_rows(tensors["token_embd.weight"], source),
            tied=arch == "opt" or _tied(tensors), powerinfer=powerinfer,
            has_bias="blk.0.attn_qkv.bias" in tensors,
            n_positions=None if pos is None else int(pos.shape[-1]),
            rope_freqs=None if freqs is None else _read_stored(
                freqs, (int(np.prod(freqs.shape)),), source, keep_quantized=False),
            tensor_names=tuple(tensors))


def _vocab_rows(t, source: str) -> int:
    """The vocabulary size from token_embd's `ne` = [D, V]."""
    if len(t.shape) != 2:
        raise UserError(f"{source}: tensor 'token_embd.weight': expected 2 dimensions [D, V], "
                        f"got {len(t.shape)}")
    return int(t.shape[1])


@contextlib.contextmanager
def _naming(source: str):
    """A ValueError raised inside (ModelConfig's checks, the tokenizer's) names the file."""
    try:
        yield
    except ValueError as e:
        if source in str(e):
            raise
        raise UserError(f"{source}: {e}") from None


def load_gguf(path: str | os.PathLike, *, keep_quantized: bool = False) -> Checkpoint:
    """A GGUF file -> Checkpoint. Params are float32 arrays; with keep_quantized, the 2-D
    block-quantized tensors are `QuantTensor`s instead (each stored once, as its blocks)."""
    path = Path(path)
    source = f"GGUF file {str(path)!r}"
    reader = _open(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    arch = meta.get("general.architecture")
    config = _config(path, meta, tensors)
    layout = gguf_arch.sources(config, arch, down_t="blk.0.ffn_down_t.weight" in tensors,
                               separate_attn_norm="blk.0.attn_norm_2.weight" in tensors)
    params: dict[str, Any] = {}
    read: dict[str, Any] = {}  # a fused tensor is read once
    for name, src in layout.items():
        if src.gguf not in tensors:
            raise ValueError(f"{source}: expected tensor {src.gguf!r} (for {name}, shape "
                             f"{expected_shapes(config)[name]}), got none")
        if src.gguf not in read:
            stored = src.stored
            if src.kind == "vector" and int(np.prod(tensors[src.gguf].shape)) == stored[-1]:
                stored = tuple(int(n) for n in reversed(tensors[src.gguf].shape.tolist()))
            read[src.gguf] = _read_stored(tensors[src.gguf], stored, source, keep_quantized)
        params[name] = _canonical(read[src.gguf], src)
    check_params(config, params, source)
    with _naming(source):
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    return Checkpoint(config=config, params=params, tokenizer=tokenizer, source=str(path))


# ------------------------------------------------------------------------------------ writer
TOKENIZER_WRITERS = {  # tokenizer_meta key -> GGUFWriter method
    "model": "add_tokenizer_model", "pre": "add_tokenizer_pre", "tokens": "add_token_list",
    "merges": "add_token_merges", "scores": "add_token_scores", "token_type": "add_token_types",
    "bos_token_id": "add_bos_token_id", "eos_token_id": "add_eos_token_id",
    "unknown_token_id": "add_unk_token_id", "padding_token_id": "add_pad_token_id",
    "add_bos_token": "add_add_bos_token", "add_eos_token": "add_add_eos_token",
    "add_space_prefix": "add_add_space_prefix", "chat_template": "add_chat_template",
}


def write_gguf(path: str | os.PathLike, config: ModelConfig, params: Mapping[str, np.ndarray],
               tokenizer_meta: Mapping[str, Any], tensor_types: Mapping[str, str] | None = None,
               *, arch: str | None = None, default_type: str = "F32",
               overrides: Mapping[str, Any] | None = None, powerinfer: bool = False,
               extra_tensors: Mapping[str, np.ndarray] | None = None,
               extra_meta: Mapping[str, Any] | None = None) -> Path:
    """Write a GGUF from canonical params in the layout of the config's family (gguf_arch.py):
    llama/bamboo (Q/K permuted back), falcon (fused attn_qkv) or opt.

    tensor_types: canonical name -> GGML type name (`quants.QUANTIZABLE_TYPES`, or any type
    `gguf.quants.quantize` knows, e.g. "MXFP4" to test rejection); others `default_type`. A param
    given as a `QuantTensor` (any GGML type, e.g. random K-quant blocks) is written as its blocks.
    tokenizer_meta: keys of `TOKENIZER_WRITERS` (e.g. {"model": "gpt2", "tokens": [...], ...}).
    powerinfer: PowerInfer's layout and magic: `ffn_down_t` [F, D] instead of `ffn_down`, the
    untied `output.weight` its llama and falcon loaders require (a copy of the embeddings when
    tied), and "PWRI" as the first four bytes. extra_tensors: GGUF name -> array (float32,
    written as F32 unless `tensor_types` names it: the predictors' fc1/fc2); extra_meta: key ->
    value (float -> FLOAT32, str, bool, int -> UINT32).
    `arch` only renames the metadata prefix, and `overrides` ({"block_count": 3, ...}) replaces
    model metadata values; tests use both to write inconsistent or unsupported files.
    """
    import gguf

    layout = gguf_arch.layout_arch(config)
    tensor_types = dict(tensor_types or {})
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch or layout)
    w.add_name("powerinfer_jax model")
    model_meta = gguf_arch.model_metadata(config, layout)
    model_meta.update(overrides or {})
    for key, value in model_meta.items():  # GGUFWriter.add_<key> writes "<arch>.<gguf key>"
        getattr(w, "add_" + key)(value)
    w.add_string(gguf_arch.ACTIVATION_KEY, config.activation)
    if config.fatrelu_thresholds:
        w.add_array(gguf_arch.FATRELU_KEY, [float(t) for t in config.fatrelu_thresholds])
    for key, value in (extra_meta or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, str(value))
    for key, value in tokenizer_meta.items():
        if key not in TOKENIZER_WRITERS:
            raise ValueError(f"write_gguf tokenizer_meta: expected keys in {list(TOKENIZER_WRITERS)}, "
                             f"got {key!r}")
        getattr(w, TOKENIZER_WRITERS[key])(value)
    shared_norm = layout == "falcon" and all(
        np.array_equal(params[f"layers.{i}.attn_norm.{k}"], params[f"layers.{i}.ffn_norm.{k}"])
        for i in range(config.n_layers) for k in ("scale", "bias"))
    sources = gguf_arch.sources(config, layout, down_t=powerinfer,
                                separate_attn_norm=not shared_norm)
    stored: dict[str, tuple[np.ndarray, str]] = {}  # GGUF name -> (array, type), in write order
    for name in expected_shapes(config):
        src = sources[name]
        if isinstance(params[name], QuantTensor):  # its blocks, in its own type
            value, qtype = _stored_blocks(params[name], name, src), params[name].qtype
            if src.kind == "rows":
                prev = stored.get(src.gguf, (value[:0], qtype))[0]
                value = np.concatenate([prev, value])
            stored[src.gguf] = (value, qtype)
            continue
        value = np.asarray(params[name], dtype=np.float32)
        if src.kind == "rope":
            value = rope_permute(value, src.heads)
        elif src.kind == "transposed":
            value = value.T
        qtype = tensor_types.get(name, default_type if value.ndim > 1 else "F32")
        if src.kind == "rows":  # a fused tensor: its parts arrive in order q, k, v
            prev = stored.get(src.gguf, (np.zeros((0,) + value.shape[1:], np.float32), qtype))[0]
            value = np.concatenate([prev, value])
        elif src.gguf in stored:  # one file tensor for two canonical ones (a shared norm)
            continue
        stored[src.gguf] = (value, qtype)
    if powerinfer and config.tie_embeddings and layout in ("llama", "bamboo", "falcon"):
        stored["output.weight"] = (np.asarray(params["tok_embed"], np.float32),
                                   tensor_types.get("tok_embed", default_type))
    for gname, value in (extra_tensors or {}).items():
        stored[gname] = (np.asarray(value, np.float32), tensor_types.get(gname, "F32"))
    for gname, (value, qtype) in stored.items():
        value = np.ascontiguousarray(value)
        if value.dtype == np.uint8:  # blocks of a QuantTensor
            w.add_tensor(gname, value, raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif qtype == "F32":
            w.add_tensor(gname, value)
        elif qtype == "F16":
            w.add_tensor(gname, value.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]  # types we do not read: tests of rejection
            data = (quants.quantize(value, qtype) if qtype in quants.QUANTIZABLE_TYPES
                    else gguf.quants.quantize(value, kind))
            w.add_tensor(gname, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if powerinfer:
        with open(path, "r+b") as f:  # as PowerInfer's convert.py does after writing a GGUF
            f.write(PWRI_MAGIC)
    return path


def tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's tokenizer metadata as `write_gguf`'s tokenizer_meta (keys of
    TOKENIZER_WRITERS): to write another model with the same tokenizer."""
    out = {}
    for key, value in read_metadata(_open(Path(path))).items():
        short = key.removeprefix("tokenizer.ggml.").removeprefix("tokenizer.")
        if key.startswith("tokenizer.") and short in TOKENIZER_WRITERS:
            out[short] = value
    return out


def _stored_blocks(t: QuantTensor, name: str, src) -> np.ndarray:
    """A canonical QuantTensor's blocks in the file's layout (RoPE rows permuted back)."""
    if t.transposed != (src.kind == "transposed"):
        raise ValueError(f"write_gguf: {name}: expected a QuantTensor with transposed="
                         f"{src.kind == 'transposed'} (the file's stored orientation), got "
                         f"{t.transposed}")
    blocks = np.asarray(t.blocks, np.uint8)
    return np.ascontiguousarray(rope_permute(blocks, src.heads) if src.kind == "rope" else blocks)
