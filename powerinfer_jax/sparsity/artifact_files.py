"""Sparsity artifact files: written whole or not at all, read back only when every file checks out.

A target's directory (`sparsity/target_0.50/`) holds meta.json, profile.npz, frequency.png, the
orbax predictor/ (when trained) and record.json (powerinfer_jax.cache's record of every file).

* `write_dir` builds into a temporary directory beside the target and renames it into place,
  under the target's lock: two builds of the same target serialize (the second then finds the
  first's result, see `load_or_build`), a reader never sees half a directory, and a crash
  leaves no partial artifacts where they belong.
* `read_dir` checks, in order: the record (a file changed, truncated or missing since it was
  written), meta.json (JSON, format, fingerprint, every key with its type and per-layer length),
  profile.npz (readable, the model's shapes, sane counts) and, when needed, the predictor
  (restorable, the model's shapes, finite). Any failure is an `ArtifactError` naming the file,
  the rule and the fix; nothing else escapes, and nothing wrong is returned.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer_jax import cache, errors
from powerinfer_jax.sparsity import predictor as pred
from powerinfer_jax.sparsity import profile as prof

THRESHOLD_KEYS = ("thresholds_contribution", "thresholds_gate", "thresholds_q4")


class ArtifactError(errors.UserError):
    """Sparsity artifacts that are missing, incomplete, corrupt, stale or for another model.
    `reason`: what is wrong, without the fix (a build that rebuilds them itself says so)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


def fix_hint(directory: Path) -> str:
    return (f"delete {directory} and rebuild it with python -m powerinfer_jax.calibrate for this "
            "model and target (the default model rebuilds it on its own)")


def _fail(what: str, rule: str, got: str, directory: Path) -> "NoReturn":  # noqa: F821
    reason = f"{what}: expected {rule}, got {got}"
    raise ArtifactError(f"{reason} ({fix_hint(directory)})", reason)


def write_dir(directory: Path, meta: dict, profile: prof.ActivationProfile,
              predictors: pred.PredictorStack | None) -> None:
    """Write the artifacts of one target into `directory`, atomically, under its lock."""
    directory = Path(directory).resolve()
    with cache.lock(directory, what=f"sparsity artifacts {directory}"), \
            cache.atomic_dir(directory) as tmp:
        profile.save(tmp / "profile.npz")
        prof.plot_frequency(profile, tmp / "frequency.png")
        if predictors is not None:
            import orbax.checkpoint as ocp

            ckptr = ocp.StandardCheckpointer()
            ckptr.save(tmp / "predictor", predictors.arrays())
            ckptr.wait_until_finished()
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        cache.write_dir_record(tmp)


def read_dir(directory: Path, *, fingerprint: dict, format_version: int, need_predictor: bool
             ) -> tuple[dict, pred.PredictorStack | None]:
    """(validated meta, predictor stack or None) of `directory`, under its shared lock."""
    directory = Path(directory).resolve()
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        reason = f"sparsity artifacts: expected {meta_path}, got no such file"
        raise ArtifactError(f"{reason} (build them with python -m powerinfer_jax.calibrate for "
                            "this model and target; the default model builds them on its own)",
                            reason)
    with cache.lock(directory, shared=True):
        if cache.has_dir_record(directory):
            reason = cache.check_dir(directory)
            if reason is not None:
                _fail(f"sparsity artifacts {directory}", "the files recorded when they were built",
                      reason, directory)
        meta = read_meta(meta_path, fingerprint, format_version)
        read_profile(directory / "profile.npz", fingerprint["shape"])
        stack = None
        if need_predictor:
            if not meta["has_predictor"]:
                reason = (f"sparsity artifacts {directory}: expected trained predictors (for "
                          "predictor lowrank), got none")
                raise ArtifactError(
                    f"{reason} (build them with python -m powerinfer_jax.calibrate --sparsity "
                    "predictor --predictor lowrank for this model and target, or run with "
                    "--predictor q4)", reason)
            stack = read_predictor(directory / "predictor", fingerprint["shape"])
    return meta, stack


def read_meta(path: Path, fingerprint: dict, format_version: int) -> dict:
    directory = path.parent
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        _fail(str(path), "a JSON object", f"unreadable JSON ({type(e).__name__}: {e})", directory)
    if not isinstance(meta, dict):
        _fail(str(path), "a JSON object", type(meta).__name__, directory)
    if meta.get("format_version") != format_version:
        _fail(str(path), f"format_version {format_version}", repr(meta.get("format_version")),
              directory)
    got = meta.get("fingerprint")
    got = got if isinstance(got, dict) else {}
    if got.get("shape") != fingerprint["shape"]:
        _fail(str(path), f"a model of shape {fingerprint['shape']}",
              f"artifacts for {got.get('shape')} (built for another model)", directory)
    if got.get("id") != fingerprint["id"]:
        _fail(str(path), f"model fingerprint {fingerprint['id']}",
              f"{got.get('id')!r} (stale: the model changed since they were built)", directory)
    n_layers = fingerprint["shape"]["n_layers"]
    target = meta.get("target_sparsity")
    if not (_is_number(target) and 0.0 <= target < 1.0):
        _fail(f"{path} key 'target_sparsity'", "a number in [0, 1)", repr(target), directory)
    for key in THRESHOLD_KEYS:
        values = meta.get(key)
        if not (isinstance(values, list) and len(values) == n_layers
                and all(_is_number(v) and math.isfinite(v) and v >= 0 for v in values)):
            _fail(f"{path} key {key!r}", f"{n_layers} per-layer finite numbers >= 0",
                  _short(values), directory)
    if not isinstance(meta.get("has_predictor"), bool):
        _fail(f"{path} key 'has_predictor'", "true or false", _short(meta.get("has_predictor")),
              directory)
    return meta


