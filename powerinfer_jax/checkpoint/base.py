"""What every loader returns: `Checkpoint`, and the canonical parameter names and shapes.

Canonical names (weights [out, in] like a HF Linear, FFN neuron-major):
  tok_embed [V, D]; pos_embed [P, D] (learned positions); lm_head [V, D] (untied only);
  final_norm.scale/.bias [D];
  layers.{i}.attn_norm.scale/.bias [D]; layers.{i}.attn.{q,k,v,o}.weight (+ .bias when config.bias;
    q/k/v only with config.qkv_bias): q [N*H, D], k/v [K*H, D], o [D, N*H]; Q/K rows in HF's
    rotate-half RoPE layout; layers.{i}.attn.{q,k}_norm.scale [H] (config.qk_norm);
  layers.{i}.attn_post_norm.scale, layers.{i}.ffn_post_norm.scale [D] (config.post_norms);
  layers.{i}.ffn_norm.scale/.bias [D]; layers.{i}.ffn.gate.weight [F, D] (gated only),
    ffn.up.weight [F, D], ffn.down_t.weight [F, D] (= down_proj.weight.T), ffn.up.bias [F],
    ffn.down.bias [D]. MoE layers (config.n_experts): ffn.router.weight [E, D],
    ffn.experts.{gate,up,down_t}.weight [E, F, D], a shared expert's ffn.shared.* ([F_s, D]) and
    ffn.shared_gate.weight [1, D] (`moe_shapes`).
`.bias` norm entries exist only for LayerNorm; attention/FFN biases only when config.bias.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import check
from powerinfer_jax.tokenizer import Tokenizer


# XLA's CPU client aliases a host array whose data starts on this boundary instead of copying it
# (jax.device_put(..., may_alias=True)); the blocks are read with that alignment (see `aligned`).
HOST_ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a HOST_ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGN, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned(a: np.ndarray, *, copy: bool = False) -> np.ndarray:
    """`a` as a C-contiguous array starting on a HOST_ALIGN-byte boundary: `a` itself when it
    already is one (and not `copy`), else a copy in memory allocated that way."""
    a = np.asarray(a)
    if not copy and a.flags.c_contiguous and a.ctypes.data % HOST_ALIGN == 0:
        return a
    out = aligned_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


@dataclasses.dataclass(frozen=True)
class QuantTensor:
    """A weight kept as a GGUF tensor's blocks: stored once, dequantized on demand.

    blocks: uint8 [rows, row_bytes], the file's bytes for the stored matrix [rows, cols] (Q/K
      rows already un-permuted to HF order: rows permute whole, blocks with them); stacked
      experts (ffn_*_exps): uint8 [E, rows, row_bytes].
    qtype: the GGML type name ("Q4_K", ...). shape: the canonical param's shape.
    transposed: the canonical param is the transpose of the stored matrix (`ffn.down_t.weight`:
      GGUF stores ffn_down [D, F], blocked along F).
    A JAX pytree (leaf: blocks; qtype, shape, transposed static), so it passes through jit and
    `jax.device_put` like an array. `ops.qlinear(x, t.blocks, t.qtype, in_features)` computes with
    it as stored; `reblocked()` gives down_t rows blocked along D for `ops.qsparse_ffn`.
    """

    blocks: Any
    qtype: str
    shape: tuple[int, ...]
    transposed: bool = False

    def __post_init__(self):
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        if not hasattr(self.blocks, "dtype"):  # jax's tree utilities unflatten with placeholders
            return
        *lead, rows, cols = self.stored_shape
        want = (*lead, rows, quants.row_bytes(self.qtype, cols))
        if tuple(np.shape(self.blocks)) != want or np.dtype(self.blocks.dtype) != np.uint8:
            raise ValueError(f"QuantTensor blocks: expected uint8 {want} for {self.qtype} "
                             f"{self.stored_shape}, got {np.dtype(self.blocks.dtype)} "
                             f"{tuple(np.shape(self.blocks))}")

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The file's matrix (stacked experts: [E, rows, cols]); transposed: the canonical
        shape's last two axes swapped."""
        s = tuple(self.shape)
        return s[:-2] + s[:-3:-1] if self.transposed else s

    @property
    def nbytes(self) -> int:
        """The blocks' bytes, from the shape and type alone (a deferred tensor's blocks are not
        made by asking: the Q/K rows' RoPE-order copies, ~600 MB on a 7B, were made for a
        --ram-budget's size check and set its peak)."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        *lead, rows, cols = self.stored_shape
        return int(np.prod(lead, dtype=np.int64)) * rows * quants.row_bytes(self.qtype, cols)

    def dequantize(self) -> np.ndarray:
        """The canonical param as float32."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        stored = self.stored_shape
        cols = stored[-1]
        blocks = np.ascontiguousarray(self.blocks, dtype=np.uint8).reshape(
            -1, quants.row_bytes(self.qtype, cols))
        try:
            # the extension itself, not ops._ffi: a checkpoint imports nothing of ops
            from powerinfer_jax import _pij_ext  # lazy: optional C++ extension
        except ImportError:  # a checkout without the compiled kernels: the same values
            values = quants.dequantize(blocks, self.qtype)
        else:
            values = np.empty((blocks.shape[0], cols), np.float32)
            # the kernels' unpacking: equal to quants.dequantize bit for bit
            # (test_checkpoint_quants) and ~10x faster than the gguf package's numpy; it runs at
            # load for every down matrix
            _pij_ext.dequantize_into(blocks, quants.type_id(self.qtype), values)
        values = values.reshape(stored)
        return np.ascontiguousarray(np.swapaxes(values, -1, -2)) if self.transposed else values

    def down_groups(self) -> np.ndarray:
        """ffn_down's blocks (a transposed tensor: stored [D, F]) as down groups, uint8
        [F / 32, D * block bytes] (checkpoint.quants.down_groups): rearranged, not re-quantized."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        if not self.transposed:
            raise ValueError(f"QuantTensor.down_groups: expected ffn_down as stored (transposed), "
                             f"got a {self.qtype} tensor of canonical shape {self.shape}")
        d, f = self.stored_shape
        return quants.down_groups(np.asarray(self.blocks), self.qtype, d, f)

    def reblocked(self, qtype: str) -> "QuantTensor":
        """The canonical matrix's rows re-quantized in `qtype` (dequantize, then quantize each
        canonical row): down_t [F, D] blocked along D, one neuron's down row per block row.
        Adds `qtype`'s rounding error on top of the file's (measured in benchmarks/)."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        blocks = quants.quantize(self.dequantize(), qtype)
        return QuantTensor(blocks, qtype, tuple(self.shape), transposed=False)


