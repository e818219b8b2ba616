"""Activation profiling: which FFN neurons fire, how often, and how large their activations are.

Pipeline: `collect_ffn_inputs` runs the dense model over corpus chunks once and keeps every layer's
FFN input [L, N, D]; everything else is computed from those inputs layer by layer with the FFN alone
(cheap next to the whole model): magnitude histograms for calibration (`profile_activations`), exact
per-neuron activation counts at given thresholds, and the active masks predictors are trained on.

Two magnitudes are histogrammed per layer (log-spaced bins):
  contribution |a_i| = |act(gate_i.x) * (up_i.x)|  (the oracle criterion)
  gate         |act(gate_i.x)|                     (the CATS-style criterion; = contribution if not gated)
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.models.transformer import capture
from powerinfer_jax.ops.reference import activate, gated_activate
from powerinfer_jax.models.layers import matmul

# Histogram of log10|a| over [1e-8, 1e3]: float32 FFN activations of trained LLMs live well inside;
# smaller values (incl. exact zeros of ReLU) land in bin 0, larger ones in the last bin.
LOG10_RANGE = (-8.0, 3.0)
N_BINS = 2048  # 0.0054 decades (1.2%) per bin: thresholds interpolate inside one bin
BATCH_TOKENS = 512  # tokens per jitted FFN call: bounds the [N, F] intermediates
COVERAGE = 0.8  # the power-law summary: fraction of neurons covering 80% of activations


@dataclasses.dataclass
class ActivationProfile:
    """Per-layer statistics over n_tokens tokens.

    hist_contribution / hist_gate [L, N_BINS]: counts of log10 |a| (resp. |act(gate)|) per bin.
    counts [L, F]: tokens for which neuron i was active (|a_i| > thresholds[l]).
    """

    n_tokens: int
    activation: str
    thresholds: np.ndarray  # [L]
    hist_contribution: np.ndarray  # [L, N_BINS] int64
    hist_gate: np.ndarray  # [L, N_BINS] int64
    counts: np.ndarray  # [L, F] int64

    @property
    def frequency(self) -> np.ndarray:
        """[L, F] activation frequency of each neuron."""
        return self.counts / max(self.n_tokens, 1)

    @property
    def sparsity(self) -> np.ndarray:
        """[L] fraction of (token, neuron) pairs inactive at the profiled thresholds."""
        return 1.0 - self.frequency.mean(axis=1)

    def power_law(self, coverage: float = COVERAGE) -> np.ndarray:
        """[L] smallest fraction of neurons (the most frequent first) covering `coverage` of all
        activations of the layer."""
        srt = -np.sort(-self.counts, axis=1)
        cum = np.cumsum(srt, axis=1)
        total = np.maximum(cum[:, -1:], 1)
        return ((cum / total < coverage).sum(axis=1) + 1) / self.counts.shape[1]

    def summary(self) -> dict:
        return {"n_tokens": int(self.n_tokens), "activation": self.activation,
                "sparsity": self.sparsity.round(4).tolist(),
                f"neurons_for_{int(COVERAGE * 100)}pct": self.power_law().round(4).tolist()}

    def save(self, path: Path) -> None:
        np.savez_compressed(path, n_tokens=self.n_tokens, activation=self.activation,
                            thresholds=self.thresholds, hist_contribution=self.hist_contribution,
                            hist_gate=self.hist_gate, counts=self.counts)

    @classmethod
    def load(cls, path: Path) -> "ActivationProfile":
        with np.load(path) as z:
            return cls(n_tokens=int(z["n_tokens"]), activation=str(z["activation"]),
                       thresholds=z["thresholds"], hist_contribution=z["hist_contribution"],
                       hist_gate=z["hist_gate"], counts=z["counts"])


def collect_ffn_inputs(model, chunks_nt: np.ndarray, *, progress: bool = True) -> np.ndarray:
    """Run the dense model over [n, T] token chunks; returns every layer's FFN input [L, n*T, D]."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens_bt):
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        _, sown = capture(lambda m: m.hidden(tokens_bt, positions), nnx.merge(graphdef, state))
        return sown["ffn_in"][:, 0]  # [L, T, D]

    out = []
    for chunk in _bar(chunks_nt, progress, "profile: dense forward", "chunk"):
        out.append(np.asarray(run(state, jnp.asarray(chunk[None]))))
    return np.concatenate(out, axis=1)


def ffn_magnitudes(ffn, x_nd):
    """(|a| [N, F], |act(gate)| [N, F]) in float32, computed densely."""
    up = ffn.up(x_nd)
    if ffn.gate is None:
        a = jnp.abs(activate(ffn.activation, up))
        return a, a
    g_pre = ffn.gate(x_nd) if ffn.quantized else matmul(x_nd, ffn.gate.weight[...])
    return (jnp.abs(gated_activate(ffn.activation, g_pre, up)),
            jnp.abs(activate(ffn.activation, g_pre)))


