"""`build`: the one way to make a running model.

checkpoint -> config -> Transformer -> sparsity artifacts (only what the mode needs) -> the mode's
per-layer selectors -> placement under a memory budget -> engine. The CLIs, `powerinfer_jax.load`,
the experiments, the benchmarks and the server all build through here; defaults live in config.py.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from powerinfer_jax.config import (DEFAULT_MODEL, DEFAULT_TARGET_SPARSITY, ModelConfig,
                                   PlacementConfig, RuntimeConfig, SparsityConfig, kv_length)
from powerinfer_jax.errors import fail
from powerinfer_jax.runtime import host, ram_plan


@dataclasses.dataclass
class Session:
    """A built model: everything a caller needs to run, measure and report it."""

    config: ModelConfig
    # models.transformer.Transformer, configured and placed; None until `model` is first read
    # where the session started from a snapshot (runtime/snapshot.py)
    _model: object
    tokenizer: object  # powerinfer_jax.tokenizer.Tokenizer
    runtime: RuntimeConfig
    sparsity: SparsityConfig  # with the default target filled in where the mode needs one
    source: str  # the model file or directory
    model_arg: str  # what the caller named (registry name or path)
    threads: int  # kernel threads in use
    artifacts: object | None = None  # sparsity.artifacts.SparsityArtifacts, when the mode needs them
    placement: object | None = None  # sparsity.placement.Placement applied to the model, if any
    max_batch: int = 1
    auto: dict | None = None  # --sparsity auto: what was chosen and why (runtime/auto.py)
    offload: object | None = None  # runtime.offload.Offload under --ram-budget
    store: object | None = None  # runtime.executables.Store: compiled steps kept across processes
    progress: bool = False  # lines on stderr for long steps (compiling)
    # the engine's KV cache holds at most this many positions (None: kv_length); set before the
    # engine is made (generate sizes it to its prompt and new tokens)
    kv_limit: int | None = None
    timings: dict = dataclasses.field(default_factory=dict)  # seconds of build's phases
    # the model's snapshot this session started from (runtime/snapshot.py), and what builds the
    # model when something needs it (a step to compile, the API's model-level calls)
    snapshot: object | None = None
    _build_model: Callable[[], object] | None = None
    _engine: object | None = None

    @property
    def model(self):
        """The built model (models.transformer.Transformer); a session that started from a
        snapshot builds it here, on first use."""
        if self._model is None:
            self._model = self._build_model()
        return self._model

    @property
    def engine(self):
        """The model's decode engine (runtime/decode.py), made on first use; from a snapshot,
        over the snapshot's weights (the model is built only if a step must be compiled)."""
        if self._engine is None:
            from powerinfer_jax.runtime.decode import Engine  # lazy: start-up

            frozen = self._model is None and self.snapshot is not None
            self._engine = Engine(self.snapshot if frozen else self.model,
                                  max_seq_len=self.kv_positions,
                                  max_batch=self.max_batch, decode_block=self.runtime.decode_block,
                                  store=self.store, progress=self.progress)
        return self._engine

    @property
    def kv_positions(self) -> int:
        """Positions of the engine's KV cache per sequence."""
        full = kv_length(self.config, self.runtime)
        return full if self.kv_limit is None else min(full, self.kv_limit)

    @property
    def plan(self) -> tuple[dict, ...]:
        """Per layer: selector, threshold, backend, hot/cold rows (sparsity.modes.plan)."""
        return self._report("plan")

    def _report(self, key: str):
        """What describe and plan say of the model (model_report's `key`): the snapshot's
        record until the model is built."""
        if self._model is None and self.snapshot is not None:
            return self.snapshot.report[key]
        return model_report(self.model, key)[key]

    @property
    def oracle_thresholds(self) -> tuple[float, ...] | None:
        """Predictor mode: the calibrated contribution thresholds that define recall's oracle."""
        if self.artifacts is None or self.sparsity.mode != "predictor":
            return None
        return self.artifacts.thresholds_contribution

    def describe(self) -> dict:
        """What was built, for --json output and result rows."""
        return {"model": self.model_arg, "source": self.source, "dtype": self.runtime.dtype,
                "threads": self.threads, "sparsity": self.sparsity.mode,
                "target_sparsity": self.sparsity.target_sparsity,
                "predictor": self.sparsity.predictor if self.sparsity.mode == "predictor" else None,
                "gate_up": self.sparsity.gate_up if self.sparsity.mode == "predictor" else None,
                "kernels": self._report("kernels"), "max_seq_len": self.kv_positions,
                "weights": self._report("weights"), "auto": self.auto,
                "placement": None if self.placement is None else self.placement.summary(),
                "devices": self.runtime.devices, "decode_block": self.runtime.decode_block,
                "offload": None if self.offload is None else self.offload.describe()}


