"""`DistillConfig`: one sparsification run (student variant, loss, data, optimizer), frozen and
validated like every config of the project (errors "<what>: expected <rule>, got <value>").

Variants (the student's FFN; the teacher is the dense model):
  threshold: the model's own activation a_i = act(gate_i.x) * (up_i.x); neurons with |a_i| under
    the layer's threshold for `target_sparsity` are zeroed inside the forward pass (CATS/TEAL
    style), with a straight-through gradient (`ste`). The exported model keeps its activation; it
    runs sparse with `--sparsity oracle|predictor --target-sparsity T`.
  relu: ReGLU, a_i = relu(gate_i.x) * (up_i.x) (ReluLLaMA, ProSparse): exact zeros.
  drelu: dReLU, a_i = relu(gate_i.x) * relu(up_i.x) (TurboSparse): exact zeros on either side.
"""
from __future__ import annotations

import dataclasses
import math

from powerinfer_jax.errors import check, check_choice, check_positive_int

VARIANTS = ("threshold", "relu", "drelu")
MASK_BY = ("layer", "token")  # threshold variant: one threshold per layer and batch, or top-k
TRAIN_SCOPES = ("ffn", "ffn+norms", "all")
COMPUTE_DTYPES = ("float32", "bfloat16")
REFIT_TARGETS = ("local", "residual")


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
    def masked(self) -> bool:
        """Whether the training forward zeroes activations under a threshold."""
        return self.variant == "threshold"

    def replace(self, **changes) -> "DistillConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
