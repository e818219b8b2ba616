"""Write a synthetic model as it is generated, one tensor at a time (a 7B model never sits in
memory): a llama GGUF (llama.cpp's layout), a PowerInfer GGUF ("PWRI", `ffn_down_t`, the
predictors) and an HF directory (safetensors, one file per layer).

Both GGUFs list every tensor (name, type, size) up front, then receive the data in that order,
which is the order `build.build` produces it in. The gate, up, attention, embedding and head
blocks are the same bytes in both files; the down projection is quantized once per layout
(along the neurons for llama.cpp, along the model dimension for PowerInfer).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from powerinfer_jax.checkpoint import gguf_arch, quants
from powerinfer_jax.checkpoint.base import expected_shapes, rope_permute
from powerinfer_jax.checkpoint.gguf import PWRI_MAGIC, TOKENIZER_WRITERS
from powerinfer_jax.checkpoint.powerinfer import SPARSE_THRESHOLD_KEY
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.synthetic.build import Layer, Tensor

_LAYER_LLAMA = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down")
_CANONICAL = {"attn_norm": "attn_norm.scale", "attn_q": "attn.q.weight",
              "attn_k": "attn.k.weight", "attn_v": "attn.v.weight",
              "attn_output": "attn.o.weight", "ffn_norm": "ffn_norm.scale",
              "ffn_gate": "ffn.gate.weight", "ffn_up": "ffn.up.weight"}


def _nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    if qtype == "F32":
        return 4 * int(np.prod(shape))
    if qtype in ("F16", "BF16"):
        return 2 * int(np.prod(shape))
    return int(np.prod(shape[:-1])) * quants.row_bytes(qtype, shape[-1])


class GGUFStream:
    """A GGUF of `arch` whose tensors are declared first (`plan`: name -> (numpy shape, type))
    and written in that order with `write(name, data)`; `close()` moves it into place."""

    def __init__(self, path: Path, config: ModelConfig, plan: dict[str, tuple[tuple, str]],
                 tokenizer_meta: Mapping[str, Any], *, name: str, powerinfer: bool,
                 file_type: int, arch: str = "llama"):
        import gguf

        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.powerinfer = powerinfer
        self.order = list(plan)
        self.plan = plan
        w = gguf.GGUFWriter(str(self.tmp), arch)
        w.add_name(name)
        for key, value in gguf_arch.model_metadata(config, arch).items():
            getattr(w, "add_" + key)(value)
        w.add_string(gguf_arch.ACTIVATION_KEY, config.activation)
        w.add_file_type(file_type)
        if powerinfer:
            w.add_float32(SPARSE_THRESHOLD_KEY, 0.0)
        for key, value in tokenizer_meta.items():
            getattr(w, TOKENIZER_WRITERS[key])(value)
        for tname, (shape, qtype) in plan.items():
            nbytes = _nbytes(qtype, shape)
            if qtype == "F32":
                w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes)
            elif qtype == "F16":
                w.add_tensor_info(tname, shape, np.dtype(np.float16), nbytes)
            elif qtype == "BF16":
                w.add_tensor_info(tname, shape, np.dtype(np.uint16), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor_info(tname, tuple(shape[:-1]) + (quants.row_bytes(qtype, shape[-1]),),
                                  np.dtype(np.uint8), nbytes,
                                  raw_dtype=gguf.GGMLQuantizationType[qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.writer = w
        self.next = 0

    def write(self, name: str, values: np.ndarray, blocks: np.ndarray | None = None) -> None:
        """The tensor `name` (next in the plan): `blocks` as stored, else `values` converted."""
        expected = self.order[self.next]
        if name != expected:
            raise RuntimeError(f"GGUFStream {self.path.name}: expected tensor {expected!r} next, "
                               f"got {name!r}")
        shape, qtype = self.plan[name]
        if blocks is not None:
            data = blocks
        elif qtype == "F32":
            data = np.asarray(values, np.float32)
        elif qtype == "F16":
            data = np.asarray(values, np.float32).astype(np.float16)
        elif qtype == "BF16":
            import ml_dtypes

            data = np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            data = quants.quantize(np.asarray(values, np.float32), qtype)
        data = np.ascontiguousarray(data)
        if data.nbytes != _nbytes(qtype, shape):
            raise RuntimeError(f"GGUFStream {self.path.name}: tensor {name!r}: expected "
                               f"{_nbytes(qtype, shape)} bytes, got {data.nbytes}")
        self.writer.write_tensor_data(data)
        self.next += 1

    def close(self) -> Path:
        if self.next != len(self.order):
            raise RuntimeError(f"GGUFStream {self.path.name}: {len(self.order) - self.next} "
                               "tensors never written")
        self.writer.close()
        if self.powerinfer:  # as PowerInfer's convert.py marks its files
            with open(self.tmp, "r+b") as f:
                f.write(PWRI_MAGIC)
        self.tmp.replace(self.path)
        return self.path


def gguf_plan(config: ModelConfig, qtype: str, *, powerinfer: bool, rank: int
              ) -> dict[str, tuple[tuple, str]]:
    """GGUF name -> (numpy shape, type), in generation order (module docstring)."""
    c = config
    d, f = c.d_model, c.d_ff
    plan: dict[str, tuple[tuple, str]] = {"token_embd.weight": ((c.vocab_size, d), qtype)}
    shapes = {"attn_norm": (d,), "attn_q": (c.q_dim, d), "attn_k": (c.kv_dim, d),
              "attn_v": (c.kv_dim, d), "attn_output": (d, c.q_dim), "ffn_norm": (d,),
              "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    for i in range(c.n_layers):
        for t in _LAYER_LLAMA:
            shape = shapes[t]
            typ = "F32" if len(shape) == 1 else qtype
            if t == "ffn_down" and powerinfer:
                plan[f"blk.{i}.ffn_down_t.weight"] = ((f, d), qtype)
            else:
                plan[f"blk.{i}.{t}.weight"] = (shape, typ)
        if powerinfer:  # PowerInfer's quantize writes them in the model's type
            hidden = 2 * (rank + 1)
            plan[f"blk.{i}.fc1.weight"] = ((hidden, d), qtype)
            plan[f"blk.{i}.fc2.weight"] = ((f, hidden), qtype)
    plan["output_norm.weight"] = ((d,), "F32")
    plan["output.weight"] = ((c.vocab_size, d), qtype)
    return plan


def file_type(qtype: str) -> int:
    import gguf

    return {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
            "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
            "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
            "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]


class Sinks:
    """Where `build.build`'s tensors go: any of the llama GGUF, the PowerInfer GGUF and the HF
    directory."""

    def __init__(self, config: ModelConfig, qtype: str, rank: int, *, gguf_path: Path | None,
                 powerinfer_path: Path | None, hf_dir: Path | None, tokenizer, tokenizer_meta,
                 hf_dtype: str = "float32", name: str = "powerinfer_jax synthetic"):
        self.config, self.qtype = config, qtype
        self.streams = []
        self.llama = self.pwri = None
        if gguf_path is not None:
            self.llama = GGUFStream(gguf_path, config, gguf_plan(config, qtype, powerinfer=False,
                                                                 rank=rank),
                                    tokenizer_meta, name=name, powerinfer=False,
                                    file_type=file_type(qtype))
            self.streams.append(self.llama)
        if powerinfer_path is not None:
            self.pwri = GGUFStream(powerinfer_path, config, gguf_plan(config, qtype,
                                                                      powerinfer=True, rank=rank),
                                   tokenizer_meta, name=name, powerinfer=True,
                                   file_type=file_type(qtype))
            self.streams.append(self.pwri)
        self.hf = None if hf_dir is None else _HFWriter(Path(hf_dir), config, tokenizer,
                                                        hf_dtype)

    def on_global(self, name: str, t: Tensor) -> None:
        gname = {"tok_embed": "token_embd.weight", "final_norm.scale": "output_norm.weight",
                 "lm_head": "output.weight"}[name]
        for s in self.streams:
            s.write(gname, t.values, t.blocks)
        if self.hf is not None:
            self.hf.add(name, t.values)

    def on_layer(self, i: int, layer: Layer) -> None:
        c = self.config
        w = layer.tensors
        heads = {"attn_q": c.n_heads, "attn_k": c.n_kv_heads}
        for s in self.streams:
            for t in _LAYER_LLAMA:
                if t == "ffn_down":
                    down_t = w["ffn.down_t.weight"].values
                    if s is self.pwri:
                        s.write(f"blk.{i}.ffn_down_t.weight", down_t)
                    else:
                        s.write(f"blk.{i}.ffn_down.weight", np.ascontiguousarray(down_t.T))
                    continue
                tensor = w[_CANONICAL[t]]
                values, blocks = tensor.values, tensor.blocks
                if t in heads:  # llama.cpp's interleaved RoPE rows (rows move whole)
                    values = rope_permute(values, heads[t])
                    blocks = None if blocks is None else rope_permute(blocks, heads[t])
                s.write(f"blk.{i}.{t}.weight", values, blocks)
            if s is self.pwri:
                s.write(f"blk.{i}.fc1.weight", layer.fc1)
                s.write(f"blk.{i}.fc2.weight", layer.fc2)
        if self.hf is not None:
            self.hf.layer(i, {f"layers.{i}.{k}": v.values for k, v in w.items()})

    def close(self) -> list[Path]:
        out = [s.close() for s in self.streams]
        if self.hf is not None:
            out.append(self.hf.close())
        return out


_HF_NAMES = {  # canonical -> HF LlamaForCausalLM
    "tok_embed": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight",
    "lm_head": "lm_head.weight", "attn_norm.scale": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
    "ffn_norm.scale": "post_attention_layernorm.weight", "ffn.gate.weight": "mlp.gate_proj.weight",
    "ffn.up.weight": "mlp.up_proj.weight", "ffn.down_t.weight": "mlp.down_proj.weight"}


class _HFWriter:
    """An HF LlamaForCausalLM directory: one safetensors file per layer plus one for the rest,
    an index, config.json and the tokenizer."""

    def __init__(self, d: Path, config: ModelConfig, tokenizer, dtype: str):
        self.dir, self.config, self.dtype = d, config, dtype
        d.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, str] = {}
        self.rest: dict[str, np.ndarray] = {}
        self.tokenizer = tokenizer

    def _convert(self, v: np.ndarray) -> np.ndarray:
        if self.dtype == "bfloat16":
            import ml_dtypes

            return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
        return np.ascontiguousarray(v, np.float32)

    def _save(self, file: str, tensors: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        save_file({k: self._convert(v) for k, v in tensors.items()}, str(self.dir / file))
        self.index.update({k: file for k in tensors})

    def add(self, name: str, values: np.ndarray) -> None:
        self.rest[_HF_NAMES[name]] = values

    def layer(self, i: int, tensors: dict[str, np.ndarray]) -> None:
        out = {}
        for name, v in tensors.items():
            key = name.split(".", 2)[2]
            if key == "ffn.down_t.weight":
                v = np.ascontiguousarray(v.T)  # HF's down_proj is [D, F]
            out[f"model.layers.{i}.{_HF_NAMES[key]}"] = v
        self._save(f"model-layer-{i:03d}.safetensors", out)

    def close(self) -> Path:
        c = self.config
        self._save("model-rest.safetensors", self.rest)
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": self.index}, indent=1))
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_act": c.activation, "hidden_size": c.d_model,
               "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
               "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
               "head_dim": c.head_dim, "max_position_embeddings": c.max_seq_len,
               "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
               "tie_word_embeddings": False, "bos_token_id": c.bos_token_id,
               "eos_token_id": list(c.eos_token_ids) or None, "torch_dtype": self.dtype,
               "attention_bias": False, "mlp_bias": False}
        (self.dir / "config.json").write_text(json.dumps(cfg, indent=1))
        self.tokenizer.backend.save(str(self.dir / "tokenizer.json"))
        return self.dir


def padded_tokenizer(meta: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """Tokenizer metadata whose token list is padded with unused tokens to `vocab_size` (a
    shape's embedding and LM head rows; text never reaches the padding)."""
    out = dict(meta)
    n = len(out["tokens"])
    if vocab_size > n:
        out["tokens"] = list(out["tokens"]) + [f"[PAD{i}]" for i in range(n, vocab_size)]
        out["token_type"] = list(out["token_type"]) + [5] * (vocab_size - n)  # UNUSED
    return out


class MoeSink:
    """A synthetic MoE model's GGUF in llama.cpp's layout for `arch` (olmoe, qwen3moe): the
    canonical tensors of checkpoint.base.expected_shapes, in that order, each placed where
    gguf_arch.sources says (the experts' down projection transposed to `ffn_down_exps` [E, D, F]
    and quantized along the neurons); vectors and the router float32."""

    def __init__(self, path: Path, config: ModelConfig, arch: str, qtype: str,
                 tokenizer_meta: Mapping[str, Any], *, name: str):
        self.sources = gguf_arch.sources(config, arch, down_t=False)
        self.qtype = qtype
        self.types = {n: "F32" if len(s) == 1 or n.endswith("ffn.router.weight") else qtype
                      for n, s in expected_shapes(config).items()}
        plan = {self.sources[n].gguf: (self.sources[n].stored, t) for n, t in self.types.items()}
        self.stream = GGUFStream(path, config, plan, padded_tokenizer(tokenizer_meta,
                                                                      config.vocab_size),
                                 name=name, powerinfer=False, file_type=file_type(qtype),
                                 arch=arch)

    def write(self, name: str, t) -> None:
        """The canonical tensor `name` (a build.Tensor), next in expected_shapes' order."""
        src = self.sources[name]
        if src.kind not in ("plain", "transposed"):
            raise RuntimeError(f"MoeSink: tensor {name!r}: layout {src.kind!r} is not written")
        values, blocks = t.values, t.blocks
        if src.kind == "transposed":
            values, blocks = np.swapaxes(values, -1, -2), None
        if blocks is not None and (t.qtype != self.types[name]):
            blocks = None
        if blocks is not None:
            blocks = blocks.reshape(tuple(src.stored[:-1]) + (-1,))
        elif self.types[name] not in ("F32", "F16", "BF16"):  # quantize rows of the stored form
            values = np.ascontiguousarray(values).reshape(-1, src.stored[-1])
        self.stream.write(src.gguf, values, blocks)

    def on_layer(self, i: int, layer) -> None:
        prefix = f"layers.{i}."
        for name in self.types:
            if name.startswith(prefix):
                self.write(name, layer.tensors[name])

    def close(self) -> Path:
        return self.stream.close()
