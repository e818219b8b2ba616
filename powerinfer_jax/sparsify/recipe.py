"""A sparsification recipe: `DistillConfig`, what one run does (student variant, loss, data,
optimizer), frozen and validated like every config of the project (errors "<what>: expected
<rule>, got <value>"), and `RECIPES`, its named presets.

Variants (the student's FFN; the teacher is the dense model):
  threshold: the model's own activation a_i = act(gate_i.x) * (up_i.x); neurons with |a_i| under
    the layer's threshold for `target_sparsity` are zeroed inside the forward pass (CATS/TEAL
    style), with a straight-through gradient (`ste`). The exported model keeps its activation; it
    runs sparse with `--sparsity oracle|predictor --target-sparsity T`.
  relu: ReGLU, a_i = relu(gate_i.x) * (up_i.x) (ReluLLaMA, ProSparse): exact zeros.
  drelu: dReLU, a_i = relu(gate_i.x) * relu(up_i.x) (TurboSparse): exact zeros on either side.
  fatrelu: ReGLU with a per-layer FATReLU threshold from the first step: a_i = relu(gate_i.x) *
    (up_i.x) where relu(gate_i.x) is above the layer's quantile `target_sparsity` (per batch in
    training, straight-through gradient; calibrated on corpus text for the exported model, which
    stores them in config.json as "fatrelu_threshold", a list). Exact zeros decided by the gate alone,
    so the runtime's threshold mode runs it (neuron i where relu(gate_i.x) > t_layer).

Recipes (`RECIPES`, `--recipe`): named presets of these fields. "prosparse" (ProSparse, Song et
al. 2024, for relu/drelu): L1 on the gate activation relu(gate_i.x) with a coefficient that is 0
for a warm-up stage, then rises along a sine quarter-wave to each stage's value in turn
(`l1_stages`, scaled toward a sparsity target: `l1_target_sparsity`), and a FATReLU threshold
calibrated at the end (`fatrelu_kl_rise`).
"""
from __future__ import annotations

import dataclasses
import json
import math

from powerinfer_jax.errors import check, check_choice, check_positive_int

