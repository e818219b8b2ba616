"""ONE decoder-only Transformer for every supported family, driven by `ModelConfig`.

Module paths equal the checkpoint's canonical names ("layers.3.attn.q.weight"), so loading is a
name-for-name copy (`from_params`). Two exceptions: the down projection's bias is called
"ffn.down.bias" in checkpoints and lives on `ffn.down_t`, and the untied output matrix is called
"lm_head" in checkpoints and lives at `lm_head.weight`.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax import ops
from powerinfer_jax.checkpoint.base import QuantTensor, expected_shapes
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import fail
from powerinfer_jax.models.ffn import FFN
from powerinfer_jax.models.kv_cache import init_cache  # noqa: F401  (re-exported)
from powerinfer_jax.models.moe import MoE
from powerinfer_jax.models.qweights import (COLUMNS, DENSE_LAYOUT, FfnLayout, MATVEC, QWeight,
                                            ROWS, arrange, batched_load, gather_rows,
                                            host_blocks)
from powerinfer_jax.models.layers import (F32, Attention, InputSample, Linear, Module, Norm,
                                         _param, matmul, op_impl, resolve_kernels, shapes_only,
                                         sow)
from powerinfer_jax.models.rope import layer_rope
from powerinfer_jax.ops.qblocks import dequantize_rows


class Block(Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); with
    config.post_norms (Gemma-2/3) each sublayer's output is normed before it joins the residual,
    x + attn_post_norm(attn(attn_norm(x))); with config.parallel_block (Falcon):
    x + attn(attn_norm(x)) + ffn(ffn_norm(x)). Sows the FFN's input (after ffn_norm) as "ffn_in"
    [B, T, D] under `capture` (profiling, predictor training); the FFN gets the tensor ffn_norm
    normalized as its `residual` (PowerInfer's predictors read it), sown as "ffn_residual" too
    where the FFN's selector reads it."""

    def __init__(self, c: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs | None, kernels: str,
                 **attention_options):
        self.parallel = c.parallel_block
        norm = dict(kind=c.norm, eps=c.norm_eps)
        self.attn_norm = Norm(c.d_model, **norm)
        self.attn = Attention(d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                              head_dim=c.head_dim, bias=c.bias, rope=layer_rope(c, layer),
                              dtype=dtype, rngs=rngs, kernels=kernels, qkv_bias=c.qkv_bias,
                              qk_norm_eps=c.norm_eps if c.qk_norm else None,
                              qk_norm_full_eps=c.norm_eps if c.qk_norm_full else None,
                              scale=c.query_scale, softcap=c.attn_softcap,
                              window=c.window(layer), **attention_options)
        self.attn_post_norm = Norm(c.d_model, **norm) if c.post_norms else None
        self.ffn_norm = Norm(c.d_model, **norm)
        self.ffn_post_norm = Norm(c.d_model, **norm) if c.post_norms else None
        if c.n_experts:
            self.ffn = MoE(d_model=c.d_model, d_ff=c.d_ff, n_experts=c.n_experts,
                           n_used=c.n_experts_used, norm_topk_prob=c.norm_topk_prob,
                           activation=c.activation, d_ff_shared=c.d_ff_shared, dtype=dtype,
                           rngs=rngs, kernels=kernels)
        else:
            self.ffn = FFN(d_model=c.d_model, d_ff=c.d_ff, activation=c.activation,
                           gated=c.gated, bias=c.bias, dtype=dtype, rngs=rngs, kernels=kernels,
                           gate_floor=c.fatrelu_thresholds[layer] if c.fatrelu_thresholds else 0)
        # Tensor parallel (runtime/mesh.py): the mesh axis over which attention's and the FFN's
        # outputs are partial sums (this device's heads / neurons), summed before the residual.
        self.reduce_axis = None

    def __call__(self, x_btd, positions_bt, cache, cache_index, kv_len):
        attn_out, new_cache = self.attn(self.attn_norm(x_btd), positions_bt, cache, cache_index,
                                        kv_len)
        if not self.parallel:
            x_btd = x_btd + self._post(self.attn_post_norm, self._sum_shards(attn_out))
        ffn_in = self.ffn_norm(x_btd)
        sow(self, "ffn_in", ffn_in)
        sow(self, "ffn_in", ffn_in, InputSample)
        if getattr(getattr(self.ffn, "selector", None), "reads_residual", False):
            sow(self, "ffn_residual", x_btd)
        ffn_out = self.ffn(ffn_in, residual=x_btd)
        if self.parallel:  # Falcon: attention and FFN both read the block's input
            return x_btd + self._sum_shards(attn_out + ffn_out), new_cache
        return x_btd + self._post(self.ffn_post_norm, self._sum_shards(ffn_out)), new_cache

    def attention_residual(self, x_btd, positions_bt):
        """A sequential block's residual after its attention sublayer (no cache): what its
        ffn_norm reads (sparsify/ runs the FFN itself from there)."""
        if self.parallel:
            fail("Block.attention_residual", "a sequential block", "a parallel one")
        attn_out = self.attn(self.attn_norm(x_btd), positions_bt)[0]
        return x_btd + self._post(self.attn_post_norm, self._sum_shards(attn_out))

    @staticmethod
    def _post(norm, y):
        """A sublayer's output as it joins the residual: normed first with post_norms (after
        the shards' partial sums are added: the norm needs the whole vector)."""
        return y if norm is None else norm(y)

    def _sum_shards(self, y):
        return y if self.reduce_axis is None else jax.lax.psum(y, self.reduce_axis)


