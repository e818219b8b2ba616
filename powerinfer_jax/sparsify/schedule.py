"""What changes over a run, as pure functions of (config, step): the learning rate, the L1
coefficient (one linear ramp, or ProSparse's stages) and when FATReLU's threshold starts.

A function of the step alone keeps a resumed run identical to an uninterrupted one.
"""
from __future__ import annotations

import math

import optax

from powerinfer_jax.sparsify.recipe import DistillConfig


def learning_rate(cfg: DistillConfig):
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * lr_final_fraction at the last step."""
    warm = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    decay = optax.cosine_decay_schedule(cfg.lr, max(cfg.steps - warm, 1), cfg.lr_final_fraction)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(cfg.lr / warm, cfg.lr, warm), decay], [warm])


def l1_coefficient(cfg: DistillConfig, step: int) -> float:
    """The activation penalty's coefficient at `step` (0-based).

    With cfg.l1_stages (ProSparse): the run's fraction done x = step / steps; in stage i, between
    the ends e[i-1] and e[i] (e[-1] = 0, coefficient c[-1] = 0), the coefficient is
    c[i-1] + (c[i] - c[i-1]) * sin(pi/2 * (x - e[i-1]) / (e[i] - e[i-1])): a smooth rise that
    starts at the previous stage's value (ProSparse's "sine curve" per incremental stage); past
    the last end it stays at the last coefficient. Without stages: cfg.l1 ramped linearly from 0
    over the first l1_warmup of the steps."""
    if cfg.l1_stages:
        x = step / max(cfg.steps, 1)
        start, prev = 0.0, 0.0
        for end, coef in cfg.l1_stages:
            if x < end:
                u = (x - start) / (end - start)
                return prev + (coef - prev) * math.sin(0.5 * math.pi * u)
            start, prev = end, coef
        return prev
    ramp = cfg.l1_warmup * cfg.steps
    return cfg.l1 if ramp <= 0 else cfg.l1 * min(1.0, (step + 1) / ramp)


class L1Controller:
    """The L1 coefficient of a step: the schedule's (l1_coefficient) times a multiplier that steers
    the measured FFN sparsity toward a target (cfg.l1_target_sparsity; 0: multiplier 1 always).

    How strong a given coefficient is depends on the model and the loss's scale, so a schedule
    fixed in advance may leave the sparsity short of the target or overshoot it at a cost in KL.
    The schedule keeps its shape (ProSparse's progressive stages) and sets the target's path:
    target(step) = s0 + (target - s0) * c(step) / max c, from the sparsity s0 measured in the first
    window, so the target rises as the stages do. Every EVERY steps the multiplier moves by
    exp(GAIN * (target - mean sparsity of the window)), within [MIN, MAX]. Its state is plain
    JSON (saved with each checkpoint): a resumed run steers exactly as an uninterrupted one."""

    EVERY = 10
    GAIN = 5.0  # 1 point of sparsity short -> x1.05 per window; 10 points -> x1.65
    MIN, MAX = 1e-2, 1e2  # a target out of reach must not let the penalty swamp the KL

    def __init__(self, cfg: DistillConfig, state: dict | None = None):
        self.cfg = cfg
        state = state or {}
        self.multiplier = float(state.get("multiplier", 1.0))
        self.start = state.get("start")
        self.window = list(state.get("window", []))
        self.peak = max([c for _, c in cfg.l1_stages] + [cfg.l1, 1e-30])

    def state(self) -> dict:
        return {"multiplier": self.multiplier, "start": self.start, "window": list(self.window)}

    def coefficient(self, step: int) -> float:
        return l1_coefficient(self.cfg, step) * self.multiplier

    def target(self, step: int) -> float | None:
        goal = self.cfg.l1_target_sparsity
        if not goal or self.start is None:
            return None
        return self.start + (goal - self.start) * l1_coefficient(self.cfg, step) / self.peak

    def observe(self, step: int, sparsity: float) -> None:
        """The sparsity measured at `step` (steps observed in order, one call each)."""
        if not self.cfg.l1_target_sparsity:
            return
        self.window.append(float(sparsity))
        if (step + 1) % self.EVERY:
            return
        mean = sum(self.window) / len(self.window)
        self.window = []
        self.update(step, mean)

    def update(self, step: int, sparsity: float) -> None:
        """One move of the multiplier from the sparsity measured up to `step` (observe calls it
        every EVERY steps; a loop that reads its metrics every few steps, directly)."""
        if not self.cfg.l1_target_sparsity:
            return
        if self.start is None:
            self.start = float(sparsity)
        if l1_coefficient(self.cfg, step) > 0:
            self.multiplier = min(self.MAX, max(self.MIN, self.multiplier * math.exp(
                self.GAIN * (self.target(step) - sparsity))))
