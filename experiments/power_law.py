"""Hypothesis: FFN neuron activity follows a power law: per layer, a small fraction of the neurons
(the hot ones) covers 80% of all activations, which is what makes hot/cold placement pay off.

Reads the activation profile stored with the model's sparsity artifacts (built once, with a
progress bar, for a registry model; see powerinfer_jax.calibrate): per layer and neuron, how many
profiled tokens activated it (SwiGLU: |a_i| above the layer's calibrated threshold for the target
sparsity; ReLU: a_i != 0). One JSONL row per (target, layer): sparsity, fraction of neurons
covering 80% of activations, and the sorted frequency curve sampled at fixed ranks (for the plot).

  python -m experiments.power_law [--targets 0.5] [--out results/power_law.jsonl]
"""
from __future__ import annotations

import argparse

import numpy as np

from experiments import _common

CURVE_POINTS = 101  # sorted-frequency samples per layer kept in the row (ranks 0%, 1%, ..., 100%)
COVERAGE = 0.8


def layer_rows(counts_lf: np.ndarray, n_tokens: int) -> list[dict]:
    """Per-layer power-law statistics from exact activation counts [L, F]."""
    if counts_lf.ndim != 2 or n_tokens < 1:
        raise ValueError(f"activation counts: expected [L, F] counts over >= 1 tokens, got shape "
                         f"{counts_lf.shape} over {n_tokens} tokens")
    srt = -np.sort(-counts_lf, axis=1).astype(np.float64)  # most frequent first
    f = srt.shape[1]
    cum = np.cumsum(srt, axis=1)
    total = np.maximum(cum[:, -1:], 1.0)
    covering = ((cum / total < COVERAGE).sum(axis=1) + 1) / f
    ranks = np.minimum(np.round(np.linspace(0, f - 1, CURVE_POINTS)).astype(int), f - 1)
    freq = srt / n_tokens
    return [{"layer": l, "d_ff": f, "n_tokens": int(n_tokens),
             "sparsity": float(1.0 - freq[l].mean()),
             "neurons_for_80pct": float(covering[l]),
             "top10pct_share": float(cum[l, max(f // 10 - 1, 0)] / total[l, 0]),
             "curve_rank_fraction": (ranks / max(f - 1, 1)).round(4).tolist(),
             "curve_frequency": freq[l, ranks].round(5).tolist()}
            for l in range(srt.shape[0])]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--targets", type=float, nargs="+", default=[0.5],
                   help="target sparsities whose calibrated thresholds define 'active' (SwiGLU)")
    p.add_argument("--out", default=str(_common.RESULTS / "power_law.jsonl"))
    args = p.parse_args(argv)

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.sparsity import artifacts as A
    from powerinfer_jax.sparsity.profile import ActivationProfile

    ckpt = load_checkpoint(args.model)
    rows = []
    for target in args.targets:
        # the threshold mode's build makes (once) the profile this reads
        build(args.model, RuntimeConfig(kernels="xla"), SparsityConfig(
            "threshold", target_sparsity=float(target)), checkpoint=ckpt, progress=False)
        directory = A.target_dir(A.artifacts_root(args.model, ckpt.source), float(target))
        prof = ActivationProfile.load(directory / "profile.npz")
        criterion = ("a_i != 0 and relu(gate_i . x) above the layer's FATReLU threshold (the "
                     "model's trained thresholds, ModelConfig.fatrelu_thresholds)"
                     if ckpt.config.fatrelu_thresholds
                     else "|a_i| > calibrated per-layer threshold")
        head = _common.header("power_law", threads=None, dtype="float32", model=args.model,
                              config={"target_sparsity": float(target),
                                      "activation": prof.activation, "criterion": criterion,
                                      "profile_tokens": int(prof.n_tokens)},
                              quick=args.quick)
        for r in layer_rows(prof.counts, prof.n_tokens):
            rows.append({**head, **r, "threshold": float(prof.thresholds[r["layer"]])})
        cover = [r["neurons_for_80pct"] for r in rows if r["config"]["target_sparsity"] == target]
        print(f"target {target}: neurons covering 80% of activations: median "
              f"{np.median(cover):.3f} (layers {min(cover):.3f}..{max(cover):.3f})")
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
