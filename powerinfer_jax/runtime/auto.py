"""`--sparsity auto`: a sparse mode only where it is measurably faster than dense on this machine.

Whether skipping neurons pays depends on the machine (AVX-512 or AVX2, bandwidth, threads), the
weight format and the model: on a small SwiGLU model the q4 estimate reads every gate/up row, so
the saving is a share of the down rows. `choose` decides in three steps, each only when the one
before leaves the question open:

1. Estimate (`estimate`): the bytes a decoded token reads in dense mode and in the sparse candidate
   (CANDIDATES: the oracle at the target on a quantized model, else predictor mode with the q4
   estimates as activations), from the built dense model's
   weights: every matrix once, the embedding table only when it is also the output matrix; the
   candidate reads its gate/up estimates (4-bit) and only the active share of the down rows. Their
   ratio bounds the candidate's speed-up on a bandwidth-bound decode; below MARGIN it cannot win,
   and nothing sparse is built.
2. Time: dense and the candidate decode in interleaved rounds (alternating order); each round gives
   one paired ratio, and rounds go on (MIN_ROUNDS..MAX_ROUNDS) until a 95% confidence interval of
   the ratio (Student's t on the log ratios) lies wholly above MARGIN ("win": the candidate) or
   wholly below it ("loss": dense), else the verdict is "tie" and dense is kept: it is the
   reference, holds no sparsity artifacts, and a tie is never recorded as a win. For the default
   model without artifacts the candidate is timed on thresholds calibrated on TRIAL_TOKENS tokens
   (seconds), so the full artifacts (minutes) are built only for a win.
3. Cache: the verdict with its measurements goes next to the model's sparsity artifacts, keyed by
   everything the timing depends on (model file, CPU and its flags, instruction set, threads, dtype,
   weights, kernels' build, version): another machine, build or thread count times again.
`Session.describe()["auto"]` says what was chosen and why.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from powerinfer_jax import cache
from powerinfer_jax._machine import cpu_features, machine_info
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.errors import UserError

STEPS = 24  # decode steps per timed generation (after a warm-up generation per candidate)
MIN_ROUNDS = 5  # interleaved rounds before a verdict may be given
MAX_ROUNDS = 12  # rounds after which an open interval is a tie
# the sparse candidate: on a model kept in its file's blocks the file's own 4-bit gate/up rows give
# every neuron's activation, so the candidate is the oracle at the target's calibrated thresholds
# (nothing predicted); on float weights the q4 predictor's estimates serve as the activations
CANDIDATES = ("dense", "oracle", "predictor_q4gu")
# The candidate must be at least this much faster than dense: within a few percent the two are a
# coin toss on a VM that drifts, and a sparse mode that is not clearly faster must not be chosen.
MARGIN = 1.03
TRIAL_TOKENS = 2048  # calibration tokens of the trial thresholds (the full artifacts: 32768)
Q4_BYTES_PER_WEIGHT = 18 / 32  # a 4-bit estimate row: Q4_0's 32 weights in 18 bytes
VERDICTS = ("win", "loss", "tie", "estimate", "unavailable")
# Student's t, 97.5th percentile, by degrees of freedom (a two-sided 95% interval)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}


def candidate(label: str, target: float):
    if label == "dense":
        return SparsityConfig()
    if label == "oracle":
        return SparsityConfig(mode="oracle", target_sparsity=target)
    return SparsityConfig(mode="predictor", predictor="q4", gate_up="q4", target_sparsity=target)


def cache_key(source: str, runtime, threads: int, target: float) -> dict:
    """What the timing depends on: the model file, machine, kernels' instruction set, threads,
    dtype, weight format and target."""
    from importlib import metadata

    try:
        version = metadata.version("powerinfer_jax")
    except metadata.PackageNotFoundError:  # run from a source tree
        version = "source"
    try:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        isa = _ffi.simd_name()
        st = os.stat(_ffi._pij_ext.__file__)
        build = f"{st.st_size}-{st.st_mtime_ns}"  # a rebuilt extension times afresh
    except (ImportError, OSError):
        isa, build = "none", "none"
    info = machine_info()
    return {"model": str(source), "cpu": info["cpu"], "cpu_flags": cpu_features(),
            "cpus": info["cpus"], "machine": platform.machine(), "isa": isa, "threads": threads,
            "dtype": runtime.dtype, "weights": runtime.weights, "kernels": runtime.kernels,
            "target": target, "version": version, "kernels_build": build}


# ---------------------------------------------------------------------------------- 1. estimate
def estimate(model, target: float) -> dict:
    """Bytes one decoded token reads, dense vs the candidate, and their ratio (`bound`): an upper
    bound of the candidate's speed-up where decode is bandwidth-bound (it ignores the candidate's
    extra arithmetic and that quantized down rows are stored in pairs)."""
    from flax import nnx

    c = model.config
    groups: dict[str, int] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        try:
            value = node[...]
        except (TypeError, IndexError):  # an empty variable
            continue
        names = [str(p) for p in path]
        if "ffn" in names:
            part = "down" if any(n.startswith("down") for n in names) else (
                "gate_up" if "gate" in names or "up" in names else "other")
        else:
            part = "embed" if names[:1] == ["tok_embed"] else "other"
        groups[part] = groups.get(part, 0) + int(getattr(value, "nbytes", 0))
    embed = groups.get("embed", 0) if c.tie_embeddings else 0  # else one row per token
    gate_up, down, other = groups.get("gate_up", 0), groups.get("down", 0), groups.get("other", 0)
    n_ffn = 2 if c.gated else 1
    estimate_rows = min(gate_up, int(c.n_layers * n_ffn * c.d_ff * c.d_model
                                     * Q4_BYTES_PER_WEIGHT))
    dense = embed + other + gate_up + down
    sparse = embed + other + estimate_rows + (1.0 - target) * down
    return {"dense_bytes": dense, "sparse_bytes": int(sparse), "bound": dense / sparse}


# ---------------------------------------------------------------------------------- 2. timing
def time_decode(session, prompt: list[int], steps: int = STEPS) -> float:
    """Decode tokens/s of one generation of `steps` tokens (compilation excluded)."""
    return session.engine.generate(prompt, max_new_tokens=steps).decode_tok_s


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(low, mid, high): the 95% confidence interval of the geometric mean of paired ratios."""
    logs = [math.log(r) for r in ratios]
    mid = statistics.fmean(logs)
    n = len(logs)
    if n < 2:
        return 0.0, math.exp(mid), math.inf
    half = _T975.get(n - 1, 1.96) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mid - half), math.exp(mid), math.exp(mid + half)


