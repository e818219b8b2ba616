"""`--sparsity auto`: a sparse mode only where it is faster than dense on this machine.

Whether skipping neurons pays depends on the machine (AVX-512 or AVX2, bandwidth, threads), the
weight format and the model: on a small SwiGLU model the q4 estimate reads every gate/up row, so
the saving is a share of the down rows. `choose` builds the candidates (dense and predictor mode
with the q4 estimate as activations at the target), times their decode steps interleaved in
rounds on this machine, and keeps the faster; the decision and its measurements are cached next
to the model's sparsity artifacts, keyed by everything the timing depends on, so the next build
reuses it. `Session.describe()["auto"]` says what was chosen and why.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

ROUNDS = 3  # interleaved timing rounds per candidate
STEPS = 24  # decode steps per round (after a compiled warm-up)
CANDIDATES = ("dense", "predictor_q4gu")
# The sparse mode must beat dense by this much: within a few percent the two are a coin toss on a
# VM that drifts, and a sparse mode that is not clearly faster must not be chosen.
MARGIN = 1.03


def candidate(label: str, target: float):
    from powerinfer_jax.config import SparsityConfig

    if label == "dense":
        return SparsityConfig()
    return SparsityConfig(mode="predictor", predictor="q4", gate_up="q4", target_sparsity=target)


def cache_key(source: str, runtime, threads: int, target: float) -> dict:
    """What the timing depends on: the model file, machine, kernels' instruction set, threads,
    dtype, weight format and target."""
    from importlib import metadata

    from powerinfer_jax._machine import machine_info

    try:
        version = metadata.version("powerinfer_jax")
    except metadata.PackageNotFoundError:  # run from a source tree
        version = "source"
    try:
        from powerinfer_jax.ops import _ffi

        isa = _ffi.simd_name()
        st = os.stat(_ffi._pij_ext.__file__)
        build = f"{st.st_size}-{st.st_mtime_ns}"  # a rebuilt extension times afresh
    except (ImportError, OSError):
        isa, build = "none", "none"
    return {"model": str(source), "cpu": machine_info()["cpu"],
            "machine": platform.machine(), "isa": isa, "threads": threads,
            "dtype": runtime.dtype, "weights": runtime.weights, "kernels": runtime.kernels,
            "target": target, "version": version, "kernels_build": build}


def time_decode(session, prompt: list[int], steps: int) -> float:
    """Decode tokens/s of one generation of `steps` tokens (compile excluded)."""
    res = session.engine.generate(prompt, max_new_tokens=steps)
    return res.decode_tok_s


def choice_file(directory, key: dict):
    """Where the decision for `key` is cached: one file per key, so builds that differ in ISA,
    threads or dtype (an AVX2 and an AVX-512 install sharing one cache) keep their own."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"auto_choice-{digest}.json"


def choose(build_one, *, key: dict, target: float, cache_dir, progress: bool = True):
    """(session, report): build_one(SparsityConfig) -> Session. A decision cached in `cache_dir`
    for the same key is reused (only the chosen mode is built); else every candidate is built
    and timed, and the faster one kept."""
    from powerinfer_jax.errors import UserError

    cache_file = choice_file(cache_dir, key)
    cached = _read(cache_file)
    if cached and cached.get("key") == key:
        return build_one(candidate(cached["chosen"], target)), {**cached, "cached": True}
    sessions = {"dense": build_one(candidate("dense", target))}
    try:
        sessions["predictor_q4gu"] = build_one(candidate("predictor_q4gu", target))
    except UserError as e:  # no calibrated artifacts for a user's model: dense, and say why
        return sessions["dense"], {"key": key, "target": target, "chosen": "dense",
                                   "tok_s": {}, "cached": False,
                                   "why": f"the sparse candidate could not be built: {e}"}
    report = {"key": key, "target": target, **measure(sessions, progress=progress),
              "cached": False}
    _write(cache_file, report)
    return sessions[report["chosen"]], report


def measure(sessions: dict, *, progress: bool) -> dict:
    tok = next(iter(sessions.values())).tokenizer
    prompt = tok.encode("The history of computing is a story of ideas that made machines "
                        "faster, smaller and easier to program.", add_bos=False)
    for s in sessions.values():  # compile every bucket the timed runs need
        s.engine.generate(prompt, max_new_tokens=STEPS)
    if progress:
        print("powerinfer_jax: --sparsity auto: timing dense and sparse decode on this machine "
              f"({ROUNDS} rounds)", file=sys.stderr)
    speeds = {label: [] for label in sessions}
    for _ in range(ROUNDS):  # interleaved: this machine's speed drifts between runs
        for label, s in sessions.items():
            speeds[label].append(time_decode(s, prompt, STEPS))
    medians = {label: statistics.median(v) for label, v in speeds.items()}
    ratio = medians["predictor_q4gu"] / medians["dense"]
    chosen = "predictor_q4gu" if ratio >= MARGIN else "dense"
    why = (f"predictor_q4gu decodes at {ratio:.2f}x dense here" + (
        "" if chosen != "dense" else
        f": not at least {MARGIN:.2f}x (this machine's run-to-run noise), dense chosen"))
    return {"chosen": chosen, "tok_s": medians, "tok_s_rounds": speeds, "why": why,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _read(path):
    """The cached decision, or None (missing, unreadable or malformed: measured again)."""
    try:
        report = json.loads(open(path, encoding="utf-8").read())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(report, dict) and report.get("chosen") in CANDIDATES and isinstance(
        report.get("tok_s"), dict)
    return report if ok else None


def _write(path, report: dict) -> None:
    from powerinfer_jax import cache

    try:
        cache.write_text(path, json.dumps(report, indent=1))
    except OSError as e:  # an unwritable cache only costs the next build a re-measure
        print(f"powerinfer_jax: could not cache the --sparsity auto decision in {path} ({e})",
              file=sys.stderr)


def describe(report: dict) -> dict:
    return {k: report[k] for k in ("chosen", "why", "tok_s", "cached", "target")}