class DeferredQuantTensor(QuantTensor):
    """A QuantTensor whose blocks are made on first use (`make()`, once), not when the file is
    read: Q/K rows put back in HF's RoPE order are a copy (a sixth of a Llama's attention and
    FFN bytes), which a load that takes those matrices already arranged (the interleaved copy
    beside the model, checkpoint/interleaved_file.py) never needs. Everything else reads it as
    any QuantTensor (its blocks are made then)."""

    def __init__(self, make, qtype: str, shape: tuple[int, ...], transposed: bool = False):
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_made", None)
        object.__setattr__(self, "qtype", qtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "transposed", transposed)

    @property
    def blocks(self):
        if self._made is None:
            object.__setattr__(self, "_made", self._make())
            object.__setattr__(self, "_make", None)  # what it closed over (the file's rows) goes
        return self._made


def _register_pytree() -> None:
    import jax

    jax.tree_util.register_dataclass(QuantTensor, data_fields=["blocks"],
                                     meta_fields=["qtype", "shape", "transposed"])
    # flattened as its blocks (made then); unflattened as a plain QuantTensor
    jax.tree_util.register_pytree_node(
        DeferredQuantTensor, lambda t: ((t.blocks,), (t.qtype, t.shape, t.transposed)),
        lambda aux, children: QuantTensor(children[0], *aux))


_register_pytree()


@dataclasses.dataclass
class Checkpoint:
    """config, params (canonical name -> float32 array, or `QuantTensor` when loaded with
    keep_quantized=True), tokenizer, and where it came from."""

    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    source: str


