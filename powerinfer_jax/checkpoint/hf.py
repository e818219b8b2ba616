"""Read a Hugging Face model directory: config.json + model.safetensors (or sharded, with
model.safetensors.index.json) + tokenizer.json.

Supported: LlamaForCausalLM / MistralForCausalLM (model_type "llama"/"mistral": GQA, hidden_act
silu/relu, tied or untied embeddings), dReLU llamas (model_type "bamboo", PowerInfer's Bamboo,
whose MLP is relu(gate) * relu(up) whatever its hidden_act says; or a llama/mistral config with
hidden_act "drelu", our spelling), OPTForCausalLM (ReLU, pre-LayerNorm, biases, learned
positions with OPT's offset of 2) and FalconForCausalLM (hf_falcon.py: its fused QKV is split
at load). HF already stores Q/K in the rotate-half layout we use, so the other reshuffle is the
FFN down projection, transposed to neuron-major `ffn.down_t.weight`.
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
from powerinfer_jax.checkpoint.base import Checkpoint, check_params, unsupported_architecture
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.tokenizer import Tokenizer

LLAMA_TYPES = ("llama", "mistral", "bamboo")
OPT_TYPES = ("opt",)
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}

# HF name (prefix stripped) -> canonical; "{i}" is the layer index.
_LLAMA_NAMES = {
    "embed_tokens.weight": "tok_embed",
    "norm.weight": "final_norm.scale",
    "lm_head.weight": "lm_head",
    "layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.scale",
    "layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q.weight",
    "layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k.weight",
    "layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v.weight",
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.scale",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.ffn.gate.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.ffn.up.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.ffn.down_t.weight",  # transposed on load
}
_OPT_NAMES = {
    "embed_tokens.weight": "tok_embed",
    "embed_positions.weight": "pos_embed",
    "final_layer_norm.weight": "final_norm.scale",
    "final_layer_norm.bias": "final_norm.bias",
    "lm_head.weight": "lm_head",
    "layers.{i}.self_attn_layer_norm.weight": "layers.{i}.attn_norm.scale",
    "layers.{i}.self_attn_layer_norm.bias": "layers.{i}.attn_norm.bias",
    "layers.{i}.final_layer_norm.weight": "layers.{i}.ffn_norm.scale",
    "layers.{i}.final_layer_norm.bias": "layers.{i}.ffn_norm.bias",
    "layers.{i}.fc1.weight": "layers.{i}.ffn.up.weight",
    "layers.{i}.fc1.bias": "layers.{i}.ffn.up.bias",
    "layers.{i}.fc2.weight": "layers.{i}.ffn.down_t.weight",  # transposed on load
    "layers.{i}.fc2.bias": "layers.{i}.ffn.down.bias",
}
for _hf, _ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
    for _kind in ("weight", "bias"):
        _OPT_NAMES[f"layers.{{i}}.self_attn.{_hf}.{_kind}"] = f"layers.{{i}}.attn.{_ours}.{_kind}"


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
def _get(cfg: Mapping[str, Any], key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: expected key {key!r} in config.json, got none")
    return cfg[key]


def _eos_ids(cfg: Mapping[str, Any], d: Path) -> tuple[int, ...]:
    ids: list[int] = []
    gen = d / "generation_config.json"
    for source in (cfg, json.loads(gen.read_text()) if gen.is_file() else {}):
        eos = source.get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _rope_theta(cfg: Mapping[str, Any], source: str) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{source}: rope type: expected 'default' (plain RoPE), got {kind!r} "
                         "(scaled RoPE variants are not implemented)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def config_from_hf(cfg: Mapping[str, Any], d: Path, source: str) -> ModelConfig:
    model_type = cfg.get("model_type")
    common = dict(vocab_size=int(_get(cfg, "vocab_size", source)),
                  d_model=int(_get(cfg, "hidden_size", source)),
                  n_layers=int(_get(cfg, "num_hidden_layers", source)),
                  n_heads=int(_get(cfg, "num_attention_heads", source)),
                  max_seq_len=int(_get(cfg, "max_position_embeddings", source)),
                  bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg, d))
    if model_type in LLAMA_TYPES:
        act = "drelu" if model_type == "bamboo" else cfg.get("hidden_act", "silu")
        if act not in ("silu", "relu", "drelu"):
            raise ValueError(f"{source}: hidden_act: expected 'silu', 'relu' or 'drelu', got "
                             f"{act!r}")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{source}: {key}: expected false for the llama family, got true")
        return ModelConfig(
            arch="llama", **common, n_kv_heads=int(cfg.get("num_key_value_heads") or common["n_heads"]),
            head_dim=int(cfg.get("head_dim") or common["d_model"] // common["n_heads"]),
            d_ff=int(_get(cfg, "intermediate_size", source)), activation=act, gated=True,
            bias=False, norm="rms", norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), positions="rope",
            rope_theta=_rope_theta(cfg, source),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if model_type in OPT_TYPES:
        rules = [("activation_function", "relu", "OPT runs with ReLU only"),
                 ("do_layer_norm_before", True, "post-LayerNorm OPT (350m) is not supported"),
                 ("enable_bias", True, "OPT without biases is not supported"),
                 ("layer_norm_elementwise_affine", True, "LayerNorms need a scale and bias"),
                 ("word_embed_proj_dim", common["d_model"],
                  "word_embed_proj_dim must equal hidden_size (no project_in/out)")]
        for key, want, hint in rules:
            got = cfg.get(key, want)
            if got != want:
                raise ValueError(f"{source}: {key}: expected {want!r}, got {got!r} ({hint})")
        return ModelConfig(
            arch="opt", **common, n_kv_heads=common["n_heads"],
            head_dim=common["d_model"] // common["n_heads"], d_ff=int(_get(cfg, "ffn_dim", source)),
            activation="relu", gated=False, bias=True, norm="layer", norm_eps=1e-5,
            positions="learned", position_offset=2,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if model_type == "falcon":
        return hf_falcon.config(cfg, common, source, _rope_theta(cfg, source))
    arch = (cfg.get("architectures") or [model_type])[0]
    raise unsupported_architecture(arch, source, f" (model_type {model_type!r})")


# ------------------------------------------------------------------------------------ params
def _strip_prefix(name: str) -> str:
    if name.startswith("transformer.h."):  # Falcon
        return "layers." + name[len("transformer.h."):]
    for prefix in ("model.decoder.", "model.", "decoder.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _canonical(hf_name: str, table: Mapping[str, str]) -> str | None:
    name = _strip_prefix(hf_name)
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        ours = table.get("layers.{i}." + rest)
        return ours.replace("{i}", i) if ours else None
    return table.get(name)


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
    table = {"llama": _LLAMA_NAMES, "opt": _OPT_NAMES, "falcon": hf_falcon.NAMES}[config.arch]
    params: dict[str, np.ndarray] = {}
    for file in _weight_files(d):
        for hf_name, value in read_safetensors(file).items():
            name = _canonical(hf_name, table)
            if name is None or (name == "lm_head" and config.tie_embeddings):
                continue  # e.g. rotary inv_freq buffers, a duplicated tied head
            if name.endswith("ffn.down_t.weight"):
                value = np.ascontiguousarray(value.T)
            if ".qkv." in name:  # Falcon's fused query_key_value
                stem, kind = name.rsplit(".qkv.", 1)
                for part, v in zip("qkv", hf_falcon.split_qkv(value, hf_falcon.layout(cfg), config)):
                    params[f"{stem}.attn.{part}.{kind}"] = v
                continue
            params[name] = value
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
