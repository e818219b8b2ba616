"""Sparsity modes: the registry `--sparsity` chooses from, and `configure`, which resolves a mode
into one selector per FFN layer once, when the model is built.

A mode is a `Mode`: a factory that returns the per-layer selectors (sparsity/selectors.py) and a
statement of which sparsity artifacts it needs (calibrated per-layer thresholds; trained low-rank
predictors), so the build makes only those. A new mode is one Selector subclass and one
`register` call; the CLIs, the build and the report pick it up by name:

    class TopK(Selector): ...
    modes.register("topk", modes.Mode(make=lambda model, cfg, arts: [TopK(8)] * n, doc="..."))
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from powerinfer_jax.config import DEFAULT_TARGET_SPARSITY, add_sparsity_mode
from powerinfer_jax.errors import check_choice, fail

# The layouts, the selectors and the model code are imported where a mode is made, not here: the
# CLIs read the registry before jax is imported, and a run that starts from a model snapshot
# (runtime/snapshot.py) builds no model.
# make(model, sparsity_config, artifacts) -> one Selector (or None: dense) per layer.
# `artifacts` is a SparsityArtifacts when the mode needs them, else None.
MakeSelectors = Callable[[object, object, object], list]


@dataclasses.dataclass(frozen=True)
class Needs:
    """Which sparsity artifacts a mode needs (the build makes nothing else)."""

    thresholds: bool = False  # per-layer calibrated thresholds (profile + calibration)
    lowrank: bool = False  # trained low-rank predictors
    inputs: bool = False  # calibrated input-sparsity thresholds (sparsity/input_sparsity.py)
    model_file: bool = False  # predictors stored in the model file itself (Mode.load reads them)


def _qweights():
    from powerinfer_jax.models import qweights  # lazy: start-up (jax, the checkpoint code)

    return qweights


def selected_rows(cfg=None, model_config=None) -> FfnLayout:
    """A sparse mode's default layout: a selector's neurons (models/qweights.py)."""
    return _qweights().SELECTED_LAYOUT


def every_gate(cfg, model_config) -> FfnLayout:
    """Modes that compute every neuron's gate (the oracle): gate read whole; up read whole too,
    except for ReLU-family gates, where a neuron whose gate does not fire reads no up row (exact
    zeros: relu and drelu), so up rows are read one by one."""
    relu = model_config.activation in ("relu", "drelu") and model_config.gated
    q = _qweights()
    return q.FfnLayout(gate=q.MATVEC, up=q.ROWS if relu else q.MATVEC, down=q.GROUPS)


@dataclasses.dataclass(frozen=True)
class Mode:
    make: MakeSelectors
    doc: str
    needs: Callable[[object], Needs] = lambda cfg: Needs()
    # Needs.model_file: load(model file path, ModelConfig) -> what `make` receives as artifacts
    load: Callable[[str, object], object] | None = None
    # layout(SparsityConfig, ModelConfig) -> FfnLayout: the build plan's FFN layouts
    layout: Callable[[object, object], FfnLayout] = selected_rows


_MODES: dict[str, Mode] = {}


def register(name: str, mode: Mode) -> None:
    """Add (or replace) a sparsity mode under `name`."""
    if not (isinstance(name, str) and name.isidentifier()):
        fail("sparsity mode name", "an identifier", name)
    _MODES[name] = mode
    add_sparsity_mode(name)


def is_builtin(name: str) -> bool:
    """Whether mode `name` is this module's own (not added or replaced by `register` since)."""
    return name in _BUILTIN and _MODES.get(name) is _BUILTIN[name]


def names() -> tuple[str, ...]:
    return tuple(_MODES)


def get(name: str) -> Mode:
    check_choice("sparsity", name, names())
    return _MODES[name]


def with_default_target(cfg):
    """`cfg` (a SparsityConfig) with DEFAULT_TARGET_SPARSITY when its mode needs calibrated
    thresholds and no target was given (threshold and predictor modes; oracle runs without)."""
    if cfg.target_sparsity is None and needs(cfg).thresholds:
        return dataclasses.replace(cfg, target_sparsity=DEFAULT_TARGET_SPARSITY)
    return cfg


def check_weights(cfg, ffn_qtype: str | None) -> None:
    """Refuse a mode that would not do what its name says on these weights (ffn_qtype: the
    block format the FFN is kept in, None for floats): the q4 predictor on a model kept in its
    file's blocks would estimate each neuron from the model's own gate and up rows, i.e. compute
    every neuron exactly and predict nothing (and --gate-up would have no choice left)."""
    if cfg.mode == "predictor" and cfg.predictor == "q4" and ffn_qtype is not None:
        fail("sparsity='predictor' with predictor='q4'", "a model with float weights (on one "
             "kept in its file's blocks the q4 estimates are its own gate and up rows: every "
             "neuron is computed and nothing is predicted)", f"an FFN in {ffn_qtype} blocks",
             "sparsity='oracle' with target_sparsity computes exactly that, named by what it "
             "does; predictor='lowrank' predicts before reading any row")