def model_report(model, *keys: str) -> dict:
    """What a session reports of its built model (kept in its snapshot): `keys` of kernels,
    weights and plan (all without keys)."""
    from powerinfer_jax.sparsity import modes  # lazy: start-up

    makers = {"kernels": lambda: model.kernels, "weights": lambda: weight_formats(model),
              "plan": lambda: modes.plan(model)}
    return {k: makers[k]() for k in keys or makers}


def weight_formats(model) -> dict[str, int]:
    """How many matrices the built model keeps in each format ("Q4_1", ..., or the float dtype;
    the file's format whatever the layout, e.g. rows interleaved for ops.qlinear)."""
    from flax import nnx

    counts: dict[str, int] = {}

    def count(key):
        counts[key] = counts.get(key, 0) + 1

    for module in (m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)):
        qtype = getattr(module, "qtype", None)
        weight = getattr(module, "weight", None)
        if isinstance(weight, nnx.Param):
            count(qtype or str(weight[...].dtype))
    if getattr(model, "embed_qtype", None):
        count(model.embed_qtype)
    return counts


def build(model: str = DEFAULT_MODEL, runtime: RuntimeConfig = RuntimeConfig(),
          sparsity: SparsityConfig = SparsityConfig(), *,
          placement: PlacementConfig = PlacementConfig(), artifacts_root=None,
          max_batch: int = 1, progress: bool = True, checkpoint=None) -> Session:
    """Load `model` (registry name, .gguf file or HF directory) and make it ready to run.

    runtime.threads sizes the kernels' thread pool in every mode (the CLIs also pin the process
    before XLA starts: `_cli.configure_threads`). Calibrated modes load their sparsity artifacts
    from `artifacts_root` (default: next to the model; for a registry model built on first use).
    With a memory budget (or on a GPU) FFN neurons are placed hot/cold (runtime/vram_budget.py).
    checkpoint: an already loaded Checkpoint of `model` (experiments that build several variants).
    """
    t0 = time.perf_counter()
    threads = host.size_thread_pool(runtime.threads)
    host.use_compilation_cache()
    if sparsity.mode == "auto":
        return _build_auto(model, runtime, sparsity, placement, artifacts_root, max_batch,
                           progress, checkpoint, threads)
    from powerinfer_jax.sparsity import modes  # lazy: start-up (modes import the model code)

    sparsity = modes.with_default_target(sparsity)
    accel = host.accelerator()
    # before the model code is imported and the model built: the compiled steps load beside
    store = _executable_store(model, runtime, sparsity, placement, max_batch, artifacts_root,
                              accel)
    t1 = time.perf_counter()
    args = (model, runtime, sparsity, placement, artifacts_root, max_batch, progress, threads,
            store, accel)
    from powerinfer_jax.runtime import snapshot  # lazy: start-up

    kept = store is not None and checkpoint is None and _keeps_snapshot(sparsity)
    if kept:
        snap = snapshot.load(store.dir)
        if snap is not None:
            return _from_snapshot(snap, *args, timings={
                "jax_s": t1 - t0, "load_s": time.perf_counter() - t1, "build_s": 0.0})
    session = _build(*args, checkpoint, times=(t0, t1))
    if store is None and session.store is None and checkpoint is None:
        # a registry model this build fetched could not be keyed before: keyed now, its steps
        # and snapshot are kept, so the next run loads them instead of compiling again
        session.store = store = _executable_store(model, runtime, sparsity, placement,
                                                  max_batch, artifacts_root, accel)
        kept = store is not None and _keeps_snapshot(sparsity)
    if kept:
        snapshot.save(store.dir, session.model, session.tokenizer,
                      {**model_report(session.model), "source": session.source})
    return session


