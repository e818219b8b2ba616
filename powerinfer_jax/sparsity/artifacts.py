"""Sparsity artifacts on disk: build, save, validate, load, and attach to a model.

Layout, under the model's directory (`artifacts_root`), one folder per target sparsity:
  sparsity/target_0.50/meta.json       fingerprint, model shape, thresholds, predictor report
                      /profile.npz     ActivationProfile (histograms, per-neuron counts)
                      /frequency.png   sorted activation frequency per layer
                      /predictor/      PredictorStack weights (orbax)
                      /record.json     size and hashes of every file (powerinfer_jax.cache)
The fingerprint ties artifacts to the exact model file; a different or changed model, a shape
mismatch, or a missing, truncated or corrupt file is an ArtifactError (a UserError) that names
the file and says how to rebuild; for a registry model they are rebuilt on their own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, cache_dir
from powerinfer_jax.errors import UserError
from powerinfer_jax.sparsity import artifact_files as files
from powerinfer_jax.sparsity import corpus as corpus_mod
from powerinfer_jax.sparsity import predictor as pred
from powerinfer_jax.sparsity import nibble_predictor as q4p
from powerinfer_jax.sparsity import profile as prof
from powerinfer_jax.sparsity import thresholds

FORMAT_VERSION = 2  # 2: q4 predictor thresholds
HASH_WINDOW = 4 << 20  # bytes hashed at each end of a weight file (header + tail) for the fingerprint
DEFAULT_CTX = 512
DEFAULT_MAX_TOKENS = 32768  # profiled tokens; FFN inputs are kept in memory: L * N * D * 4 bytes


def model_fingerprint(model_arg: str, source: str | Path, config) -> dict:
    """Identity of a model: registry sha256, or size + sha256 of both ends of each weight file,
    plus the FFN shape the artifacts depend on."""
    if str(model_arg) in KNOWN_MODELS:
        ident = f"registry:{model_arg}:{KNOWN_MODELS[str(model_arg)].sha256}"
    else:
        path = Path(source)
        files = [path] if path.is_file() else sorted(
            p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(HASH_WINDOW))
                fh.seek(max(0, f.stat().st_size - HASH_WINDOW))
                h.update(fh.read(HASH_WINDOW))
        ident = f"files:{h.hexdigest()}"
    return {"id": ident, "shape": model_shape(config)}


def model_shape(config) -> dict:
    return {"n_layers": config.n_layers, "d_model": config.d_model, "d_ff": config.d_ff,
            "activation": config.activation, "gated": config.gated}


def artifacts_root(model_arg: str, source: str | Path) -> Path:
    """<cache>/models/<name>/sparsity for a registry name, <dir>/sparsity for an HF directory,
    <file dir>/<stem>.sparsity for a GGUF file."""
    if str(model_arg) in KNOWN_MODELS:
        return cache_dir() / "models" / str(model_arg) / "sparsity"
    path = Path(source)
    return path / "sparsity" if path.is_dir() else path.with_name(path.stem + ".sparsity")


def target_label(target_sparsity: float) -> str:
    """A target sparsity as directory names spell it: two decimals (0.50, 0.85), and every digit
    where it has more (0.865), so that 0.865 and 0.86 never share a directory."""
    t = float(target_sparsity)
    return f"{t:.2f}" if round(t, 2) == t else f"{t:g}"


def target_dir(root: Path, target_sparsity: float) -> Path:
    return Path(root) / f"target_{target_label(thresholds.check_target_sparsity(target_sparsity))}"


@dataclasses.dataclass
class SparsityArtifacts:
    target_sparsity: float
    thresholds_contribution: tuple[float, ...]  # oracle mode
    thresholds_gate: tuple[float, ...]  # threshold mode
    thresholds_q4: tuple[float, ...]  # predictor mode, q4 predictor
    predictors: pred.PredictorStack | None  # the low-rank predictors, if trained
    meta: dict

    def thresholds_for(self, mode: str, predictor: str = "q4") -> tuple[float, ...]:
        """The per-layer thresholds the sparse FFN call uses in `mode` (and predictor kind)."""
        if mode == "oracle":
            return self.thresholds_contribution
        if mode == "threshold":
            return self.thresholds_gate
        if mode == "predictor" and predictor == "q4":
            return self.thresholds_q4
        if mode == "predictor":  # low-rank: decision thresholds are folded into the biases
            return tuple(0.0 for _ in self.thresholds_gate)
        raise ValueError(f"sparsity mode: expected oracle, threshold or predictor, got {mode!r}")


def build_for_target(model, x_lnd: np.ndarray, base: prof.ActivationProfile, target: float, *,
                     train: pred.TrainConfig | None = pred.TrainConfig(), progress: bool = True,
                     gate_active=None) -> tuple[SparsityArtifacts, prof.ActivationProfile]:
    """Calibrate thresholds from `base` histograms and train predictors on x_lnd's active masks.
    gate_active: a FATReLU model's per-layer gate thresholds (sparsify's fatrelu variant): its
    neurons are active only where relu(gate) is above them, so the profile's counts, the q4
    predictor's report and the low-rank predictors' targets are that set, not ReLU's zeros, and
    they are threshold mode's gate thresholds."""
    thr_c = thresholds.calibrate_thresholds(base, target, criterion="contribution")
    thr_g = (thresholds.calibrate_thresholds(base, target, criterion="gate") if gate_active is None
             else tuple(float(t) for t in gate_active))  # FATReLU: the trained thresholds
    masks = prof.active_masks(model, x_lnd, thr_c, progress=progress, gate_thresholds=gate_active)
    profile = dataclasses.replace(base, thresholds=np.asarray(thr_c),
                                  counts=masks.sum(axis=1, dtype=np.int64))
    stack, report = (None, {}) if train is None else pred.train_predictors(
        x_lnd, masks, train, progress=progress)
    c = model.config
    if train is not None:
        report["cost"] = pred.predictor_cost(d_model=c.d_model, d_ff=c.d_ff, rank=train.rank,
                                             gated=c.gated)
    thr_q4, q4_report = calibrate_q4(model, x_lnd, masks, target, progress=progress)
    meta = {"target_sparsity": target, "thresholds_contribution": list(thr_c),
            "thresholds_gate": list(thr_g), "thresholds_q4": list(thr_q4), "predictor": report,
            "q4": q4_report, "profile": profile.summary()}
    if gate_active is not None:
        meta["fatrelu_threshold"] = list(thr_g)
    return SparsityArtifacts(target, thr_c, thr_g, thr_q4, stack, meta), profile


