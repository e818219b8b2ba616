"""Read a Hugging Face model directory: config.json + model.safetensors (or sharded, with
model.safetensors.index.json) + tokenizer.json.

Which model_types are read and how (config fields, tensor names, fused tensors, Gemma's norm
weights): one row each in hf_families.FAMILIES (llama, mistral, bamboo, qwen2, qwen3, gemma2,
gemma3_text, phi3, opt, falcon). HF already stores Q/K in the rotate-half layout we use, so the
reshuffle every family shares is the FFN down projection, transposed to neuron-major
`ffn.down_t.weight`.
Safetensors are read with a small numpy reader (no torch), which also handles BF16.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import hf_falcon
from powerinfer_jax.checkpoint import hf_families as families
from powerinfer_jax.checkpoint import hf_moe
from powerinfer_jax.checkpoint.base import (Checkpoint, check_params, fatrelu_thresholds,
                                            unsupported_architecture)
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.tokenizer import Tokenizer

FAMILIES = {**families.FAMILIES, **hf_moe.FAMILIES}  # model_type -> its row
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


# ------------------------------------------------------------------------------- safetensors
def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 numpy arrays."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {str(path)!r}: expected an 8-byte header length, "
                             f"got a {size}-byte file; it is truncated or not safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"safetensors file {str(path)!r}: expected a header of at most "
                             f"{size - 8} bytes, got a header length of {n}; truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"safetensors file {str(path)!r}: expected a JSON header, got "
                             f"unparseable bytes ({e})") from e
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors file {str(path)!r}: tensor {name!r}: expected dtype one "
                             f"of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
        start, stop = info["data_offsets"]
        if data is None or stop > data.shape[0]:
            raise ValueError(f"safetensors file {str(path)!r}: tensor {name!r}: expected its data "
                             f"within the file, got an end at byte {8 + n + stop} of {size}; truncated")
        values = np.frombuffer(data[start:stop], dtype=_SAFETENSORS_DTYPES[dtype])
        if dtype == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        out[name] = values.astype(np.float32).reshape(info["shape"])
    return out


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [d / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(d.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(f"HF directory {str(d)!r}: expected model.safetensors or the shards its "
                         f"index lists, got {'missing ' + ', '.join(missing) if missing else 'none'} "
                         "(PyTorch .bin checkpoints are not supported: re-save with safetensors)")
    return files


# ------------------------------------------------------------------------------------ config
def config_from_hf(cfg: Mapping[str, Any], d: Path, source: str) -> ModelConfig:
    """ModelConfig of a config.json, by its model_type's row in hf_families.FAMILIES."""
    family = FAMILIES.get(cfg.get("model_type"))
    if family is None:
        arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
        raise unsupported_architecture(arch, source, f" (model_type {cfg.get('model_type')!r})")
    config = family.config(cfg, families.common_fields(cfg, d, source), source)
    if cfg.get("fatrelu_threshold") is None:
        return config
    return config.replace(fatrelu_thresholds=fatrelu_thresholds(
        cfg["fatrelu_threshold"], config.n_layers, f"{source}: fatrelu_threshold"))


# ------------------------------------------------------------------------------------ params
def _strip_prefix(name: str) -> str:
    if name.startswith("transformer.h."):  # Falcon
        return "layers." + name[len("transformer.h."):]
    for prefix in ("model.decoder.", "model.", "decoder.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _canonical(hf_name: str, table: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(canonical name, expert index or None) of an HF tensor name."""
    name = _strip_prefix(hf_name)
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        rest, expert = hf_moe.expert_of(rest)
        ours = table.get("layers.{i}." + rest)
        return (ours.replace("{i}", i) if ours else None), expert
    return table.get(name), None


def load_hf(path: str | os.PathLike) -> Checkpoint:
    d = Path(path)
    source = f"HF directory {str(d)!r}"
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{source}: expected a config.json, got none")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: expected config.json to be JSON, got a parse error ({e})") from e
    config = config_from_hf(cfg, d, source)
    family = FAMILIES[cfg["model_type"]]
    params: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, np.ndarray]] = {}  # MoE: stacked once all are read
    for file in _weight_files(d):
        for hf_name, value in read_safetensors(file).items():
            name, expert = _canonical(hf_name, family.names)
            if name is None or (name == "lm_head" and config.tie_embeddings):
                continue  # e.g. rotary inv_freq buffers, a duplicated tied head
            if name.endswith(("experts.gate_up", "experts.down_proj")):
                params.update(hf_moe.split_fused(name, value, config))
                continue
            if name.endswith("down_t.weight"):  # an FFN's, an expert's, a shared expert's
                value = np.ascontiguousarray(value.T)
            if expert is not None:
                per_expert.setdefault(name, {})[expert] = value
                continue
            if family.norm_shift and name.endswith(".scale"):  # Gemma: (1 + w) folded once
                value = value + np.float32(family.norm_shift)
            if ".qkv." in name or ".gate_up." in name:  # fused tensors: their parts
                params.update(family.split(name, value, cfg, config))
                continue
            params[name] = value
    params.update(hf_moe.stack(per_expert, config, source))
    if config.arch == "falcon":
        hf_falcon.finish(params, config)
    check_params(config, params, source)
    tok_path = d / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"{source}: expected a tokenizer.json, got none (save the tokenizer with "
                         "the model: tokenizer.save_pretrained(dir))")
    tokenizer = Tokenizer.from_file(tok_path, bos_id=config.bos_token_id,
                                    eos_ids=config.eos_token_ids)
    if not config.eos_token_ids and tokenizer.eos_ids:
        config = config.replace(eos_token_ids=tokenizer.eos_ids)
    return Checkpoint(config=config, params=params, tokenizer=tokenizer, source=str(d))
