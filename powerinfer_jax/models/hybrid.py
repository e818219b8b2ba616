"""Applying a `Placement` to a loaded Transformer: hot-first permutation, then the hot/cold split.

After `apply_placement`, layer l's FFN keeps rows [0, hot[l]) as ordinary (accelerator) Params. Rows
[hot[l], F) go, on a GPU with the CUDA build, into the CUDA module's host store (registered once,
named by a handle attribute; one hybrid custom call per layer runs hot rows in CUDA kernels and cold
rows on the host pool), and otherwise into `ColdRows` operands (the CPU-only hybrid: hot rows with
XLA, cold rows through the FFI custom call). See models/ffn.py (FFN.split; CpuHybrid,
CudaHybrid). No index remapping happens at run time.
A mixture-of-experts layer (models/moe.py) takes the same two steps with experts for neurons: the
most frequently routed experts first, then [0, hot[l]) kept as floats for the accelerator.
"""
from __future__ import annotations

# `placement`: a sparsity.placement.Placement (hot counts, orders, sizes), read by attribute:
# the model layer imports nothing from the sparsity layer above it.


def permute_model(model, placement) -> None:
    """Reorder every layer's neurons hot-first (output unchanged)."""
    _check(model, placement)
    for layer, order in zip(model.layers, placement.order):
        layer.ffn.permute(order)


def apply_placement(model, placement) -> None:
    """Permute hot-first and split each FFN at its hot count (in place)."""
    permute_model(model, placement)
    for layer, n_hot in zip(model.layers, placement.hot):
        layer.ffn.split(int(n_hot))


def _check(model, p) -> None:
    c = model.config
    units, what = (c.n_experts, "experts") if c.n_experts else (c.d_ff, "neurons")
    if p.n_layers != c.n_layers or any(f != units for f in p.sizes.d_ff):
        raise ValueError(f"placement: expected {c.n_layers} layers of {units} {what} (the "
                         f"model's), got {p.n_layers} layers of {set(p.sizes.d_ff)} {what} "
                         f"(a placement made for another model)")