Q4_CALIBRATION_TOKENS = 8192  # quantiles of L x 8192 x F scores are stable to well under a point
Q4_HOLDOUT_FRACTION = 0.1


def calibrate_q4(model, x_lnd: np.ndarray, masks: np.ndarray, target: float, *,
                 progress: bool = False) -> tuple[tuple[float, ...], dict]:
    """Per-layer q4 thresholds for `target` on the first tokens, recall/precision/sparsity vs the
    oracle masks on the held-out last tokens (as the low-rank predictors are reported)."""
    n = x_lnd.shape[1]
    n_hold = max(1, int(round(n * Q4_HOLDOUT_FRACTION)))
    n_cal = min(n - n_hold, Q4_CALIBRATION_TOKENS)
    if n_cal < 1:
        raise ValueError(f"q4 calibration tokens: expected at least 2 profiled tokens, got {n}")
    thr = q4p.calibrate_thresholds(q4p.layer_scores(
        model, x_lnd[:, :n_cal], progress=progress, desc="q4 predictor: thresholds"), target)
    report = q4p.quality(q4p.layer_scores(model, x_lnd[:, n - n_hold:], progress=progress,
                                          desc="q4 predictor: held-out recall"), thr,
                         masks[:, n - n_hold:])
    c = model.config
    report.update(calibration_tokens=n_cal, holdout_tokens=n_hold,
                  cost=q4p.cost(d_model=c.d_model, d_ff=c.d_ff, gated=c.gated))
    return tuple(float(t) for t in thr), report


def build_artifacts(model, tokenizer, *, fingerprint: dict, root: Path, target_sparsity: float,
                    corpus_files=None, ctx: int = DEFAULT_CTX, max_tokens: int = DEFAULT_MAX_TOKENS,
                    train: pred.TrainConfig | None = pred.TrainConfig(), progress: bool = True
                    ) -> SparsityArtifacts:
    """Profile the model on the corpus, calibrate, train predictors and save into root/target_*.
    A FATReLU model (ModelConfig.fatrelu_thresholds, from sparsify's fatrelu variant): the
    artifacts describe FATReLU's active set, and threshold mode's thresholds are its own."""
    target = thresholds.check_target_sparsity(target_sparsity)
    files = corpus_mod.default_corpus_files() if corpus_files is None else list(corpus_files)
    ids = tokenizer.encode(corpus_mod.read_corpus(files), add_bos=False)
    chunks = corpus_mod.corpus_chunks(ids, min(ctx, model.config.max_seq_len), max_tokens)
    x_lnd = prof.collect_ffn_inputs(model, chunks, progress=progress)
    base = prof.profile_activations(model, x_lnd, progress=progress)
    arts, profile = build_for_target(model, x_lnd, base, target, train=train, progress=progress,
                                     gate_active=model.config.fatrelu_thresholds or None)
    arts.meta.update(corpus=[str(f) for f in files], tokens=int(chunks.size), ctx=int(chunks.shape[1]))
    save_artifacts(target_dir(root, target), arts, profile, fingerprint)
    return arts