class Transformer(Module):
    def __init__(self, config: ModelConfig, *, dtype=F32, rngs: nnx.Rngs | None = None,
                 kernels: str = "xla", decode_attention: str = "auto", fuse_qkv: bool = True):
        """rngs: random weights (tests, tiny models); None: constant placeholders to be loaded.
        kernels: "xla", "ffi" or "auto" (see models/layers.py); decode_attention, fuse_qkv: see
        models/layers.py `Attention` (RuntimeConfig's ablation knobs)."""
        c = config
        kernels = resolve_kernels(kernels)
        self.config = c
        self.kernels = kernels
        self.dtype = jnp.dtype(dtype)
        self.tok_embed = _embedding((c.vocab_size, c.d_model), dtype, rngs)
        self.embed_qtype = None  # GGML block format of tok_embed (models/qweights.py), or floats
        self.embed_interleaved = False  # its rows interleaved by 16 (tied: it is the LM head)
        self.pos_embed = (_embedding((c.max_seq_len + c.position_offset, c.d_model), dtype, rngs)
                          if c.positions == "learned" else None)
        self.layers = nnx.List([Block(c, i, dtype=dtype, rngs=rngs, kernels=kernels,
                                      decode_attention=decode_attention, fuse_qkv=fuse_qkv)
                                for i in range(c.n_layers)])
        self.final_norm = Norm(c.d_model, kind=c.norm, eps=c.norm_eps)
        self.lm_head = (None if c.tie_embeddings else
                        Linear(c.d_model, c.vocab_size, bias=False, dtype=dtype, rngs=rngs,
                               kernels=kernels))
        self.parallel = None  # runtime/mesh.py's TensorParallel once sharded over a mesh

    def hidden(self, tokens_bt, positions_bt, cache=None, cache_index=None, kv_len=None):
        """The final-norm hidden states [B, T, D] (float32) and the updated cache.

        cache: None or a list of per-layer (k, v) arrays [B, S, K, H]; returns the updated list.
        kv_len: static number of cache slots attention reads (see `Attention`). Each FFN runs its
        own selector and backend (models/ffn.py, set by sparsity.modes.configure); per-layer
        diagnostics (FFN inputs, active counts) are collected by `capture`.
        """
        x = self.embed(tokens_bt)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(d_model)
            x = x * self.config.embed_scale
        if self.pos_embed is not None:
            x = x + self.pos_embed[...][positions_bt + self.config.position_offset].astype(F32)
        if self.parallel is None:
            x, new_cache = run_layers(self.layers, x, positions_bt, cache, cache_index, kv_len)
        else:  # each device runs the layers on its shard (runtime/mesh.py)
            x, new_cache = self.parallel.run_layers(run_layers, self.layers, x, positions_bt,
                                                    cache, cache_index, kv_len)
        return self.final_norm(x), new_cache

    def cache_sharding(self):
        """How the KV cache is laid over the model's mesh (None: not sharded)."""
        return None if self.parallel is None else self.parallel.cache_sharding()

    def embed(self, tokens_bt):
        """Token embeddings [B, T, D] float32 (a quantized table: only the gathered rows are
        dequantized)."""
        if self.embed_qtype is None:
            return self.tok_embed[...][tokens_bt].astype(F32)

        rows = gather_rows(self.tok_embed[...], tokens_bt, self.embed_kernel_qtype)
        return dequantize_rows(rows, self.embed_qtype, self.config.d_model)

    @property
    def embed_kernel_qtype(self) -> str | None:
        """tok_embed's type name for the custom calls ("Q4_0x16" when interleaved)."""
        if self.embed_qtype is None:
            return None
        return QWeight(None, self.embed_qtype, MATVEC, self.embed_interleaved).kernel_qtype

    def logits(self, h_btd):
        """Vocabulary logits [B, T, V] in float32 (soft-capped with config.final_softcap)."""
        cap = self.config.final_softcap
        y = self._head(h_btd)
        return y if cap == 0 else cap * jnp.tanh(y / cap)

    def _head(self, h_btd):
        if self.lm_head is not None:
            return self.lm_head(h_btd)
        if self.embed_qtype is not None:  # tied to a quantized embedding: its blocks
            return ops.qlinear(h_btd, self.tok_embed[...], self.embed_kernel_qtype,
                               self.config.d_model,
                               impl=op_impl(self.kernels))
        return matmul(h_btd, self.tok_embed[...], self.kernels)

    def __call__(self, tokens_bt, positions_bt=None):
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        return self.logits(self.hidden(tokens_bt, positions_bt)[0])


