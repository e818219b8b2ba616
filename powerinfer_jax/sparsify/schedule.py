"""What changes over a run, as pure functions of (config, step): the learning rate, the L1
coefficient (one linear ramp, or ProSparse's stages) and when FATReLU's threshold starts.

A function of the step alone keeps a resumed run identical to an uninterrupted one.
"""
from __future__ import annotations

import math

import optax

from powerinfer_jax.sparsify.config import DistillConfig


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
