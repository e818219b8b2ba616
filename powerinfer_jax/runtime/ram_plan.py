"""--ram-budget's side of a build (runtime/session.py): whether a model fits the budget or runs
from a store on disk (a dense model's neuron store, an MoE model's expert store), which tensors
the store holds instead of the model, and which formats a file keeps at load."""
from __future__ import annotations

from pathlib import Path

from powerinfer_jax.config import PlacementConfig, RuntimeConfig, kv_length
from powerinfer_jax.errors import fail
from powerinfer_jax.runtime import host


def ram_mode(ckpt, runtime, sparsity, placement, max_batch, accel) -> str:
    """--ram-budget: "memory" when the whole model fits (it then loads as without the flag),
    else "disk" (its FFN in a neuron store, an MoE model's routed experts in an expert store);
    clear errors for what cannot be offloaded."""
    import jax.numpy as jnp

    from powerinfer_jax.checkpoint.bundles import check_quantized  # lazy: start-up
    from powerinfer_jax.runtime import offload  # lazy: start-up
    # lazy: start-up
    from powerinfer_jax.runtime.expert_file import check_quantized as check_experts

    if accel is not None or runtime.devices is not None:
        fail("--ram-budget", "a CPU-only run on one device (the GPU tier of a disk-offloaded "
             "model is not built yet)", f"{accel or f'{runtime.devices} devices'}")
    if offload.fits_in_memory(ckpt, placement.ram_budget_bytes,
                              kv_len=kv_length(ckpt.config, runtime), batch=max_batch,
                              dtype=jnp.dtype(runtime.dtype),
                              extra=offload.predictor_bytes(sparsity, ckpt)):
        return "memory"
    if ckpt.config.n_experts:
        if sparsity.mode != "dense":
            fail("--sparsity with --ram-budget on an MoE model", "dense (the router selects the "
                 "experts, each read whole)", sparsity.mode)
        check_experts(ckpt)
        return "disk"
    offload.check_mode(sparsity)
    check_quantized(ckpt)
    return "disk"


def keep_only_ffn(ckpt) -> None:
    """Drop every tensor of a checkpoint this build loaded but its FFN rows and up biases (the
    neuron store's sources)."""
    keep = store_names(ckpt.config)
    for name in [n for n in ckpt.params if n not in keep and not n.endswith("ffn.up.bias")]:
        del ckpt.params[name]


def store_names(config) -> frozenset:
    """The tensors a disk-offloaded model's store holds: the FFN matrices (a neuron store) or
    the stacked routed experts (an MoE model's expert store)."""
    from powerinfer_jax.checkpoint.bundles import external_names  # lazy: start-up
    from powerinfer_jax.runtime.expert_file import external_names as expert_names  # lazy: start-up

    return expert_names(config) if config.n_experts else external_names(config)


def offloaded_names(ckpt, ram) -> frozenset:
    return store_names(ckpt.config) if ram == "disk" else frozenset()


def offload(model_arg, ckpt, m, runtime, sparsity, placement, artifacts_root, max_batch, ram,
             progress):
    """--ram-budget after the model is built: its arrays out of the file's pages, and (disk)
    the FFN pointed at a neuron store."""
    from powerinfer_jax.runtime import offload  # lazy: start-up
    from powerinfer_jax.sparsity.artifacts import artifacts_root as default_root  # lazy: start-up

    kv_len = kv_length(ckpt.config, runtime)
    budget = placement.ram_budget_bytes
    if ram == "memory":
        copied, _ = offload.make_anonymous(m)
        import jax.numpy as jnp

        need = offload.in_memory_bytes(ckpt, kv_len=kv_len, batch=max_batch,
                                       dtype=jnp.dtype(runtime.dtype),
                                       extra=offload.predictor_bytes(sparsity, ckpt))
        return offload.Offload(store=None, summary={
            "mode": "memory", "budget_bytes": budget, "resident_bytes": need,
            "copied_from_file_bytes": copied})
    root = default_root(model_arg, ckpt.source) if artifacts_root is None else artifacts_root
    share = placement.cache_share
    if ckpt.config.n_experts:
        from powerinfer_jax.runtime import expert_offload  # lazy: start-up

        return expert_offload.attach(
            m, ckpt, budget=budget, kv_len=kv_len, batch=max_batch, artifacts_root=root,
            policy=placement.neuron_cache,
            cache_share=expert_offload.DEFAULT_CACHE_SHARE if share is None else share,
            lookahead=placement.lookahead, progress=progress)
    return offload.attach(m, ckpt, budget=budget, kv_len=kv_len, batch=max_batch,
                          artifacts_root=root, policy=placement.neuron_cache,
                          cache_share=offload.DEFAULT_CACHE_SHARE if share is None else share,
                          lookahead=placement.lookahead, progress=progress)


def keeps_quantized(runtime: RuntimeConfig, placement: PlacementConfig, model=None) -> bool:
    """Whether a quantized file's blocks stay as they are: placement (a budget, or a GPU) moves
    float rows between memories and a mesh splits rows over devices, so those dequantize at load.
    An MoE file that is placed keeps them: its cold experts run on the host pool as stored, and
    only the hot experts become floats (models/moe.py `split`); on an accelerator everything
    but its experts is then dequantized after the load (`floats_but_experts`)."""
    placed = placement.budget_bytes is not None or host.accelerator() is not None
    if placed and is_moe_gguf(model):
        placed = False
    return runtime.weights == "auto" and not placed and runtime.devices is None


def floats_but_experts(ckpt) -> None:
    """An MoE file kept quantized for an accelerator: every tensor but the stacked experts as
    float32 (the device computes them with XLA; the experts are placed hot/cold later)."""
    from powerinfer_jax.checkpoint.base import QuantTensor  # lazy: start-up

    for name, t in list(ckpt.params.items()):
        if isinstance(t, QuantTensor) and ".ffn.experts." not in name:
            ckpt.params[name] = t.dequantize()


def is_moe_gguf(model) -> bool:
    """Whether `model` names a GGUF file with stacked experts (read from its header)."""
    path = Path(str(model)) if model is not None else None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        return False
    from powerinfer_jax.checkpoint.gguf import _open  # lazy: start-up

    return any(t.name.endswith("_exps.weight") for t in _open(path).tensors)