SUPPORTED_ARCHITECTURES = ("llama (LlamaForCausalLM, MistralForCausalLM, GGUF 'llama')",
                           "dReLU llama (HF model_type 'bamboo', GGUF 'bamboo')",
                           "qwen2 (Qwen2ForCausalLM, GGUF 'qwen2')",
                           "qwen3 (Qwen3ForCausalLM, GGUF 'qwen3')",
                           "gemma2 (Gemma2ForCausalLM, GGUF 'gemma2')",
                           "gemma3 (Gemma3ForCausalLM text-only, HF model_type 'gemma3_text', "
                           "GGUF 'gemma3')",
                           "phi3 (Phi3ForCausalLM, GGUF 'phi3')",
                           "mixtral (MixtralForCausalLM, GGUF 'llama' with experts)",
                           "qwen2_moe (Qwen2MoeForCausalLM, GGUF 'qwen2moe')",
                           "qwen3_moe (Qwen3MoeForCausalLM, GGUF 'qwen3moe')",
                           "olmoe (OlmoeForCausalLM, GGUF 'olmoe')",
                           "falcon (FalconForCausalLM, GGUF 'falcon')",
                           "opt (OPTForCausalLM, GGUF 'opt')")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical param the config implies, with its shape."""
    c = config
    d, f = c.d_model, c.d_ff
    shapes: dict[str, tuple[int, ...]] = {"tok_embed": (c.vocab_size, d), "final_norm.scale": (d,)}
    if c.positions == "learned":
        shapes["pos_embed"] = (c.max_seq_len + c.position_offset, d)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab_size, d)
    layer_norm = c.norm == "layer"
    if layer_norm:
        shapes["final_norm.bias"] = (d,)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        norms = ("attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm") if c.post_norms \
            else ("attn_norm", "ffn_norm")
        for norm in norms:
            shapes[p + norm + ".scale"] = (d,)
            if layer_norm:
                shapes[p + norm + ".bias"] = (d,)
        attn = {"q": (c.q_dim, d), "k": (c.kv_dim, d), "v": (c.kv_dim, d), "o": (d, c.q_dim)}
        for name, shape in attn.items():
            shapes[f"{p}attn.{name}.weight"] = shape
            if c.bias or (c.qkv_bias and name != "o"):
                shapes[f"{p}attn.{name}.bias"] = shape[:1]
        if c.qk_norm:
            shapes[p + "attn.q_norm.scale"] = (c.head_dim,)
            shapes[p + "attn.k_norm.scale"] = (c.head_dim,)
        if c.qk_norm_full:
            shapes[p + "attn.q_norm.scale"] = (c.q_dim,)
            shapes[p + "attn.k_norm.scale"] = (c.kv_dim,)
        if c.n_experts:
            shapes.update(moe_shapes(c, p))
            continue
        if c.gated:
            shapes[p + "ffn.gate.weight"] = (f, d)
        shapes[p + "ffn.up.weight"] = (f, d)
        shapes[p + "ffn.down_t.weight"] = (f, d)
        if c.bias:
            shapes[p + "ffn.up.bias"] = (f,)
            shapes[p + "ffn.down.bias"] = (d,)
    return shapes


def moe_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """An MoE layer's canonical params (prefix `p`): the router [E, D], the experts stacked
    [E, F, D] (down transposed, neuron-major as the dense FFN's), and the shared expert's
    gate/up/down_t [F_shared, D] with its gate [1, D] when config.d_ff_shared."""
    e, f, d = c.n_experts, c.d_ff, c.d_model
    shapes = {p + "ffn.router.weight": (e, d)}
    for part in ("gate", "up", "down_t"):
        shapes[f"{p}ffn.experts.{part}.weight"] = (e, f, d)
    if c.d_ff_shared:
        for part in ("gate", "up", "down_t"):
            shapes[f"{p}ffn.shared.{part}.weight"] = (c.d_ff_shared, d)
        shapes[p + "ffn.shared_gate.weight"] = (1, d)
    return shapes


def check_params(config: ModelConfig, params: dict[str, np.ndarray], source: str) -> None:
    """Every param the config implies is present with the right shape."""
    for name, shape in expected_shapes(config).items():
        if name not in params:
            raise ValueError(f"{source}: expected tensor {name!r} (shape {shape}), got none "
                             "(the checkpoint is incomplete or not the architecture it claims)")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{source}: tensor {name!r}: expected shape {shape} from the config, "
                             f"got {tuple(params[name].shape)}")


def fatrelu_thresholds(value, n_layers: int, what: str) -> tuple[float, ...]:
    """FATReLU's per-layer gate thresholds (ModelConfig.fatrelu_thresholds) as a checkpoint
    stores them: one number for every layer, or a list of n_layers (one per layer)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n_layers
    ok = len(values) == n_layers and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        for v in values)
    check(ok, what, f"a finite number >= 0 or a list of {n_layers} (one per layer)", value)
    return tuple(float(v) for v in values)


def unsupported_architecture(arch: Any, source: str, detail: str = "") -> ValueError:
    return ValueError(f"{source}: architecture: expected one of {'; '.join(SUPPORTED_ARCHITECTURES)}, "
                      f"got {arch!r}{detail}")


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's interleaved order (what convert_hf_to_gguf writes).

    Within each head, HF keeps the two RoPE halves [x_0..x_{h/2-1}, x_{h/2}..] apart; llama.cpp
    interleaves them as pairs (x_0, x_{h/2}), (x_1, x_{h/2+1}), ...
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `rope_permute`: llama.cpp's interleaved rows -> HF rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