VARIANTS = ("threshold", "relu", "drelu", "fatrelu")
MASK_BY = ("layer", "token")  # threshold variant: one threshold per layer and batch, or top-k
TRAIN_SCOPES = ("ffn", "ffn+norms", "all")
COMPUTE_DTYPES = ("float32", "bfloat16")
REFIT_TARGETS = ("local", "residual")
L1_ON = ("act", "gate")  # the penalty on mean |a_i| or on the gate activation relu(gate_i . x)
TEACHERS = ("online", "cached")
# ProSparse for a 135M student: a warm-up stage without L1 (the activation swap recovers), then
# three sine ramps to the stage coefficients, the last ending at 70% of the steps so the model
# settles under the final penalty, scaled by the controller toward 87% natural zeros (how strong a
# coefficient is here is not known in advance: at the start the KL's gradient is ~126x the L1's);
# FATReLU at the end, at most +5% KL to the teacher.
RECIPES = {
    "prosparse": dict(l1_on="gate", l1=0.0,
                      l1_stages=((0.1, 0.0), (0.3, 0.02), (0.5, 0.05), (0.7, 0.1)),
                      l1_target_sparsity=0.87, fatrelu_kl_rise=0.05),
}


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """What a sparsification run does. `tokens` counts training tokens (steps x batch x seq_len).

    lr: peak AdamW learning rate (linear warm-up over `warmup_steps`, then cosine decay to
      `lr_final_fraction` of it at the last step).
    l1, l1_warmup: the activation penalty l1 * mean|a| (averaged over layers), its coefficient
      ramped linearly from 0 over the first `l1_warmup` fraction of the steps (ProSparse's
      progressive schedule, in one ramp).
    hidden_mse: weight of the per-layer hidden-state MSE to the teacher (each layer's squared
      error over the teacher's mean square), on top of the KL on logits.
    train: which weights learn: the FFN matrices ("ffn"), plus the norm scales ("ffn+norms"), or
      every parameter ("all").
    compute_dtype: matmul inputs of the training forward (master weights stay float32).
    remat: recompute each block in the backward pass (jax.checkpoint): less memory, more time.
    refit: before training, refit each layer's down rows by least squares under the student's
      sparse activations (closed form, on `refit_tokens` corpus tokens); `refit_target` "local"
      matches the dense FFN's output on the student's own input, "residual" the teacher's
      residual stream after the layer (also undoes the error of the layers below).
    samples, sample_fraction: teacher samples from varied prompts (`samples` sequences, generated
      once and cached) and the share of every batch taken from them; the rest is corpus text.
    l1_stages: ProSparse's schedule, ((end_fraction, coefficient), ...) with increasing ends in
      (0, 1]: within stage i the coefficient rises from stage i-1's along a sine quarter-wave to
      its own; after the last stage it stays there. Replaces `l1`/`l1_warmup` when given.
    l1_on: the penalized activation: "act" (mean |a_i|) or "gate" (mean relu(gate_i . x), and
      for drelu also relu(up_i . x): ProSparse's "intermediate outputs").
    fatrelu_kl_rise: FATReLU (relu and drelu): after `fatrelu_at` of the steps, the gate
      threshold t (relu(g) kept only where g > t) is the largest on a fixed grid whose KL to the
      teacher on training text is at most (1 + fatrelu_kl_rise) x that at t = 0; the remaining
      steps train with it and the exported model stores it. 0: no threshold.
    l1_target_sparsity: steer the L1 coefficient toward this FFN sparsity (schedule.L1Controller:
      the stages give the shape, a multiplier the strength); 0: the stages' coefficients as given.
    teacher: "online" (the teacher's forward in every step: exact KL, hidden-state MSE possible)
      or "cached" (the teacher's top-`topk` log-probabilities per position, computed once per
      sequence and kept on disk: KL over the top-k tokens and the rest's total mass).
    """

    variant: str = "threshold"
    target_sparsity: float = 0.85
    tokens: int = 262_144
    batch: int = 4
    seq_len: int = 256
    lr: float = 1e-4
    warmup_steps: int = 10
    lr_final_fraction: float = 0.1
    weight_decay: float = 0.0
    seed: int = 0
    mask_by: str = "layer"
    ste: bool = True
    l1: float = 0.0
    l1_warmup: float = 0.5
    hidden_mse: float = 0.0
    train: str = "ffn"
    compute_dtype: str = "bfloat16"
    remat: bool = False
    refit: bool = True
    refit_target: str = "local"
    refit_tokens: int = 8192
    refit_ridge: float = 1e-3
    samples: int = 64
    sample_fraction: float = 0.25
    l1_stages: tuple = ()
    l1_on: str = "act"
    fatrelu_kl_rise: float = 0.0
    fatrelu_at: float = 1.0
    teacher: str = "online"
    topk: int = 64
    l1_target_sparsity: float = 0.0

    def __post_init__(self):
        check_choice("--variant", self.variant, VARIANTS)
        check(isinstance(self.target_sparsity, float) and 0.0 < self.target_sparsity < 1.0,
              "--target-sparsity", "a float in (0, 1) (the fraction of FFN neurons skipped)",
              self.target_sparsity)
        check_positive_int("--batch", self.batch)
        check_positive_int("--seq-len", self.seq_len)
        check(isinstance(self.seq_len, int) and self.seq_len >= 2, "--seq-len", "an integer >= 2",
              self.seq_len)
        per_step = self.batch * self.seq_len
        check(isinstance(self.tokens, int) and self.tokens >= per_step, "--tokens",
              f"at least one step of --batch x --seq-len = {per_step} tokens", self.tokens,
              "raise --tokens or lower --batch/--seq-len")
        for name in ("lr", "l1", "hidden_mse", "weight_decay", "refit_ridge"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                  f"--{name.replace('_', '-')}", "a finite number >= 0", v)
        check(self.lr > 0, "--lr", "a finite number > 0", self.lr)
        check(0.0 <= self.l1_warmup <= 1.0, "--l1-warmup", "a fraction of the steps in [0, 1]",
              self.l1_warmup)
        check(0.0 <= self.lr_final_fraction <= 1.0, "lr_final_fraction", "a float in [0, 1]",
              self.lr_final_fraction)
        check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps",
              "an integer >= 0", self.warmup_steps)
        check_choice("--mask-by", self.mask_by, MASK_BY)
        check_choice("--train", self.train, TRAIN_SCOPES)
        check_choice("--compute-dtype", self.compute_dtype, COMPUTE_DTYPES)
        check_choice("--refit-target", self.refit_target, REFIT_TARGETS)
        check(isinstance(self.refit_tokens, int) and self.refit_tokens >= self.seq_len,
              "--refit-tokens", f"an integer >= --seq-len ({self.seq_len})", self.refit_tokens)
        check(isinstance(self.samples, int) and self.samples >= 0, "--samples", "an integer >= 0",
              self.samples)
        check(0.0 <= self.sample_fraction < 1.0, "--sample-fraction", "a float in [0, 1)",
              self.sample_fraction)
        check(self.samples > 0 or self.sample_fraction == 0.0, "--sample-fraction",
              "0 when --samples is 0", self.sample_fraction)
        try:  # lists from JSON or argparse become the hashable tuples the dataclass keeps
            stages = tuple((float(e), float(c)) for e, c in self.l1_stages)
        except (TypeError, ValueError):
            stages = None
        ok = stages is not None and all(math.isfinite(e) and math.isfinite(c) and 0 < e <= 1
                                        and c >= 0 for e, c in stages)
        if ok:
            object.__setattr__(self, "l1_stages", stages)
        check(ok and all(a[0] < b[0] for a, b in zip(stages, stages[1:])), "--l1-stages",
              "(end fraction, coefficient) pairs with increasing ends in (0, 1] and "
              "coefficients >= 0", self.l1_stages)
        check_choice("--l1-on", self.l1_on, L1_ON)
        check(isinstance(self.fatrelu_kl_rise, (int, float)) and 0 <= self.fatrelu_kl_rise < 10,
              "--fatrelu-kl-rise", "a number in [0, 10)", self.fatrelu_kl_rise)
        check(self.fatrelu_kl_rise == 0 or self.variant in ("relu", "drelu"), "--fatrelu-kl-rise",
              "0 for the threshold and fatrelu variants (one FATReLU threshold for a relu or "
              "drelu student)", self.fatrelu_kl_rise)
        check(self.variant != "fatrelu" or self.mask_by == "layer", "--mask-by",
              "layer for the fatrelu variant (its export keeps one threshold per layer)",
              self.mask_by)
        check(isinstance(self.fatrelu_at, (int, float)) and 0 <= self.fatrelu_at <= 1,
              "--fatrelu-at", "a fraction of the steps in [0, 1]", self.fatrelu_at)
        check(isinstance(self.l1_target_sparsity, (int, float))
              and 0 <= self.l1_target_sparsity < 1, "--l1-target-sparsity",
              "a fraction in [0, 1) (0: off)", self.l1_target_sparsity)
        check(not self.l1_target_sparsity or bool(self.l1_stages) or self.l1 > 0,
              "--l1-target-sparsity", "an L1 schedule to steer (--l1-stages or --l1)",
              self.l1_target_sparsity)
        check_choice("--teacher", self.teacher, TEACHERS)
        check(isinstance(self.topk, int) and 1 <= self.topk <= 1024, "--topk",
              "an integer in [1, 1024]", self.topk)
        check(self.teacher == "online" or self.hidden_mse == 0, "--hidden-mse",
              "0 with --teacher cached (the cache keeps logits, not hidden states)",
              self.hidden_mse)

    @property
    def steps(self) -> int:
        return self.tokens // (self.batch * self.seq_len)

    @property
    def samples_per_batch(self) -> int:
        """Teacher-sample sequences in each batch (the rest are corpus chunks)."""
        if self.samples == 0 or self.sample_fraction == 0.0:
            return 0
        return min(self.batch - 1, max(1, round(self.batch * self.sample_fraction))) \
            if self.batch > 1 else 0

    @property
    def fatrelu_step(self) -> int | None:
        """The step from which the FATReLU threshold applies (None: no threshold)."""
        if self.fatrelu_kl_rise == 0:
            return None
        return min(self.steps, int(round(self.fatrelu_at * self.steps)))

    @property
    def masked(self) -> bool:
        """Whether the training forward zeroes activations under a threshold."""
        return self.variant in ("threshold", "fatrelu")

    def replace(self, **changes) -> "DistillConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON values (tuples as lists): what checkpoint records compare."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def recipe(name: str | None, **fields) -> DistillConfig:
    """A DistillConfig from recipe `name`'s preset (None: the plain defaults), with `fields`
    overriding it."""
    if name is not None:
        check_choice("--recipe", name, tuple(RECIPES))
    return DistillConfig(**{**(RECIPES[name] if name else {}), **fields})