def needs(cfg) -> Needs:
    """What `cfg` (a SparsityConfig) needs from the sparsity artifacts."""
    return get(cfg.mode).needs(cfg)


def ffn_layout(cfg, model_config) -> FfnLayout:
    """How mode `cfg.mode` reads a quantized FFN's matrices: the build plan's layouts, chosen
    before the model is loaded (models.transformer.from_params(ffn_layout=...))."""
    return get(cfg.mode).layout(cfg, model_config)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Per-layer thresholds given by hand, standing in for calibrated artifacts (every kind)."""

    values: tuple[float, ...]
    predictors: object = None

    @property
    def thresholds_contribution(self):
        return self.values

    thresholds_gate = thresholds_q4 = thresholds_contribution


def configure(model, cfg, artifacts=None, *, thresholds=None, predictors=None
              ) -> tuple[dict, ...]:
    """Install mode `cfg.mode`'s selector in every FFN of `model` (before placement: predictors
    are built from unsplit rows). Returns the per-layer plan (what each layer runs, for --json).

    artifacts: the SparsityArtifacts the mode needs (`needs(cfg)`), else None.
    thresholds: per-layer thresholds chosen by hand instead of calibrated artifacts.
    predictors: per-layer predictor modules for predictor mode (tests, research, predictors from
      another tool such as PowerInfer's): active where predictor(x) > the layer's threshold
      (`thresholds`, else cfg.threshold).
    """
    n = model.config.n_layers
    if thresholds is not None:
        thresholds = tuple(float(t) for t in thresholds)
        if len(thresholds) != n:
            fail("thresholds", f"one per layer ({n})", len(thresholds))
        artifacts = Thresholds(thresholds)
    from powerinfer_jax.models.ffn import Selector  # lazy: start-up
    from powerinfer_jax.sparsity.selectors import Scores  # lazy: start-up

    if predictors is not None:
        if len(predictors) != n:
            fail("predictors", f"one per layer ({n})", len(predictors))
        thr = thresholds or (cfg.threshold,) * n
        selectors = [Scores(p, t) for p, t in zip(predictors, thr)]
    else:
        if needs(cfg).thresholds and artifacts is None:
            fail(f"sparsity mode {cfg.mode!r}", "its calibrated artifacts (or thresholds)", None,
                 "build them with python -m powerinfer_jax.calibrate")
        selectors = list(get(cfg.mode).make(model, cfg, artifacts))
    if len(selectors) != n or not all(s is None or isinstance(s, Selector) for s in selectors):
        fail(f"sparsity mode {cfg.mode!r} selectors", f"{n} Selector objects (or None)",
             [type(s).__name__ for s in selectors])
    import jax

    impl = cfg.impl
    if cfg.gate_up == "q4" and jax.default_backend() != "cpu":
        impl = "reference"  # the CUDA sparse FFN takes scores or oracle, not activations
    layout = selected_rows() if predictors is not None else ffn_layout(cfg, model.config)
    for layer, sel in zip(model.layers, selectors):
        if sel is not None:  # layouts are decided at load, never converted after
            _qweights().check_ffn_layout(layer.ffn, layout, f"sparsity mode {cfg.mode!r}")
        layer.ffn.set_selector(sel, impl=impl)
    return plan(model)


def plan(model) -> tuple[dict, ...]:
    """Per layer: the selector (with its threshold), the backend and the hot/cold row counts."""
    out = []
    for layer in model.layers:
        ffn = layer.ffn
        sel = {"selector": "dense"} if ffn.selector is None else ffn.selector.describe()
        out.append({**sel, "backend": type(ffn.backend).__name__, "n_hot": ffn.n_hot,
                    "n_cold": ffn.n_cold})
    return tuple(out)


# ------------------------------------------------------------------------------ built-in modes
def _per_layer(cls, thresholds):
    return [cls(t) for t in thresholds]


def _dense(model, cfg, arts):
    return [None] * model.config.n_layers


def _oracle(model, cfg, arts):
    from powerinfer_jax.sparsity.selectors import Oracle  # lazy: start-up

    if arts is None:  # a scalar threshold (0: every non-zero activation)
        return [Oracle(cfg.threshold) for _ in model.layers]
    return _per_layer(Oracle, arts.thresholds_contribution)


def _threshold(model, cfg, arts):
    from powerinfer_jax.sparsity.selectors import GateMagnitude  # lazy: start-up

    return _per_layer(GateMagnitude, arts.thresholds_gate)


def _predictor(model, cfg, arts):
    from powerinfer_jax.sparsity import selectors as S  # lazy: start-up
    from powerinfer_jax.sparsity.artifacts import check_predictor_shape, model_shape  # lazy
    from powerinfer_jax.sparsity.nibble_predictor import NibblePredictor  # lazy: start-up

    ffn = model.layers[0].ffn
    check_weights(cfg, ffn.up.qtype if ffn.quantized else None)
    if cfg.predictor == "q4":
        preds = [NibblePredictor.from_ffn(l.ffn, kernels=model.kernels) for l in model.layers]
        if cfg.gate_up == "q4":
            return [S.Q4Activations(p, t) for p, t in zip(preds, arts.thresholds_q4)]
        return [S.Scores(p, t) for p, t in zip(preds, arts.thresholds_q4)]
    if getattr(arts, "predictors", None) is None:
        fail("predictor lowrank", "trained low-rank predictors in the artifacts", None,
             "build them with python -m powerinfer_jax.calibrate --predictor")

    check_predictor_shape(arts.predictors, model_shape(model.config))
    return [S.Scores(arts.predictors.layer(l, dtype=model.dtype, kernels=model.kernels), 0.0)
            for l in range(model.config.n_layers)]


def _auto(model, cfg, arts):
    fail("sparsity mode 'auto'", "to be resolved by the build (runtime/auto.py) into dense or "
         "a sparse mode", "a direct configure() call", "use runtime.session.build")


register("dense", Mode(_dense, "every neuron, XLA's matmuls or the custom call (the reference)",
                       layout=lambda cfg, mc: _qweights().DENSE_LAYOUT))
register("auto", Mode(_auto, "dense or predictor mode with the q4 activations, whichever decodes "
                             "faster on this machine (timed once at build, then cached)"))
register("oracle", Mode(
    _oracle, "the true active set: |a_i| > --threshold (or the calibrated per-layer thresholds "
             "with --target-sparsity): the quality upper bound",
    needs=lambda cfg: Needs(thresholds=cfg.target_sparsity is not None), layout=every_gate))
def _powerinfer(model, cfg, predictors):
    from powerinfer_jax.sparsity.powerinfer_predictor import selectors  # lazy: start-up

    return selectors(model, predictors)


def _powerinfer_load(source, config):
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.powerinfer import load_predictors

    return load_predictors(source, config, keep_quantized=True)  # selectors() decides the form


register("powerinfer", Mode(
    _powerinfer, "the predictors of a PowerInfer GGUF (blk.i.fc1/fc2, read from the model file), "
                 "on the residual stream as PowerInfer runs them",
    needs=lambda cfg: Needs(model_file=True), load=_powerinfer_load))
register("threshold", Mode(
    _threshold, "calibrated |act(gate_i . x)| thresholds, the gate computed densely (CATS-style)",
    needs=lambda cfg: Needs(thresholds=True)))
def _predictor_layout(cfg, model_config) -> FfnLayout:
    return selected_rows()  # rows read per predicted neuron (q4 on float weights, lowrank)


register("predictor", Mode(
    _predictor, "a predictor chooses the active set before any FFN row is read (--predictor)",
    needs=lambda cfg: Needs(thresholds=True, lowrank=cfg.predictor == "lowrank"),
    layout=_predictor_layout))

# Input sparsity (sparsity/input_sparsity.py): every matrix of a block skips its input's small
# channels; the FFN itself runs dense (no selector), its matrices in the columns layout.
INPUT_RULES = {"input_magnitude": "magnitude", "input_weighted": "weighted"}


def input_rule(cfg) -> str | None:
    """The input-sparsity rule of `cfg`'s mode (None: not an input-sparsity mode)."""
    return INPUT_RULES.get(cfg.mode)


def _inputs(model, cfg, arts):
    from powerinfer_jax.sparsity import input_sparsity  # lazy: start-up

    input_sparsity.install(model, arts)
    return [None] * model.config.n_layers


def _inputs_needs(cfg) -> Needs:
    if cfg.target_sparsity is None:
        fail(f"sparsity {cfg.mode!r}", "a --target-sparsity in [0, 1) (a lossy mode runs only at "
             "a model-wide sparsity you choose)", None, "e.g. --target-sparsity 0.4")
    return Needs(inputs=True)


for _name, _rule in INPUT_RULES.items():
    register(_name, Mode(
        _inputs, f"input sparsity, {_rule} rule: each matrix skips the input channels whose "
                 + ("|x_j|" if _rule == "magnitude" else "|x_j| * ||W[:, j]||")
                 + " is below a threshold calibrated for --target-sparsity (model-wide share of "
                   "the blocks' matrix bytes); stock SwiGLU/GeGLU models",
        needs=_inputs_needs, layout=lambda cfg, mc: _qweights().INPUTS_LAYOUT))

_BUILTIN = dict(_MODES)  # the modes above, as registered here
