"""A loaded model ready to run: checkpoint + Transformer + tokenizer + engine, built from CLI args."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from powerinfer_jax._cli import DEFAULT_CONTEXT_CAP, DEFAULT_TARGET_SPARSITY
from powerinfer_jax.config import ModelConfig, PlacementConfig, RuntimeConfig, SparsityConfig
from powerinfer_jax.models.transformer import Transformer, from_params
from powerinfer_jax.runtime.decode import Engine


@dataclasses.dataclass
class Session:
    config: ModelConfig
    model: Transformer
    tokenizer: object  # powerinfer_jax.tokenizer.Tokenizer
    runtime: RuntimeConfig
    sparsity: SparsityConfig
    source: str
    thresholds: tuple[float, ...] | None = None  # per-layer, from the sparsity artifacts
    oracle_thresholds: tuple[float, ...] | None = None  # predictor mode: defines recall's oracle
    placement: object | None = None  # sparsity.placement.Placement applied to the model, if any
    _engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            max_len = kv_length(self.config, self.runtime)
            self._engine = Engine(self.model, max_seq_len=max_len, sparsity=self.sparsity,
                                  thresholds=self.thresholds)
        return self._engine


def kv_length(config: ModelConfig, runtime: RuntimeConfig) -> int:
    return runtime.max_seq_len or min(config.max_seq_len, DEFAULT_CONTEXT_CAP)


def open_session(model: str, runtime: RuntimeConfig, sparsity: SparsityConfig, *,
                 placement: PlacementConfig = PlacementConfig(), artifacts_root=None,
                 progress: bool = True) -> Session:
    """Load the model; for calibrated sparse modes also its sparsity artifacts (thresholds, and
    predictors attached to each FFN), built on first use for a registry model. Then, under a
    `--vram-budget` (or a GPU's default one), place FFN neurons hot/cold (runtime/placing.py)."""
    from powerinfer_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model)
    if runtime.max_seq_len is not None and runtime.max_seq_len > ckpt.config.max_seq_len:
        raise ValueError(f"--max-seq-len: expected at most {ckpt.config.max_seq_len} (the model's "
                         f"context), got {runtime.max_seq_len}")
    dtype = jnp.dtype(runtime.dtype)
    # With an accelerator the model is built in host memory and only what the placement keeps on
    # the device goes there (_to_accelerator): a model larger than the device's memory never
    # lands on it whole. The default budget is read before any weight is on the device.
    accel = _accelerator()
    default_budget = None
    if accel is not None and placement.budget_bytes is None:
        from powerinfer_jax.runtime.placing import default_budget_bytes

        default_budget = default_budget_bytes()
    with _on_host(accel):
        m, thresholds, oracle_thresholds, placed = _build(
            model, ckpt, dtype, runtime, sparsity, placement, artifacts_root, progress,
            default_budget)
    if accel is not None:
        _to_accelerator(m, accel)
    return Session(config=ckpt.config, model=m, tokenizer=ckpt.tokenizer, runtime=runtime,
                   sparsity=sparsity, source=str(ckpt.source), thresholds=thresholds,
                   oracle_thresholds=oracle_thresholds, placement=placed)


def _accelerator():
    """The first non-CPU device, or None on a CPU-only machine."""
    import jax

    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else dev


def _on_host(accel):
    import contextlib

    import jax

    return contextlib.nullcontext() if accel is None else jax.default_device(jax.devices("cpu")[0])


def _to_accelerator(m, device) -> None:
    """Move every array still in the model (dense parts, hot rows, predictors) to the device; the
    cold rows already live in the host store and are not in the model's state."""
    import jax
    from flax import nnx

    nnx.update(m, jax.device_put(nnx.state(m), device))


def _build(model, ckpt, dtype, runtime, sparsity, placement, artifacts_root, progress,
           default_budget):
    m = from_params(ckpt.config, ckpt.params, dtype=dtype, kernels=runtime.kernels)
    thresholds = oracle_thresholds = None
    if sparsity.calibrated:
        from powerinfer_jax.sparsity.artifacts import ensure_artifacts, use_predictor

        arts = ensure_artifacts(model, ckpt.source, m, ckpt.tokenizer, sparsity.target_sparsity,
                                need_predictor=(sparsity.mode == "predictor"
                                                and sparsity.predictor == "lowrank"),
                                root=artifacts_root, progress=progress)
        thresholds = arts.thresholds_for(sparsity.mode, sparsity.predictor)
        if sparsity.mode == "predictor":
            thresholds = use_predictor(m, arts, sparsity.predictor)
            oracle_thresholds = arts.thresholds_contribution
    placed = _place(model, ckpt, m, runtime, sparsity, placement, artifacts_root,
                    default_budget)
    return m, thresholds, oracle_thresholds, placed


def _place(model_arg, ckpt, m, runtime, sparsity, placement, artifacts_root, default_budget):
    from powerinfer_jax.runtime.placing import place_model
    from powerinfer_jax.sparsity.artifacts import artifacts_root as default_root
    from powerinfer_jax.sparsity.artifacts import model_fingerprint, target_dir

    if placement.budget_bytes is None and default_budget is None:
        return None  # CPU-only without --vram-budget: every FFN row runs on the FFI pool
    root = default_root(model_arg, ckpt.source) if artifacts_root is None else artifacts_root
    target = sparsity.target_sparsity or DEFAULT_TARGET_SPARSITY
    return place_model(m, placement, kv_len=kv_length(ckpt.config, runtime),
                       model_fingerprint=model_fingerprint(model_arg, ckpt.source, ckpt.config),
                       artifacts_dir=target_dir(root, target), cache_dir=root,
                       default_budget=default_budget)


def placement_from_args(args) -> PlacementConfig:
    return PlacementConfig(vram_budget_gib=getattr(args, "vram_budget", None),
                           offload=getattr(args, "offload", "hybrid"))


def configs_from_args(args, **runtime_fields) -> tuple[RuntimeConfig, SparsityConfig]:
    runtime = RuntimeConfig(dtype=args.dtype, threads=args.threads, max_seq_len=args.max_seq_len,
                            kernels=getattr(args, "kernels", "auto"), **runtime_fields)
    target = getattr(args, "target_sparsity", None)
    if target is None and args.sparsity in ("threshold", "predictor"):
        target = DEFAULT_TARGET_SPARSITY
    sparsity = SparsityConfig(mode=args.sparsity, threshold=args.threshold,
                              impl=getattr(args, "impl", "ffi"),
                              predictor=getattr(args, "predictor", "q4"),
                              gate_up=getattr(args, "gate_up", "full"),
                              target_sparsity=None if target is None else float(target))
    return runtime, sparsity