def _keeps_snapshot(sparsity: SparsityConfig) -> bool:
    """Whether a model of this mode is kept as a snapshot (runtime/snapshot.py): a built-in
    mode that needs no sparsity artifacts (they could change under the snapshot's key)."""
    from powerinfer_jax.sparsity import modes  # lazy: start-up

    return modes.is_builtin(sparsity.mode) and modes.needs(sparsity) == modes.Needs()


def _from_snapshot(snap, model, runtime, sparsity, placement, artifacts_root, max_batch,
                   progress, threads, store, accel, timings) -> Session:
    """A session over a snapshot's weights, which builds the model only if asked for it."""
    _check_context(runtime, snap.config)

    def build_model():
        return _build(model, runtime, sparsity, placement, artifacts_root, max_batch, progress,
                      threads, store, accel, None).model

    session = Session(config=snap.config, _model=None, tokenizer=snap.tokenizer,
                      runtime=runtime, sparsity=sparsity, source=snap.report["source"],
                      model_arg=str(model), threads=threads, max_batch=max_batch, store=store,
                      progress=progress, timings=timings, snapshot=snap,
                      _build_model=build_model)
    snap.thaw = lambda: session.model
    return session


def _interleaved_file(ckpt, accel, runtime: RuntimeConfig):
    """The GGUF's interleaved copies kept beside it (checkpoint/interleaved_file.py), for a
    model whose quantized matrices stay blocks on this host (the CPU's custom calls), or None."""
    from powerinfer_jax.checkpoint import interleaved_file  # lazy: start-up
    from powerinfer_jax.checkpoint.base import QuantTensor  # lazy: start-up

    # a file under MIN_BYTES never holds that many interleaved bytes, so none is kept for it
    # (the snapshot keeps such models): no fingerprint of it read at every build
    if (accel is not None or runtime.devices is not None or not interleaved_file.enabled()
            or not Path(ckpt.source).is_file()
            or Path(ckpt.source).stat().st_size < interleaved_file.MIN_BYTES
            or not any(isinstance(t, QuantTensor) for t in ckpt.params.values())):
        return None
    return interleaved_file.InterleavedFile(ckpt.source)


def _check_context(runtime: RuntimeConfig, config: ModelConfig) -> None:
    if runtime.max_seq_len is not None and runtime.max_seq_len > config.max_seq_len:
        fail("max_seq_len", f"at most {config.max_seq_len} (the model's context)",
             runtime.max_seq_len)


