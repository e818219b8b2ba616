"""The training forward as one `lax.scan` over the blocks, for the GPU burst (benchmarks/gpu/burst.py).

forward.forward unrolls the blocks in Python: XLA then compiles L copies of the block, which on a
GPU costs about a minute of a burst's few minutes. Here the blocks' states are stacked on a leading
L axis (every block has the same structure: one graph definition) and `lax.scan` runs
forward.block_forward once per layer, so the step compiles one block. Same math as
forward.forward (the test compares logits, statistics and gradients).

`split(model, scope)` -> (ScanDefs, params, frozen): params are what `scope` trains (the blocks'
FFN matrices, plus their norm scales and the final norm for "ffn+norms"), stacked [L, ...];
frozen is the rest (the blocks' attention, the embedding, an untied lm_head). `update(model,
defs, params)` writes trained params back into the model's modules.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from powerinfer_jax.models.layers import F32
from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.train import trainable


@dataclasses.dataclass(frozen=True)
class ScanDefs:
    block: object  # the blocks' common nnx graph definition
    final_norm: object  # the final norm's graph definition
    scope: str
    embed_scale: float = 1.0  # model.config's (Gemma: sqrt(d_model))
    final_softcap: float = 0.0  # model.config's (0: none)


def _block_filter(scope: str):
    return trainable(scope)


def split(model, scope: str):
    """(ScanDefs, params, frozen) of a llama Transformer built with kernels="xla"."""
    if scope not in ("ffn", "ffn+norms"):
        raise ValueError(f"scanned training scope: expected 'ffn' or 'ffn+norms', got {scope!r}")
    if model.kernels != "xla":
        raise ValueError(f"scanned forward: expected a model built with kernels='xla', got "
                         f"{model.kernels!r}")
    block_def, train, rest = None, [], []
    for i, layer in enumerate(model.layers):
        g, t, r = nnx.split(layer, _block_filter(scope), ...)
        if block_def is None:
            block_def = g
        elif g != block_def:
            raise ValueError(f"scanned forward: expected blocks of one structure, block {i} "
                             "differs from block 0")
        train.append(t)
        rest.append(r)

    def stack(states):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    norm_def, norm_state = nnx.split(model.final_norm)
    norms = scope == "ffn+norms"
    params = {"blocks": stack(train), "final_norm": norm_state if norms else None}
    frozen = {"blocks": stack(rest), "final_norm": None if norms else norm_state,
              "embed": model.tok_embed[...],
              "lm_head": None if model.lm_head is None else model.lm_head.weight[...]}
    c = model.config
    defs = ScanDefs(block_def, norm_def, scope, float(c.embed_scale), float(c.final_softcap or 0.0))
    return defs, params, frozen


def forward(defs: ScanDefs, params, frozen, tokens_bt, spec: fw.FFNSpec, *, compute_dtype=F32,
            gate_threshold=None, remat: bool = False, collect_hidden: bool = False):
    """forward.forward's (logits [B, T, V] float32, aux) through one scan over the blocks."""
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    x = frozen["embed"][tokens_bt].astype(F32) * defs.embed_scale

    def block(x_btd, states):
        layer = fw.cast_matrices(nnx.merge(defs.block, *states), compute_dtype)
        x_btd, stats = fw.block_forward(layer, x_btd, positions, spec,
                                        gate_threshold=gate_threshold)
        return x_btd, (stats, x_btd if collect_hidden else None)

    step = jax.checkpoint(block) if remat else block
    x, (stats, hidden) = jax.lax.scan(step, x, (params["blocks"], frozen["blocks"]))
    norm_state = params["final_norm"] if params["final_norm"] is not None \
        else frozen["final_norm"]
    h = nnx.merge(defs.final_norm, norm_state)(x)
    w = (frozen["embed"] if frozen["lm_head"] is None else frozen["lm_head"]).astype(compute_dtype)
    logits = jnp.einsum("btd,vd->btv", h.astype(w.dtype), w, preferred_element_type=F32)
    if defs.final_softcap:
        logits = defs.final_softcap * jnp.tanh(logits / defs.final_softcap)
    aux = {"zero_frac": stats[:, 0], "l1": stats[:, 1], "quantile": stats[:, 2],
           "l1_gate": stats[:, 3]}
    if collect_hidden:
        aux["hidden"] = hidden
    return logits, aux


def update(model, defs: ScanDefs, params) -> None:
    """Write `params` (as `split` made them, trained) back into `model`'s modules."""
    for i, layer in enumerate(model.layers):
        nnx.update(layer, jax.tree.map(lambda a, i=i: a[i], params["blocks"]))
    if params["final_norm"] is not None:
        nnx.update(model.final_norm, params["final_norm"])
