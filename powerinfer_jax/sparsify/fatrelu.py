"""FATReLU (ProSparse's activation threshold shifting): the ReLU gate kept only where g > t.

`calibrate_threshold` picks t for a trained relu/drelu student: the largest value on a fixed
geometric grid whose KL to the teacher on training text stays within (1 + kl_rise) of the KL at
t = 0 (ProSparse used one small fixed threshold per model; a KL budget chooses it for this model).

How the runtime applies it: the export stores t in config.json ("fatrelu_threshold", beside
hidden_act "relu"; one per layer for per-layer thresholds), the loader reads it into
ModelConfig.fatrelu_thresholds, and every FFN path computes relu(g_i) only where g_i > t (the
kernels' FloorGate, ops.reference.floor_gate): dense, oracle, threshold and predictor modes all
run the FATReLU model (a predictor's selected neurons under the threshold contribute 0). The
thresholds are also every layer's gate threshold in the model's sparsity artifacts, so
`--sparsity threshold --target-sparsity T` skips exactly FATReLU's zeros with the gate computed
densely.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax.sparsify import forward as fw

# t candidates: 0 and 24 geometric steps from 1e-3 to 0.5 (SmolLM2's gate pre-activations are
# O(0.1-1); ProSparse's LLaMA-2 threshold was 0.01)
GRID = (0.0,) + tuple(float(v) for v in np.geomspace(1e-3, 0.5, 24).round(6))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _teacher_logits(t_graphdef, t_state, t_spec, tokens_bt):
    return fw.forward(nnx.merge(t_graphdef, t_state), tokens_bt, t_spec)[0]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _kl_and_sparsity(s_graphdef, s_state, spec, tokens_bt, t_logits, gate_threshold):
    s_logits, aux = fw.forward(nnx.merge(s_graphdef, s_state), tokens_bt, spec,
                               gate_threshold=gate_threshold)
    return fw.kl_divergence(t_logits, s_logits), jnp.mean(aux["zero_frac"])


def kl_curve(student, teacher, spec: fw.FFNSpec, chunks_nt: np.ndarray, kl_rise=None,
             grid=GRID) -> list[dict]:
    """[{"threshold", "kl", "sparsity"}] of the student at the gate thresholds of `grid` on
    chunks [n, T] (float32, one sequence per call; the teacher with its own activation); see
    scan_grid for kl_rise."""
    s_def, s_state = nnx.split(student)
    t_def, t_state = nnx.split(teacher)
    t_spec = fw.teacher_spec(teacher.config)
    tokens = [jnp.asarray(c[None]) for c in chunks_nt]
    t_logits = [_teacher_logits(t_def, t_state, t_spec, x) for x in tokens]

    def kl_at(t):
        kl, sp = zip(*[_kl_and_sparsity(s_def, s_state, spec, x, tl, jnp.float32(t))
                       for x, tl in zip(tokens, t_logits)])
        return float(np.mean(kl)), float(np.mean(sp))

    return scan_grid(kl_at, kl_rise, grid)


def scan_grid(kl_at, kl_rise=None, grid=GRID) -> list[dict]:
    """[{"threshold", "kl", "sparsity"}] from kl_at(t) -> (kl, sparsity), sorted by threshold.
    Without kl_rise, every grid point. With it, a bisection for the last grid point whose KL is
    within (1 + kl_rise) x the KL at the first point (the KL grows with the threshold), about
    log2(len(grid)) + 2 evaluations instead of len(grid)."""
    def point(t):
        kl, sparsity = kl_at(float(t))
        return {"threshold": float(t), "kl": float(kl), "sparsity": float(sparsity)}

    if kl_rise is None:
        return [point(t) for t in grid]
    first = point(grid[0])
    budget = first["kl"] * (1.0 + kl_rise)
    seen = {0: first}
    lo, hi = 0, len(grid) - 1  # grid[lo] is within budget; find the last index that is
    last = seen.setdefault(hi, point(grid[hi]))
    if last["kl"] <= budget:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen[mid] = point(grid[mid])
        if seen[mid]["kl"] <= budget:
            lo = mid
        else:
            hi = mid
    return [seen[i] for i in sorted(seen)]


def pick_threshold(curve: list[dict], kl_rise: float) -> float:
    """The largest threshold of the curve whose KL is within (1 + kl_rise) of the KL at its first
    point (t = 0), below the first point over that budget."""
    budget = curve[0]["kl"] * (1.0 + kl_rise)
    best = curve[0]["threshold"]
    for p in curve[1:]:
        if p["kl"] > budget:
            break
        best = p["threshold"]
    return best


def calibrate_threshold(student, teacher, spec: fw.FFNSpec, chunks_nt: np.ndarray,
                        kl_rise: float) -> dict:
    """{"threshold": t, "curve": kl_curve rows}: see the module docstring. teacher's config
    carries its own activation (the dense model); student's spec is relu or drelu."""
    if spec.activation not in ("relu", "drelu"):
        raise ValueError(f"FATReLU: expected a relu or drelu student, got {spec.activation!r}")
    curve = kl_curve(student, teacher, spec, chunks_nt, kl_rise)
    return {"threshold": pick_threshold(curve, kl_rise), "curve": curve}
