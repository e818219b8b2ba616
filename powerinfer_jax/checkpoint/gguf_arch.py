"""GGUF architectures: how each family's config and tensors are laid out in a GGUF file.

One table per architecture maps canonical names (checkpoint/base.py) to GGUF tensors, with the
transform between them; gguf.py reads and writes through `sources`. Architectures:

  llama   llama.cpp's llama (Llama-2, Mistral, SmolLM2; ReLU-LLaMA/ProSparse in PowerInfer files)
  bamboo  PowerInfer's dReLU llama (Bamboo, TurboSparse): llama's layout, a = relu(g) * relu(u)
  falcon  llama.cpp's falcon: fused attn_qkv ("jploski" layout: all Q heads, then K, then V),
          LayerNorm with bias, non-gated FFN, parallel attention and FFN, NEOX (rotate-half)
          RoPE so Q/K rows are not permuted. attn_norm feeds the FFN (HF ln_mlp / the shared
          input_layernorm); attn_norm_2, when present, feeds attention (HF ln_attn).
  opt     PowerInfer's opt: biases everywhere, learned positions (2050 rows, offset 2), tied head.
  qwen2, qwen3, gemma2, gemma3, phi3: llama.cpp's, see gguf_families.py (also the RoPE
          scalings every llama-like arch may carry: linear, yarn, a rope_freqs tensor).

Which activation a file means (its FFN's `ModelConfig.activation`), in order:
  1. our key `powerinfer_jax.ffn_activation`, which every file we write carries;
  2. arch bamboo -> "drelu"; arch opt -> "relu";
  3. a PowerInfer file (magic "PWRI") of arch llama or falcon -> "relu": PowerInfer's sparse graph
     runs ReLU for both (llama.cpp: llm_build_ffn_sparse with LLM_FFN_RELU);
  4. otherwise llama.cpp's meaning: llama -> "silu", falcon -> "gelu" (tanh form, as ggml_gelu).
A plain llama GGUF of a ReLU model converted by someone else's tool reads as SiLU: the file does
not say otherwise. PowerInfer files store the down projection transposed (`ffn_down_t`, numpy
[F, D], our `ffn.down_t.weight` as is); llama.cpp files store `ffn_down` ([D, F]).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from powerinfer_jax.checkpoint import gguf_families, gguf_moe
from powerinfer_jax.checkpoint.base import (expected_shapes, fatrelu_thresholds,
                                            unsupported_architecture)
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import fail

ARCHITECTURES = ("llama", "bamboo", "falcon", "opt") + gguf_families.ARCHITECTURES
ACTIVATION_KEY = "powerinfer_jax.ffn_activation"
# FATReLU's per-layer gate thresholds (ModelConfig.fatrelu_thresholds), an array of floats; our key
FATRELU_KEY = "powerinfer_jax.fatrelu_thresholds"
_DEFAULT_ACTIVATION = {"llama": "silu", "bamboo": "drelu", "falcon": "gelu", "opt": "relu",
                       "qwen2": "silu", "qwen3": "silu", "phi3": "silu", "gemma2": "gelu",
                       "gemma3": "gelu", "qwen2moe": "silu", "qwen3moe": "silu",
                       "olmoe": "silu"}
_POWERINFER_ACTIVATION = {"llama": "relu", "bamboo": "drelu", "falcon": "relu", "opt": "relu"}
_ALLOWED = {"llama": ("silu", "relu", "gelu"), "bamboo": ("drelu",), "falcon": ("relu", "gelu"),
            "opt": ("relu",), "qwen2": ("silu", "relu"), "qwen3": ("silu", "relu"),
            "phi3": ("silu", "relu"), "gemma2": ("gelu",), "gemma3": ("gelu",),
            "qwen2moe": ("silu",), "qwen3moe": ("silu", "relu"), "olmoe": ("silu", "relu")}


class Source(NamedTuple):
    """Where a canonical tensor lives in a GGUF file.

    gguf: the GGUF tensor name; stored: its numpy shape (GGUF `ne` reversed);
    kind: "plain" (as stored), "rope" (llama.cpp's interleaved RoPE rows: un-permute with `heads`),
    "transposed" (canonical = stored.T) or "rows" (canonical = stored[start:stop], a fused tensor).
    """

    gguf: str
    stored: tuple[int, ...]
    kind: str = "plain"
    heads: int = 0
    start: int = 0
    stop: int = 0


def layout_arch(config: ModelConfig) -> str:
    """The GGUF architecture a config is written as (our writer: llama, bamboo, falcon, opt;
    the other families' files are llama.cpp's convert_hf_to_gguf.py's to write)."""
    c = config
    extra = [n for n, on in (("qkv_bias", c.qkv_bias), ("qk_norm", c.qk_norm),
                             ("post_norms", c.post_norms), ("embed_scale", c.embed_scale != 1),
                             ("query_scale", c.query_scale is not None),
                             ("soft-caps", c.attn_softcap or c.final_softcap),
                             ("layer_windows", any(c.layer_windows)),
                             ("rope_scaling", c.rope_scaling is not None)) if on]
    if extra:
        fail("write_gguf config", "a llama, dReLU llama, falcon or opt model (our writer's "
             "layouts)", f"one with {', '.join(extra)}",
             "convert the HF directory with llama.cpp's convert_hf_to_gguf.py")
    if config.arch == "opt":
        return "opt"
    if config.parallel_block:
        return "falcon"
    return "bamboo" if config.activation == "drelu" else "llama"


def activation_for(meta: Mapping[str, Any], arch: str, powerinfer: bool, source: str) -> str:
    """The FFN activation a file means (module docstring, in that order)."""
    act = meta.get(ACTIVATION_KEY)
    if act is None:
        if powerinfer and arch not in _POWERINFER_ACTIVATION:
            fail(f"{source}: architecture", f"one of {list(_POWERINFER_ACTIVATION)} in a "
                 "PowerInfer (PWRI) file", arch)
        return (_POWERINFER_ACTIVATION if powerinfer else _DEFAULT_ACTIVATION)[arch]
    if act not in _ALLOWED[arch]:
        fail(f"{source}: {ACTIVATION_KEY}", f"one of {list(_ALLOWED[arch])} for arch {arch!r}",
             act, "the file's metadata contradicts its architecture")
    return act


def _require(meta: Mapping[str, Any], key: str, source: str):
    if key not in meta:
        fail(f"{source}: metadata key {key!r}", "present", None,
             "the file is not a complete GGUF of its architecture")
    return meta[key]


def config_from_metadata(meta: Mapping[str, Any], source: str, *, vocab_size: int | None,
                         tied: bool, powerinfer: bool = False, has_bias: bool = False,
                         n_positions: int | None = None, rope_freqs=None,
                         tensor_names=()) -> ModelConfig:
    """ModelConfig from GGUF metadata. tied: no `output.weight`; has_bias: the file has attention
    biases (Falcon); n_positions: rows of `position_embd` (OPT); rope_freqs: the values of a
    `rope_freqs` tensor (llama-like archs' per-frequency divisors); tensor_names: every tensor
    name of the file (what is there decides some features)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise unsupported_architecture(arch, f"{source}: general.architecture")
    a = arch + "."
    d = int(_require(meta, a + "embedding_length", source))
    n_heads = int(_require(meta, a + "attention.head_count", source))
    if vocab_size is None:
        vocab_size = int(meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    common = dict(
        vocab_size=vocab_size, d_model=d, n_layers=int(_require(meta, a + "block_count", source)),
        n_heads=n_heads, n_kv_heads=int(meta.get(a + "attention.head_count_kv") or n_heads),
        d_ff=int(_require(meta, a + "feed_forward_length", source)),
        activation=activation_for(meta, arch, powerinfer, source),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)))
    if arch in gguf_families.ARCHITECTURES:
        return gguf_families.config(arch, meta, source, common, tied=tied, rope_freqs=rope_freqs,
                                    tensor_names=tensor_names)
    if arch in ("llama", "bamboo"):
        common.update(gguf_moe.experts(meta, arch, source))  # Mixtral: a llama with experts
        if meta.get(FATRELU_KEY) is not None:
            common["fatrelu_thresholds"] = fatrelu_thresholds(
                meta[FATRELU_KEY], common["n_layers"], f"{source}: {FATRELU_KEY}")
        return ModelConfig(
            arch="llama", **common,
            head_dim=gguf_families.head_dim(meta, arch, d, n_heads, source),
            max_seq_len=int(_require(meta, a + "context_length", source)), gated=True,
            bias=False, norm="rms",
            norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            positions="rope", rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
            rope_scaling=gguf_families.rope_scaling(meta, arch, source, rope_freqs, tensor_names),
            tie_embeddings=tied)
    if arch == "falcon":
        return ModelConfig(
            arch="falcon", **common, head_dim=d // n_heads,
            max_seq_len=int(_require(meta, a + "context_length", source)), gated=False,
            bias=has_bias, norm="layer",
            norm_eps=float(meta.get(a + "attention.layer_norm_epsilon", 1e-5)), positions="rope",
            rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)), tie_embeddings=tied,
            parallel_block=True)
    # opt: PowerInfer writes no epsilon (HF OPT's is 1e-5) and a 2050-row position table.
    if n_positions is None or n_positions <= 2:
        fail(f"{source}: tensor 'position_embd.weight'", "rows = context + 2 (OPT's offset)",
             n_positions)
    return ModelConfig(
        arch="opt", **common, head_dim=d // n_heads, max_seq_len=n_positions - 2, gated=False,
        bias=True, norm="layer", norm_eps=float(meta.get(a + "attention.layer_norm_epsilon", 1e-5)),
        positions="learned", position_offset=2, tie_embeddings=True)


def model_metadata(config: ModelConfig, arch: str) -> dict[str, Any]:
    """`GGUFWriter.add_<key>` -> value for a config's model metadata under `arch`."""
    c = config
    meta = {"context_length": c.max_seq_len + c.position_offset, "embedding_length": c.d_model,
            "block_count": c.n_layers, "feed_forward_length": c.d_ff, "head_count": c.n_heads,
            "head_count_kv": c.n_kv_heads, "vocab_size": c.vocab_size}
    if arch in ("llama", "bamboo"):
        meta.update(rope_dimension_count=c.head_dim, key_length=c.head_dim,
                    value_length=c.head_dim, rope_freq_base=c.rope_theta,
                    layer_norm_rms_eps=c.norm_eps)
    elif arch == "falcon":
        meta.update(layer_norm_eps=c.norm_eps, rope_freq_base=c.rope_theta)
    elif arch in ("olmoe", "qwen3moe"):  # written by the synthetic MoE generator
        meta.update(key_length=c.head_dim, value_length=c.head_dim, rope_freq_base=c.rope_theta,
                    layer_norm_rms_eps=c.norm_eps, expert_count=c.n_experts,
                    expert_used_count=c.n_experts_used, expert_feed_forward_length=c.d_ff,
                    expert_weights_norm=c.norm_topk_prob)
    else:
        meta.update(layer_norm_eps=c.norm_eps)
    return meta


_LLAMA = gguf_families.LLAMA_TENSORS
_OPT = {"attn_norm.scale": "attn_norm.weight", "attn_norm.bias": "attn_norm.bias",
        "ffn_norm.scale": "ffn_norm.weight", "ffn_norm.bias": "ffn_norm.bias",
        **{f"attn.{o}.{k}": f"attn_{g}.{k}" for o, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                         ("o", "output"))
           for k in ("weight", "bias")},
        "ffn.up.weight": "ffn_up.weight", "ffn.up.bias": "ffn_up.bias"}
_GLOBAL = {"tok_embed": "token_embd.weight", "final_norm.scale": "output_norm.weight",
           "final_norm.bias": "output_norm.bias", "lm_head": "output.weight",
           "pos_embed": "position_embd.weight"}


def sources(config: ModelConfig, arch: str, *, down_t: bool,
            separate_attn_norm: bool = True) -> dict[str, Source]:
    """Every canonical tensor of `config` -> its Source in a GGUF of `arch`.

    down_t: the file stores `ffn_down_t` [F, D] (PowerInfer) rather than `ffn_down` [D, F].
    separate_attn_norm (falcon): the file has `attn_norm_2` for attention; otherwise one norm
    (`attn_norm`) feeds both attention and FFN.
    """
    c = config
    out: dict[str, Source] = {}
    for name, shape in expected_shapes(c).items():
        if not name.startswith("layers."):
            out[name] = Source(_GLOBAL[name], shape)
            continue
        _, i, rest = name.split(".", 2)
        blk = f"blk.{i}."
        if rest in gguf_moe.TENSORS:
            gname, kind = gguf_moe.TENSORS[rest]
            stored = shape[:-2] + shape[:-3:-1] if kind == "transposed" else shape
            out[name] = Source(blk + gname, tuple(stored), kind)
            continue
        if rest.startswith("ffn.down"):
            stem = "ffn_down_t" if down_t else "ffn_down"
            if rest == "ffn.down.bias":
                out[name] = Source(blk + stem + ".bias", shape)
            else:
                out[name] = (Source(blk + "ffn_down_t.weight", shape) if down_t else
                             Source(blk + "ffn_down.weight", shape[::-1], "transposed"))
            continue
        if arch in ("llama", "bamboo"):
            heads = {"attn.q.weight": c.n_heads, "attn.k.weight": c.n_kv_heads}.get(rest)
            out[name] = Source(blk + _LLAMA[rest], shape, "rope" if heads else "plain",
                               heads or 0)
        elif arch in gguf_families.ARCHITECTURES:  # NEOX RoPE: rows as HF stores them
            fused = gguf_families.fused_rows(c, rest) if arch == "phi3" else None
            if fused:
                gname, start, stop = fused
                total = c.q_dim + 2 * c.kv_dim if gname == "attn_qkv.weight" else 2 * c.d_ff
                out[name] = Source(blk + gname, (total,) + tuple(shape[1:]), "rows", start=start,
                                   stop=stop)
            else:
                out[name] = Source(blk + gguf_families.TENSORS[rest], shape)
        elif arch == "opt":
            out[name] = Source(blk + _OPT[rest], shape)
        else:
            out[name] = _falcon_source(c, blk, rest, shape, separate_attn_norm)
    return out


def _falcon_source(c: ModelConfig, blk: str, rest: str, shape, separate_attn_norm: bool):
    part, _, kind = rest.rpartition(".")  # e.g. ("attn.q", "weight")
    if part in ("attn.q", "attn.k", "attn.v"):
        q, kv = c.q_dim, c.kv_dim
        start, stop = {"attn.q": (0, q), "attn.k": (q, q + kv), "attn.v": (q + kv, q + 2 * kv)}[part]
        stored = (q + 2 * kv,) + tuple(shape[1:])
        return Source(blk + "attn_qkv." + kind, stored, "rows", start=start, stop=stop)
    gname = {"attn.o": "attn_output", "ffn.up": "ffn_up", "ffn_norm": "attn_norm",
             "attn_norm": "attn_norm_2" if separate_attn_norm else "attn_norm"}[part]
    return Source(blk + gname + "." + ("weight" if kind == "scale" else kind), shape)