def run_layers(layers, x_btd, positions_bt, cache, cache_index, kv_len):
    """The residual stream through every layer; returns (x, the updated cache or None)."""
    new_cache = []
    for i, layer in enumerate(layers):
        x_btd, layer_cache = layer(x_btd, positions_bt, None if cache is None else cache[i],
                                   cache_index, kv_len)
        new_cache.append(layer_cache)
    return x_btd, (None if cache is None else new_cache)


def capture(fn, model, *args, kind=nnx.Intermediate):
    """Run fn(model, *args) and collect what the layers sow: returns (fn's result, {name: [L, ...]
    stacked over layers}), e.g. "ffn_in" [L, B, T, D] and, in sparse modes, "n_active" [L, B, T]
    (kind layers.InputSample: the matrices' inputs "attn_in", "attn_out", "ffn_in", "ffn_mid").
    Works eagerly and inside jit (call it on the merged model)."""
    result, sown = nnx.capture(fn, kind)(model, *args)
    per_name: dict[str, list] = {}
    for path, var in nnx.to_flat_state(sown):
        if path[0] == "layers":
            per_name.setdefault(path[-1], []).append((int(path[1]), var.get_value()[-1]))
    return result, {name: jnp.stack([v for _, v in sorted(vals, key=lambda p: p[0])])
                    for name, vals in per_name.items()}


def block_residuals(sown, n_layers: int):
    """The blocks' residuals a `capture` sowed ("ffn_residual" [L, ...]: where the FFNs'
    selectors read them), else one None per layer (what `Selector.select_in_block` takes)."""
    r = sown.get("ffn_residual")
    return [None] * n_layers if r is None else r


def _embedding(shape, dtype, rngs):
    return _param(shape, dtype, rngs, scale=0.02)


def _param_name(path) -> str:
    name = ".".join(str(p) for p in path)
    return "lm_head" if name == "lm_head.weight" else name.replace("ffn.down_t.bias",
                                                                    "ffn.down.bias")


def param_names(config: ModelConfig) -> list[str]:
    """Canonical checkpoint names this config's model expects."""
    with shapes_only():
        abstract = Transformer(config)
    return [_param_name(p) for p, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Param))]