def verdict(ratios: list[float], margin: float = MARGIN) -> str:
    low, _, high = interval(ratios)
    return "win" if low >= margin else "loss" if high < margin else "tie"


def measure(sessions: dict, *, timer=None, progress: bool = False) -> dict:
    """Interleaved rounds of dense vs the candidate until the ratio's interval clears MARGIN
    either way (at least MIN_ROUNDS, at most MAX_ROUNDS). timer(session, prompt) -> tokens/s."""
    timer = timer or time_decode
    label = next(k for k in sessions if k != "dense")
    dense, sparse = sessions["dense"], sessions[label]
    prompt = dense.tokenizer.encode("The history of computing is a story of ideas that made "
                                    "machines faster, smaller and easier to program.",
                                    add_bos=False)
    for s in (dense, sparse):  # compile every bucket the timed runs need, and warm the caches
        timer(s, prompt)
    if progress:
        print(f"powerinfer_jax: --sparsity auto: timing dense and sparse decode on this machine "
              f"({MIN_ROUNDS}-{MAX_ROUNDS} interleaved rounds)", file=sys.stderr, flush=True)
    speeds: dict[str, list[float]] = {"dense": [], label: []}
    ratios: list[float] = []
    while len(ratios) < MAX_ROUNDS:
        order = [("dense", dense), (label, sparse)]
        for name, s in order if len(ratios) % 2 == 0 else order[::-1]:
            speeds[name].append(timer(s, prompt))
        ratios.append(speeds[label][-1] / speeds["dense"][-1])
        if len(ratios) >= MIN_ROUNDS and verdict(ratios) != "tie":
            break
    low, mid, high = interval(ratios)
    v = verdict(ratios)
    chosen = label if v == "win" else "dense"
    what = {"win": f"at least {MARGIN:.2f}x: the sparse mode chosen",
            "loss": f"below {MARGIN:.2f}x: dense chosen",
            "tie": f"the interval straddles {MARGIN:.2f}x (a tie): dense kept"}[v]
    why = (f"{label} at the target decodes at {mid:.3f}x dense here (95% interval {low:.3f}-"
           f"{high:.3f}x over {len(ratios)} interleaved rounds), {what}")
    return {"chosen": chosen, "verdict": v, "ratio": mid, "interval": [low, high],
            "rounds": len(ratios), "tok_s": {k: statistics.median(v) for k, v in speeds.items()},
            "tok_s_rounds": speeds, "why": why, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


# ---------------------------------------------------------------------------------- 3. decision
def choice_file(directory, key: dict) -> Path:
    """Where the decision for `key` is cached: one file per key, so builds that differ in ISA,
    threads or dtype (an AVX2 and an AVX-512 install sharing one cache) keep their own."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"auto_choice-{digest}.json"


def choose(build_one, *, key: dict, target: float, cache_dir, progress: bool = True,
           trial=None, timer=None, estimator=None, sparse: str = "predictor_q4gu"):
    """(session, report). build_one(SparsityConfig, artifacts_root=None) -> Session;
    trial(dense_session) -> an artifacts root with trial thresholds for the candidate, or None
    to time it on its real artifacts (a UserError: it cannot be built here); timer and
    estimator: `time_decode` and `estimate` (tests inject them). A decision cached for the same
    key is reused: only the chosen mode is built. sparse: the candidate's label (CANDIDATES)."""
    estimator = estimator or estimate
    cache_file = choice_file(cache_dir, key)
    cached = _read(cache_file)
    if cached and cached.get("key") == key:
        return build_one(candidate(cached["chosen"], target)), {**cached, "cached": True}
    base = {"key": key, "target": target, "cached": False}
    dense = build_one(candidate("dense", target))
    est = estimator(dense.model, target)
    base["estimate"] = est
    if est["bound"] < MARGIN:
        report = {**base, "chosen": "dense", "verdict": "estimate", "tok_s": {},
                  "why": f"{sparse} at the target would read "
                         f"{est['sparse_bytes'] / 1e6:.1f} MB per token against dense's {est['dense_bytes'] / 1e6:.1f} MB: at most "
                         f"{est['bound']:.3f}x, below {MARGIN:.2f}x, so it was not built"}
        _write(cache_file, report)
        return dense, report
    try:
        root = None if trial is None else trial(dense)
        built = build_one(candidate(sparse, target), artifacts_root=root)
    except UserError as e:  # no calibrated artifacts for a user's model: dense, and say why
        return dense, {**base, "chosen": "dense", "verdict": "unavailable", "tok_s": {},
                       "why": f"the sparse candidate could not be built: {e}"}
    report = {**base, **measure({"dense": dense, sparse: built}, timer=timer,
                                progress=progress), "trial": root is not None}
    if report["chosen"] == sparse and root is not None:
        built = build_one(candidate(sparse, target))  # its full artifacts, once
    _write(cache_file, report)
    return (built if report["chosen"] == sparse else dense), report


def _read(path):
    """The cached decision, or None (missing, unreadable or malformed: measured again)."""
    try:
        report = json.loads(open(path, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = (isinstance(report, dict) and report.get("chosen") in CANDIDATES
          and report.get("verdict") in VERDICTS and isinstance(report.get("tok_s"), dict))
    return report if ok else None


def _write(path, report: dict) -> None:
    try:
        cache.write_text(path, json.dumps(report, indent=1))
    except OSError as e:  # an unwritable cache only costs the next build a re-measure
        print(f"powerinfer_jax: could not cache the --sparsity auto decision in {path} ({e})",
              file=sys.stderr)


def describe(report: dict) -> dict:
    keys = ("chosen", "verdict", "why", "tok_s", "cached", "target", "ratio", "interval",
            "rounds", "estimate")
    return {k: report.get(k) for k in keys}