def _log_bins(v):
    lo, hi = LOG10_RANGE
    idx = jnp.floor((jnp.log10(jnp.maximum(v, 1e-30)) - lo) / (hi - lo) * N_BINS)
    return jnp.clip(idx, 0, N_BINS - 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _layer_stats(graphdef, state, x_nd, n_valid, threshold):
    ffn = nnx.merge(graphdef, state)
    contrib, gate = ffn_magnitudes(ffn, x_nd)
    valid = (jnp.arange(x_nd.shape[0]) < n_valid)[:, None]
    w = jnp.broadcast_to(valid, contrib.shape).astype(jnp.int32).ravel()
    hc = jnp.bincount(_log_bins(contrib).ravel(), weights=w, length=N_BINS)
    hg = jnp.bincount(_log_bins(gate).ravel(), weights=w, length=N_BINS)
    counts = jnp.sum((contrib > threshold) & valid, axis=0, dtype=jnp.int32)
    return hc, hg, counts


@functools.partial(jax.jit, static_argnums=0)
def _layer_mask(graphdef, state, x_nd, threshold, gate_threshold):
    contrib, gate = ffn_magnitudes(nnx.merge(graphdef, state), x_nd)
    return (contrib > threshold) & (gate > gate_threshold)


def _batches(n: int):
    """(start, stop) of fixed-size batches; the last one is padded by the caller (one compile)."""
    return [(s, min(s + BATCH_TOKENS, n)) for s in range(0, n, BATCH_TOKENS)]


def _padded(x_nd: np.ndarray, start: int, stop: int) -> np.ndarray:
    batch = x_nd[start:stop]
    if stop - start == BATCH_TOKENS:
        return batch
    pad = np.zeros((BATCH_TOKENS - (stop - start), x_nd.shape[1]), x_nd.dtype)
    return np.concatenate([batch, pad])


def profile_activations(model, x_lnd: np.ndarray, thresholds=None, *,
                        progress: bool = True) -> ActivationProfile:
    """Histograms of |a| and |act(gate)| per layer, and per-neuron counts of |a_i| > thresholds[l]
    (default 0: a_i != 0) over the FFN inputs x_lnd [L, N, D]."""
    n_layers, n, _ = x_lnd.shape
    thr = np.zeros(n_layers) if thresholds is None else np.asarray(thresholds, np.float64)
    if thr.shape != (n_layers,):
        raise ValueError(f"thresholds: expected one per layer ({n_layers}), got {thr.shape}")
    f = model.config.d_ff
    hc = np.zeros((n_layers, N_BINS), np.int64)
    hg = np.zeros((n_layers, N_BINS), np.int64)
    counts = np.zeros((n_layers, f), np.int64)
    for l in _bar(range(n_layers), progress, "profile: activation statistics", "layer"):
        graphdef, state = nnx.split(model.layers[l].ffn)
        for start, stop in _batches(n):
            a, b, c = _layer_stats(graphdef, state, _padded(x_lnd[l], start, stop),
                                   stop - start, np.float32(thr[l]))
            hc[l] += np.asarray(a, np.int64)
            hg[l] += np.asarray(b, np.int64)
            counts[l] += np.asarray(c, np.int64)
    return ActivationProfile(n_tokens=n, activation=model.config.activation, thresholds=thr,
                             hist_contribution=hc, hist_gate=hg, counts=counts)


def active_masks(model, x_lnd: np.ndarray, thresholds, *, progress: bool = True,
                 gate_thresholds=None) -> np.ndarray:
    """The oracle active set [L, N, F] (bool): |a_i| > thresholds[l] for each FFN input, and where
    gate_thresholds are given also |act(gate_i . x)| > gate_thresholds[l] (a FATReLU model: its
    neurons are off wherever relu(gate) is at or under the layer's threshold)."""
    n_layers, n, _ = x_lnd.shape
    gate_thr = np.zeros(n_layers) if gate_thresholds is None else np.asarray(gate_thresholds,
                                                                             np.float64)
    if gate_thr.shape != (n_layers,):
        raise ValueError(f"gate_thresholds: expected one per layer ({n_layers}), got "
                         f"{gate_thr.shape}")
    out = np.zeros((n_layers, n, model.config.d_ff), bool)
    for l in _bar(range(n_layers), progress, "profile: active masks", "layer"):
        graphdef, state = nnx.split(model.layers[l].ffn)
        for start, stop in _batches(n):
            m = _layer_mask(graphdef, state, _padded(x_lnd[l], start, stop),
                            np.float32(thresholds[l]), np.float32(gate_thr[l]))
            out[l, start:stop] = np.asarray(m)[: stop - start]
    return out


def plot_frequency(profile: ActivationProfile, path: Path, *, title: str = "") -> None:
    """PNG: each layer's neuron activation frequencies, sorted in decreasing order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    freq = -np.sort(-profile.frequency, axis=1)
    n_layers, f = freq.shape
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("viridis")
    x = np.arange(1, f + 1) / f
    for l in range(n_layers):
        ax.plot(x, freq[l], color=cmap(l / max(n_layers - 1, 1)), lw=0.9)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, n_layers - 1))
    fig.colorbar(sm, ax=ax, label="layer")
    ax.set_xlabel("neuron rank / F (most frequent first)")
    ax.set_ylabel("activation frequency (fraction of tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(title or f"Sorted activation frequency per layer ({profile.n_tokens} tokens)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bar(it, progress: bool, desc: str, unit: str):
    if not progress:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, unit=unit)
