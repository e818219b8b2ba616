"""Per-layer thresholds for a target FFN sparsity, from the profiled magnitude histograms (the
calibration step of `python -m powerinfer_jax.calibrate`, which builds every artifact).

Criteria (what a threshold is compared with):
  "contribution": |a_i| = |act(gate_i.x) * (up_i.x)|, the oracle mode's criterion. Skipping the
    smallest contributions is nearly free (about 3% perplexity at 50% on SmolLM2).
  "gate": |act(gate_i.x)|, the threshold (CATS-style) mode's criterion: the gate is computed densely,
    then up/down rows are skipped. Cheaper to decide, costlier in quality.
ReLU FFNs have a natural threshold: 0 (a neuron is active when its activation is non-zero).
"""
from __future__ import annotations

import math

import numpy as np

from powerinfer_jax.sparsity.profile import LOG10_RANGE, N_BINS, ActivationProfile

CRITERIA = ("contribution", "gate")


def check_target_sparsity(target) -> float:
    try:
        t = float(target)
    except (TypeError, ValueError):
        t = math.nan
    if not (0.0 < t < 1.0):
        raise ValueError(f"target sparsity: expected a float in (0, 1) (the fraction of FFN "
                         f"neurons to skip), got {target!r}")
    return t


def threshold_from_histogram(hist: np.ndarray, sparsity: float) -> float:
    """The magnitude t with a fraction `sparsity` of the histogrammed values <= t.

    Interpolates log-linearly inside the bin where the cumulative count crosses the target; a
    crossing inside bin 0 (values <= 1e-8, incl. exact zeros) gives 0.
    """
    total = hist.sum()
    if total == 0:
        raise ValueError("histogram: expected profiled activations, got an empty histogram")
    cum = np.cumsum(hist)
    want = sparsity * total
    b = int(np.searchsorted(cum, want, side="left"))
    if b == 0:
        return 0.0
    before = cum[b - 1]
    frac = (want - before) / max(hist[b], 1)
    lo, hi = LOG10_RANGE
    width = (hi - lo) / N_BINS
    return float(10.0 ** (lo + (b + frac) * width))


def calibrate_thresholds(profile: ActivationProfile, target_sparsity: float, *,
                         criterion: str = "contribution") -> tuple[float, ...]:
    """One threshold per layer such that a fraction target_sparsity of the profiled (token,
    neuron) pairs falls at or below it. ReLU: zeros (the natural sparsity, whatever the target)."""
    s = check_target_sparsity(target_sparsity)
    if criterion not in CRITERIA:
        raise ValueError(f"criterion: expected one of {list(CRITERIA)}, got {criterion!r}")
    hist = profile.hist_contribution if criterion == "contribution" else profile.hist_gate
    if profile.activation in ("relu", "drelu"):
        return tuple(0.0 for _ in range(hist.shape[0]))
    return tuple(threshold_from_histogram(h, s) for h in hist)
