"""Prescribed neuron firing frequencies for a synthetic sparse model: a capped power law.

Neuron k of a layer (k = 1 .. F in decreasing order) fires on a fraction
    p_k = min(cap, c * k ** -alpha)
of tokens, with c and alpha solved so that
  * the mean over neurons is 1 - sparsity (the layer's expected share of active neurons), and
  * the top `hot_fraction` of neurons hold `hot_share` of all activations ("80% of the
    activations in 25% of the neurons": PowerInfer's locality).
Each layer assigns the sorted frequencies to its neurons in a seeded random order, as in a real
model, where hot neurons are scattered over the FFN's rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from powerinfer_jax.errors import check, fail

DEFAULT_CAP = 0.99  # no neuron fires on every token (nor does any in a real model)


@dataclasses.dataclass(frozen=True)
class Locality:
    """What a layer's frequencies must satisfy (module docstring)."""

    sparsity: float  # 1 - mean firing frequency
    hot_fraction: float = 0.25
    hot_share: float = 0.80
    cap: float = DEFAULT_CAP

    def __post_init__(self):
        for name in ("sparsity", "hot_fraction", "hot_share", "cap"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and 0.0 < v < 1.0 or (name == "cap" and v == 1.0),
                  f"--{name.replace('_', '-')}", "a number in (0, 1)", v)
        mean = 1.0 - self.sparsity
        check(mean <= self.cap, "--sparsity", f">= 1 - cap = {1 - self.cap:.3g}", self.sparsity)
        most = min(1.0, self.cap * self.hot_fraction / mean)  # hot neurons all at the cap
        check(self.hot_share >= self.hot_fraction, "--hot-share",
              f">= --hot-fraction ({self.hot_fraction}: uniform frequencies)", self.hot_share)
        check(self.hot_share <= most, "--hot-share",
              f"at most {most:.3f} at sparsity {self.sparsity} (the hot neurons cannot fire more "
              f"than the cap {self.cap})", self.hot_share, "lower --hot-share")

    @classmethod
    def feasible(cls, sparsity: float, hot_fraction: float = 0.25, hot_share: float = 0.80,
                 cap: float = DEFAULT_CAP) -> "Locality":
        """`hot_share`, or 95% of the most the cap allows at this sparsity when it is lower (low
        sparsities cannot put 80% of their activations in 25% of the neurons)."""
        most = min(1.0, cap * hot_fraction / (1.0 - sparsity))
        return cls(sparsity, hot_fraction, min(hot_share, hot_fraction + 0.95 * (most -
                                                                                 hot_fraction)),
                   cap)


def _law(n: int, c: float, alpha: float, cap: float) -> np.ndarray:
    return np.minimum(cap, c * np.arange(1, n + 1, dtype=np.float64) ** -alpha)


def _scale_for_mean(n: int, alpha: float, mean: float, cap: float) -> float:
    lo, hi = 1e-12, 1e12  # mean(_law) rises with c
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        if _law(n, mid, alpha, cap).mean() < mean:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return hi


def hot_share(freq: np.ndarray, hot_fraction: float) -> float:
    """Share of all activations held by the most frequent `hot_fraction` of neurons."""
    s = np.sort(np.asarray(freq, np.float64).ravel())[::-1]
    k = max(1, int(round(hot_fraction * s.size)))
    total = s.sum()
    return float(s[:k].sum() / total) if total > 0 else 0.0


def power_law(n: int, locality: Locality) -> np.ndarray:
    """[n] frequencies in decreasing order meeting `locality` (mean and hot share to ~1e-6)."""
    if not (isinstance(n, int) and n >= 4):
        fail("power_law n", "an integer >= 4", n)
    mean = 1.0 - locality.sparsity
    lo, hi = 0.0, 8.0  # the hot share rises with alpha
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        freq = _law(n, _scale_for_mean(n, mid, mean, locality.cap), mid, locality.cap)
        if hot_share(freq, locality.hot_fraction) < locality.hot_share:
            lo = mid
        else:
            hi = mid
    alpha = 0.5 * (lo + hi)
    return _law(n, _scale_for_mean(n, alpha, mean, locality.cap), alpha, locality.cap)


def layer_frequencies(n_layers: int, d_ff: int, locality: Locality, seed: int) -> np.ndarray:
    """[L, F] prescribed frequencies: the power law in a seeded random neuron order per layer."""
    law = power_law(d_ff, locality)
    rng = np.random.default_rng([seed, 0x5A17])
    return np.stack([law[rng.permutation(d_ff)] for _ in range(n_layers)])


def decile_errors(prescribed: np.ndarray, measured: np.ndarray) -> list[dict]:
    """Per decile of neurons (sorted by prescribed frequency, all layers pooled): the mean
    prescribed and measured frequency and their relative difference."""
    p = np.asarray(prescribed, np.float64).ravel()
    m = np.asarray(measured, np.float64).ravel()
    if p.shape != m.shape:
        fail("decile_errors measured", f"shape {np.shape(prescribed)}", np.shape(measured))
    order = np.argsort(-p, kind="stable")
    out = []
    for d, idx in enumerate(np.array_split(order, 10)):
        want, got = float(p[idx].mean()), float(m[idx].mean())
        out.append({"decile": d + 1, "prescribed": want, "measured": got,
                    "relative_error": (got - want) / want if want > 0 else float(got != 0)})
    return out