def _build(model, runtime, sparsity, placement, artifacts_root, max_batch, progress, threads,
           store, accel, checkpoint, times=None) -> Session:
    """build's model: checkpoint, modules, layouts, sparsity, placement (times: build's start
    and the end of its preparations, for the session's timings)."""
    t0, t1 = times or (time.perf_counter(),) * 2
    # imported here, after the store began loading steps in the background (start-up time)
    from powerinfer_jax.checkpoint import load_checkpoint  # lazy: start-up
    from powerinfer_jax.checkpoint.loader import return_freed_memory  # lazy: start-up
    from powerinfer_jax.models.transformer import from_params  # lazy: start-up
    from powerinfer_jax.sparsity import modes  # lazy: start-up

    if checkpoint is None:
        if placement.ram_budget_bytes is not None:
            from powerinfer_jax.runtime import offload  # lazy: start-up

            offload.check_budget_from_header(model, placement.ram_budget_bytes)
        ckpt = load_checkpoint(model, keep_quantized=ram_plan.keeps_quantized(runtime, placement,
                                                                              model))
    else:
        ckpt = checkpoint
    if accel is not None and ckpt.config.n_experts:
        ram_plan.floats_but_experts(ckpt)
    t2 = time.perf_counter()
    modes.check_weights(sparsity, _ffn_qtype(ckpt))
    _check_context(runtime, ckpt.config)
    # --ram-budget: "disk" (FFN rows in a neuron store, runtime/offload.py), "memory" (it fits)
    ram = None if placement.ram_budget_bytes is None else ram_plan.ram_mode(
        ckpt, runtime, sparsity, placement, max_batch, accel)
    if ram == "memory" and store is None and checkpoint is None:
        # it loads as without the flag, so its steps are those (no neuron store's handle in
        # them) and are kept across processes as those are: compiling them at every run put
        # XLA's compile memory on top of the model's, over a limit of the model's size
        store = _executable_store(model, runtime, sparsity,
                                  dataclasses.replace(placement, ram_budget_gib=None), max_batch,
                                  artifacts_root, accel)
    # With an accelerator the model is built in host memory and only what the placement keeps on
    # the device goes there: a model larger than the device's memory never lands on it whole.
    # The default budget is read before any weight is on the device.
    default_budget = None
    shards = runtime.devices or 1
    if runtime.devices is not None:
        from powerinfer_jax.runtime.mesh import check_divisible, make_mesh  # lazy: start-up

        make_mesh(shards)  # fail on a bad device count before loading anything heavy
        check_divisible(ckpt.config, shards)
    # A mesh spreads the model over its devices: no default GPU placement (--vram-budget still
    # places, per mesh: hot rows split over the devices, cold rows on the host).
    if accel is not None and placement.budget_bytes is None and runtime.devices is None:
        # lazy: start-up (gguf only for GGUF files)
        from powerinfer_jax.runtime.vram_budget import default_budget_bytes

        default_budget = default_budget_bytes()
    with host.on_host(accel):
        import jax.numpy as jnp

        # quantized matrices arranged once for how the mode reads them (models/qweights.py)
        layout = modes.ffn_layout(sparsity, ckpt.config)
        copies = _interleaved_file(ckpt, accel, runtime)
        m = from_params(ckpt.config, ckpt.params, dtype=jnp.dtype(runtime.dtype),
                        kernels=runtime.kernels, decode_attention=runtime.decode_attention,
                        fuse_qkv=runtime.fuse_qkv, copies=copies,
                        ffn_layout=layout, external=ram_plan.offloaded_names(ckpt, ram))
        if copies is not None:
            copies.save()
        if ram == "disk" and ckpt.config.n_experts:
            from powerinfer_jax.runtime.expert_offload import stub_experts  # lazy: start-up

            stub_experts(m, ckpt)
        elif ram == "disk":
            from powerinfer_jax.runtime.offload import stub_ffns  # lazy: start-up

            stub_ffns(m, ckpt, layout)
        arts = _artifacts(model, ckpt, m, sparsity, artifacts_root, progress)
        modes.configure(m, sparsity, arts)
        offloaded = None
        if ram is not None:
            if checkpoint is None and ram == "disk":
                # the model holds its own copies now: the loader's (Q/K rows in RoPE order, a
                # fifth of the dense bytes) go before the store takes its memory
                ram_plan.keep_only_ffn(ckpt)
            offloaded = ram_plan.offload(model, ckpt, m, runtime, sparsity, placement,
                                         artifacts_root, max_batch, ram, progress)
            placed = None
        else:
            placed = _place(model, ckpt, m, runtime, sparsity, placement, artifacts_root,
                            default_budget, shards)
    if runtime.devices is not None:
        from powerinfer_jax.runtime.mesh import shard_model  # lazy: start-up

        shard_model(m, runtime.devices)
    elif accel is not None:
        host.to_accelerator(m, accel)
    # the build's temporaries (the loader's copies, layouts, predictors) leave glibc's arenas
    # before the first step's buffers are allocated: they would stay in the peak otherwise
    return_freed_memory()
    t3 = time.perf_counter()
    return Session(config=ckpt.config, _model=m, tokenizer=ckpt.tokenizer, runtime=runtime,
                   sparsity=sparsity, source=str(ckpt.source), model_arg=str(model),
                   threads=threads, artifacts=arts, placement=placed,
                   max_batch=max_batch, offload=offloaded, store=store, progress=progress,
                   timings={"jax_s": t1 - t0, "load_s": t2 - t1, "build_s": t3 - t2})