def from_params(config: ModelConfig, params: Mapping[str, np.ndarray], *, dtype=F32,
                kernels: str = "auto", ffn_layout: FfnLayout = DENSE_LAYOUT,
                quantized: bool | None = None, external: frozenset[str] = frozenset(),
                copies=None, **options) -> Transformer:
    """Build a Transformer from canonical named arrays (e.g. a loaded checkpoint).

    Matrices take `dtype`; norms and biases stay float32. Block-quantized tensors
    (checkpoint.base.QuantTensor, from load_checkpoint(keep_quantized=True)) stay in the file's
    format when the custom calls run (kernels "ffi"): matmuls compute on the blocks, arranged
    once (models/qweights.py): attention, the LM head and a tied embedding for the matvec, an
    untied embedding as the file's rows, the FFN's matrices as `ffn_layout` says (the build
    plan: its sparsity mode's layouts, sparsity/modes.py; default: dense). With XLA kernels they
    are dequantized to `dtype` (quantized=True keeps them: the ops' jnp references then compute
    on them, slowly; tests). Missing, unexpected or misshaped tensors are a ValueError naming
    them. kernels: see models/layers.py ("auto": the custom calls on CPU); external: tensors
    whose rows live outside the model (an offloaded FFN's neuron store, runtime/offload.py):
    never read here, their Params left shape-only for the caller to set. copies: the model's
    interleaved copies kept in a file (checkpoint/interleaved_file.InterleavedFile): the matvec
    matrices it holds are mapped from it (their file rows never read), the others made and
    handed to it to keep. options: Transformer's decode_attention and fuse_qkv.
    """
    kernels = resolve_kernels(kernels)
    blocks = {name: t for name, t in params.items()
              if isinstance(t, QuantTensor) and name not in external}
    if not (kernels == "ffi" if quantized is None else quantized):  # the custom calls compute
        # on blocks; elsewhere the floats
        params = {**params, **{name: t.dequantize() for name, t in blocks.items()}}
        blocks = {}
    # stacked experts' blocks (MoE): kept as the file stores them, for ops.moe_ffn
    expert_blocks = {name: blocks.pop(name) for name in list(blocks)
                     if len(blocks[name].shape) == 3}
    expected = expected_shapes(config)  # the model's params (tests: equal to param_names)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"checkpoint tensors: expected exactly the {len(expected)} tensors of a "
                         f"{config.arch} model, missing {missing[:8]}, unexpected {extra[:8]}")
    for name, shape in expected.items():
        got = tuple(params[name].shape)
        if got != shape:
            raise ValueError(f"tensor {name}: expected shape {shape}, got {got}")

    matvec = {name: t for name, t in blocks.items()
              if _layout(name, t, config, ffn_layout) == MATVEC}
    columns = {name: t for name, t in blocks.items()
               if _layout(name, t, config, ffn_layout) == COLUMNS}
    mapped, mapped_columns = {}, {}  # name -> the file's arranged blocks, read into memory
    if copies is not None:
        mapped = copies.read(matvec)
        mapped_columns = copies.read(columns, layout=COLUMNS)
    with batched_load() as load:
        # the interleaved copies are made on the pool while Python builds the modules below
        load.interleave_ahead((t.blocks, t.qtype) for name, t in matvec.items()
                              if name not in mapped)
        with shapes_only():
            model = Transformer(config, dtype=dtype, kernels=kernels, **options)
        # each placeholder Param is found by its name and given its value in place: walking the
        # whole module graph (nnx.state, then nnx.update) took ~0.06 s of SmolLM2's build
        for name in expected:
            if name not in blocks and name not in expert_blocks and name not in external:
                var = _variable(model, name)
                var.set_value(jnp.asarray(np.asarray(params[name]),
                                          dtype=var.get_value().dtype))
        for name, t in blocks.items():
            if name in mapped:
                w = QWeight(mapped[name], t.qtype, MATVEC, interleaved=True)
            elif name in mapped_columns:
                w = QWeight(mapped_columns[name], t.qtype, COLUMNS)
            else:
                w = arrange(t, _layout(name, t, config, ffn_layout),
                            down_qtype=ffn_layout.down_qtype, load=load)
                if copies is not None and name in matvec and w.interleaved:
                    copies.add(name, w.blocks, w.qtype)
                if copies is not None and w.layout == COLUMNS:
                    copies.add(name, w.blocks, w.qtype, layout=COLUMNS)
            _load_quantized(model, name, w)
        for name, t in expert_blocks.items():
            # the experts' Stacked matrix, in the plan's experts layout (input sparsity: columns)
            _at(model, name.rsplit(".", 1)[0]).load(t, load, layout=ffn_layout.experts)
    return model


def _layout(name: str, t, config: ModelConfig, ffn_layout: FfnLayout) -> str:
    """The layout from_params arranges tensor `name` (QuantTensor t) in: MATVEC for every
    matrix read whole (attention, the LM head, the token embedding when it is the LM head too),
    ROWS for an untied embedding (looked up by rows), the FFN's as `ffn_layout` says (a
    neuron-major down projection, PowerInfer's ffn_down_t, is ROWS whatever the plan: it is no
    matvec of the activations)."""
    if name == "tok_embed":
        return MATVEC if config.tie_embeddings else ROWS
    if name.endswith("ffn.down_t.weight"):
        if ffn_layout.down == COLUMNS:  # the file's ffn_down [D, F]; PowerInfer's down_t is
            return COLUMNS if t.transposed else ROWS  # no matvec of the activations
        return ffn_layout.down if t.transposed else ROWS
    if ".attn." in name and name.rsplit(".", 2)[-2] in ("q", "k", "v", "o"):
        return ffn_layout.attention
    for part in ("gate", "up"):
        if name.endswith(f"ffn.{part}.weight"):
            return getattr(ffn_layout, part)
    return MATVEC


def _at(model: Transformer, path: str):
    """The node at a dotted module path ("layers.3.ffn.up.weight": list indices as digits)."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _variable(model: Transformer, name: str) -> nnx.Variable:
    """The Param that holds canonical param `name` (the inverse of `_param_name`)."""
    return _at(model, "lm_head.weight" if name == "lm_head"
               else name.replace("ffn.down.bias", "ffn.down_t.bias"))


def _load_quantized(model: Transformer, name: str, w: QWeight) -> None:
    """Put a QuantTensor's blocks, arranged for how they are read (`arrange`), into the module
    that owns canonical param `name`."""
    if name == "tok_embed":
        model.tok_embed.set_value(host_blocks(w.blocks))
        model.embed_qtype, model.embed_interleaved = w.qtype, w.interleaved
        return
    if name == "lm_head":
        model.lm_head.load(w)
        return
    _at(model, name.rsplit(".", 1)[0]).load(w)  # the Linear or DownT whose `weight` it is