def read_profile(path: Path, shape: dict) -> prof.ActivationProfile:
    """The ActivationProfile at `path`, checked against the model's shape."""
    directory = path.parent
    try:
        p = prof.ActivationProfile.load(path)
    except Exception as e:  # numpy/zipfile raise many types on bad bytes; all mean "corrupt"
        _fail(str(path), "a readable activation profile (.npz)",
              f"{type(e).__name__}: {_short(str(e))}", directory)
    n_layers, d_ff = shape["n_layers"], shape["d_ff"]
    checks = [
        ("n_tokens", isinstance(p.n_tokens, int) and p.n_tokens > 0, "a positive count",
         p.n_tokens),
        ("activation", p.activation == shape["activation"], repr(shape["activation"]),
         p.activation),
        ("thresholds", _array_ok(p.thresholds, (n_layers,), float_ok=True),
         f"[{n_layers}] finite numbers >= 0", _describe(p.thresholds)),
        ("hist_contribution", _array_ok(p.hist_contribution, (n_layers, prof.N_BINS)),
         f"[{n_layers}, {prof.N_BINS}] counts >= 0", _describe(p.hist_contribution)),
        ("hist_gate", _array_ok(p.hist_gate, (n_layers, prof.N_BINS)),
         f"[{n_layers}, {prof.N_BINS}] counts >= 0", _describe(p.hist_gate)),
        ("counts", _array_ok(p.counts, (n_layers, d_ff), upper=p.n_tokens),
         f"[{n_layers}, {d_ff}] counts in [0, n_tokens]", _describe(p.counts)),
    ]
    for name, ok, rule, got in checks:
        if not ok:
            _fail(f"{path} array {name!r}", rule, _short(got), directory)
    return p


def read_predictor(path: Path, shape: dict) -> pred.PredictorStack:
    directory = path.parent
    if not path.is_dir():
        _fail(str(path), "the orbax predictor directory", "no such directory", directory)
    try:
        import orbax.checkpoint as ocp

        arrays = ocp.StandardCheckpointer().restore(path)
        stack = pred.PredictorStack.from_arrays(arrays)
    except Exception as e:  # orbax/tensorstore raise many types on bad files; all mean "corrupt"
        _fail(str(path), "restorable predictor weights", f"{type(e).__name__}: {_short(str(e))}",
              directory)
    n_layers, d, _, f = stack.shape
    want = (shape["n_layers"], shape["d_model"], shape["d_ff"])
    if (n_layers, d, f) != want:
        _fail(str(path), f"(layers, D, F) = {want} of the model", str((n_layers, d, f)), directory)
    if not all(np.isfinite(a).all() for a in stack.arrays().values()):
        _fail(str(path), "finite predictor weights", "NaN or inf values", directory)
    return stack


def load_or_build(directory: Path, load: Callable[[], object], build: Callable[[], None]):
    """`load()`; if the artifacts are missing or bad, `build()` them (a note says why) under the
    directory's lock and load again. A second process building the same target waits for the
    lock, then loads what the first built instead of building it again."""
    directory = Path(directory).resolve()
    try:
        return load()
    except ArtifactError:
        pass
    with cache.lock(directory, what=f"sparsity artifacts {directory}"):
        try:
            return load()  # built by another process while we waited
        except ArtifactError as e:
            if directory.exists():
                cache.note(f"the sparsity artifacts in {directory} cannot be used ({e.reason}); "
                           "rebuilding them now")
        build()
    return load()


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _array_ok(a, shape, *, float_ok=False, upper=None) -> bool:
    if not isinstance(a, np.ndarray) or a.shape != shape:
        return False
    if float_ok:
        return a.dtype.kind == "f" and bool(np.isfinite(a).all() and (a >= 0).all())
    if a.dtype.kind not in "iu" or (a < 0).any():
        return False
    return upper is None or not (a > upper).any()


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {list(a.shape)}"
    return type(a).__name__


def _short(v, limit: int = 120) -> str:
    s = v if isinstance(v, str) else repr(v)
    return s if len(s) <= limit else s[:limit] + "..."