def _executable_store(model, runtime, sparsity, placement, max_batch, artifacts_root, accel):
    """The store of compiled steps for this request (runtime/executables.py), its recent steps
    already loading in the background; None where compiled steps cannot be reused across
    processes (an accelerator, a placement's or a neuron store's handles, a mesh) or the cache
    is off."""
    import os

    import jax

    from powerinfer_jax import cache_limit  # lazy: start-up
    from powerinfer_jax.runtime import executables  # lazy: start-up

    cache_limit.check_limit()  # a malformed $POWERINFER_JAX_CACHE_LIMIT: one line, now
    if (not executables.enabled() or accel is not None or placement.budget_bytes is not None
            or placement.ram_budget_bytes is not None  # the store's handle is in the steps
            or runtime.devices is not None or len(jax.devices()) != 1):
        return None
    path = Path(model).expanduser()
    if not path.exists():
        from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, model_path  # lazy: start-up

        if str(model) not in KNOWN_MODELS:
            return None  # load_checkpoint says why
        path = model_path(str(model))
    try:
        st = (path / "config.json" if path.is_dir() else path).stat()
    except OSError:
        return None  # not fetched yet: the first run compiles
    request = {"model": str(path.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns,
               "runtime": dataclasses.asdict(runtime), "sparsity": dataclasses.asdict(sparsity),
               "max_batch": max_batch, "artifacts": None if artifacts_root is None
               else os.path.abspath(artifacts_root)}
    store = executables.Store(executables.identity(request))
    store.prefetch()
    return store


def _build_auto(model, runtime, sparsity, placement, artifacts_root, max_batch, progress,
                checkpoint, threads) -> Session:
    """--sparsity auto: dense, or the sparse candidate where it is measurably faster here
    (runtime/auto.py: estimate, interleaved timing, cached verdict)."""
    from powerinfer_jax.checkpoint import load_checkpoint  # lazy: start-up
    from powerinfer_jax.runtime import auto  # lazy: start-up
    from powerinfer_jax.sparsity.artifacts import artifacts_root as default_root  # lazy: start-up

    if checkpoint is None:
        checkpoint = load_checkpoint(
            model, keep_quantized=ram_plan.keeps_quantized(runtime, placement, model))
    target = sparsity.target_sparsity or DEFAULT_TARGET_SPARSITY
    root_arg = artifacts_root
    root = Path(default_root(model, checkpoint.source) if artifacts_root is None
                else artifacts_root)

    def one(cfg, artifacts_root=None):  # None: the caller's artifacts
        return build(model, runtime, cfg, placement=placement,
                     artifacts_root=artifacts_root or root_arg, max_batch=max_batch,
                     progress=progress, checkpoint=checkpoint)

    trials: list[Path] = []

    def trial(dense):
        made = _trial_artifacts(model, dense, root, target, progress)
        trials.extend([made] if made is not None else [])
        return made

    try:
        session, report = auto.choose(
            one, key=auto.cache_key(checkpoint.source, runtime, threads, target),
            target=target, cache_dir=root, progress=progress, trial=trial,
            sparse="oracle" if _ffn_qtype(checkpoint) else "predictor_q4gu")
    finally:
        for d in trials:  # the trial thresholds served the timing only
            shutil.rmtree(d, ignore_errors=True)
    session.auto = auto.describe(report)
    return session


def _ffn_qtype(checkpoint) -> str | None:
    """The block format the model keeps its FFN in (loaded with keep_quantized), None: floats."""
    from powerinfer_jax.checkpoint.base import QuantTensor  # lazy: start-up

    up = checkpoint.params.get("layers.0.ffn.up.weight")
    return up.qtype if isinstance(up, QuantTensor) else None


def _trial_artifacts(model_arg, dense: Session, root: Path, target: float, progress: bool):
    """Where auto's sparse candidate finds its thresholds: None when the real artifacts exist;
    for the default model (whose artifacts are built on first use, minutes) thresholds
    calibrated on a few thousand tokens in a temporary directory, so that the full build happens
    only if the candidate wins; a user's model without artifacts: None (its build then says how
    to make them)."""
    import tempfile

    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS  # lazy: start-up
    from powerinfer_jax.runtime.auto import TRIAL_TOKENS  # lazy: start-up
    from powerinfer_jax.sparsity import artifacts as A  # lazy: start-up

    if (A.target_dir(root, target) / "meta.json").is_file() or str(model_arg) not in KNOWN_MODELS:
        return None
    if progress:
        print(f"powerinfer_jax: --sparsity auto: calibrating trial thresholds on {TRIAL_TOKENS} "
              "tokens to time the sparse mode (its full artifacts are built only if it wins)",
              file=sys.stderr, flush=True)
    trial = Path(tempfile.mkdtemp(prefix="pij-auto-trial-"))
    A.build_artifacts(dense.model, dense.tokenizer,
                      fingerprint=A.model_fingerprint(model_arg, dense.source, dense.config),
                      root=trial, target_sparsity=target, max_tokens=TRIAL_TOKENS, train=None,
                      progress=progress)
    return trial


def _artifacts(model_arg, ckpt, m, sparsity, root, progress):
    from powerinfer_jax.sparsity import modes  # lazy: start-up

    need = modes.needs(sparsity)
    if need.inputs:
        from powerinfer_jax.sparsity import artifacts as arts_mod  # lazy: start-up
        from powerinfer_jax.sparsity import input_sparsity  # lazy: start-up

        input_sparsity.check_model(m)
        root = arts_mod.artifacts_root(model_arg, ckpt.source) if root is None else root
        return input_sparsity.ensure(
            m, ckpt.tokenizer, rule=modes.input_rule(sparsity),
            target=float(sparsity.target_sparsity), root=root, progress=progress,
            fingerprint=arts_mod.model_fingerprint(model_arg, ckpt.source, ckpt.config))
    if need.model_file:
        return modes.get(sparsity.mode).load(sparsity.predictor_file or str(ckpt.source),
                                             ckpt.config)
    if not need.thresholds and not need.lowrank:
        return None
    from powerinfer_jax.sparsity.artifacts import ensure_artifacts  # lazy: start-up

    return ensure_artifacts(model_arg, ckpt.source, m, ckpt.tokenizer, sparsity.target_sparsity,
                            need_predictor=need.lowrank, root=root, progress=progress)


def _place(model_arg, ckpt, m, runtime, sparsity, placement, artifacts_root, default_budget,
           shards=1):
    if placement.budget_bytes is None and default_budget is None:
        return None  # CPU-only without --vram-budget: every FFN row runs on the FFI pool
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.runtime.vram_budget import place_model
    from powerinfer_jax.sparsity.artifacts import artifacts_root as default_root  # lazy: start-up
    from powerinfer_jax.sparsity.artifacts import model_fingerprint, target_dir  # lazy: start-up

    root = default_root(model_arg, ckpt.source) if artifacts_root is None else artifacts_root
    target = sparsity.target_sparsity or DEFAULT_TARGET_SPARSITY
    return place_model(m, placement, kv_len=kv_length(ckpt.config, runtime),
                       model_fingerprint=model_fingerprint(model_arg, ckpt.source, ckpt.config),
                       artifacts_dir=target_dir(root, target), cache_dir=root,
                       default_budget=default_budget, shards=shards, tokenizer=ckpt.tokenizer)