def save_artifacts(directory: Path, arts: SparsityArtifacts, profile: prof.ActivationProfile,
                   fingerprint: dict) -> None:
    """Write the artifacts into `directory`: built beside it and renamed into place under its lock
    (sparsity/artifact_files.py), so a reader never sees them half written."""
    meta = {"format_version": FORMAT_VERSION, "fingerprint": fingerprint, **arts.meta,
            "has_predictor": arts.predictors is not None}
    files.write_dir(directory, meta, profile, arts.predictors)


def load_artifacts(directory: Path, *, fingerprint: dict, need_predictor: bool
                   ) -> SparsityArtifacts:
    """Read and validate artifacts: every file unchanged since it was written, same model
    (fingerprint), same shapes, format, every key, profile and predictor. Anything missing or
    wrong is an ArtifactError (a UserError) naming the file and the fix."""
    meta, stack = files.read_dir(directory, fingerprint=fingerprint,
                                 format_version=FORMAT_VERSION, need_predictor=need_predictor)
    return SparsityArtifacts(float(meta["target_sparsity"]),
                             tuple(meta["thresholds_contribution"]), tuple(meta["thresholds_gate"]),
                             tuple(meta["thresholds_q4"]), stack, meta)


def check_predictor_shape(stack: pred.PredictorStack, shape: dict) -> None:
    n_layers, d, _, f = stack.shape
    want = (shape["n_layers"], shape["d_model"], shape["d_ff"])
    if (n_layers, d, f) != want:
        raise ValueError(f"predictors: expected (layers, D, F) = {want} of the model, got "
                         f"{(n_layers, d, f)} (predictor files from another model)")


def ensure_artifacts(model_arg: str, source, model, tokenizer, target_sparsity: float, *,
                     need_predictor: bool, root: Path | None = None, progress: bool = True
                     ) -> SparsityArtifacts:
    """Load the artifacts for (model, target); for a registry model build on first use exactly
    what is needed: thresholds and the profile, and the low-rank predictors only when
    `need_predictor` (training them takes minutes and only --predictor lowrank uses them)."""
    fp = model_fingerprint(model_arg, source, model.config)
    root = artifacts_root(model_arg, source) if root is None else Path(root)
    directory = target_dir(root, target_sparsity)
    if str(model_arg) not in KNOWN_MODELS:  # a user's model: errors name the file and the fix
        meta = directory / "meta.json"
        if not meta.is_file():
            raise UserError(
                f"sparsity artifacts: expected {directory}, got none; build them with "
                f"python -m powerinfer_jax.calibrate --model {model_arg} --target-sparsity "
                f"{target_sparsity}" + _calibrate_flags(need_predictor, root, model_arg, source))
        return load_artifacts(directory, fingerprint=fp, need_predictor=need_predictor)

    def build() -> None:  # a registry model: built on first use, rebuilt when bad or stale
        what = "sparsity artifacts" + (" with low-rank predictors" if need_predictor else "")
        print(f"powerinfer_jax: building {what} for {model_arg} at target sparsity "
              f"{target_sparsity} (once; cached in {directory}; about "
              f"{'8' if need_predictor else '2'} minutes on 2 cores)", file=sys.stderr)
        build_artifacts(model, tokenizer, fingerprint=fp, root=root,
                        target_sparsity=target_sparsity,
                        train=pred.TrainConfig() if need_predictor else None, progress=progress)

    # Missing, bad, stale, or without the predictors this run needs: (re)built under the lock.
    return files.load_or_build(directory, lambda: load_artifacts(
        directory, fingerprint=fp, need_predictor=need_predictor), build)


def _calibrate_flags(need_predictor: bool, root: Path, model_arg: str, source) -> str:
    return ((" --sparsity predictor --predictor lowrank" if need_predictor else "")
            + (f" --out {root}" if root != artifacts_root(model_arg, source) else ""))
