"""Activation predictors: per layer a low-rank MLP (D -> R -> F, ReLU between) from the FFN input to
"neuron i is active", trained with flax NNX + optax on profiled (FFN input, active mask) pairs.

All layers train together as one `PredictorStack` (weights with a leading layer axis L), then each
layer's slice becomes a `Predictor` attached to its FFN. The decision threshold per layer is chosen
on held-out tokens for a target recall and folded into the output bias, so "active" is simply
logit > 0 (the sparse FFN call takes thresholds >= 0).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from powerinfer_jax.models.layers import Module, matmul

F32 = jnp.float32


class Predictor(Module):
    """One layer's predictor at inference: logits [..., F] = relu(x @ w_in.T + b_in) @ w_out.T + b_out.

    Weights are stored [out, in] (`w_in_rd` [R, D], `w_out_fr` [F, R]) in the model's dtype, like
    every other matrix, so at decode they run through the same `matmul` (the `ops.linear` custom
    call on CPU) and the hot-first permutation reorders rows of `w_out_fr`. Training uses the
    stacked in-major layout of `PredictorStack`; `PredictorStack.layer` converts once at load.
    """

    def __init__(self, d_model: int, rank: int, d_ff: int, *, rngs: nnx.Rngs | None = None,
                 dtype=F32, kernels: str = "xla"):
        self.kernels = kernels
        self.w_in_rd = nnx.Param(_init(rngs, (rank, d_model), d_model).astype(dtype))
        self.b_in_r = nnx.Param(jnp.zeros((rank,), F32))
        self.w_out_fr = nnx.Param(_init(rngs, (d_ff, rank), rank).astype(dtype))
        self.b_out_f = nnx.Param(jnp.zeros((d_ff,), F32))

    def __call__(self, x_btd):
        h = jax.nn.relu(matmul(x_btd, self.w_in_rd[...], self.kernels) + self.b_in_r[...])
        return matmul(h, self.w_out_fr[...], self.kernels) + self.b_out_f[...]

    def permute(self, perm) -> None:
        """Reorder the output neurons (FFN.permute)."""
        self.w_out_fr.set_value(self.w_out_fr[...][perm])
        self.b_out_f.set_value(self.b_out_f[...][perm])


class PredictorStack(Module):
    """L predictors with stacked weights ([L, D, R], [L, R], [L, R, F], [L, F])."""

    def __init__(self, n_layers: int, d_model: int, rank: int, d_ff: int, *, rngs: nnx.Rngs):
        self.w_in_ldr = nnx.Param(_init(rngs, (n_layers, d_model, rank), d_model))
        self.b_in_lr = nnx.Param(jnp.zeros((n_layers, rank), F32))
        self.w_out_lrf = nnx.Param(_init(rngs, (n_layers, rank, d_ff), rank))
        self.b_out_lf = nnx.Param(jnp.zeros((n_layers, d_ff), F32))

    def __call__(self, x_lnd):
        h = jax.nn.relu(jnp.einsum("LND,LDR->LNR", x_lnd.astype(F32), self.w_in_ldr[...])
                        + self.b_in_lr[...][:, None])
        return jnp.einsum("LNR,LRF->LNF", h, self.w_out_lrf[...]) + self.b_out_lf[...][:, None]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(L, D, R, F)."""
        (n_layers, d, r), f = self.w_in_ldr.shape, self.w_out_lrf.shape[-1]
        return n_layers, d, r, f

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k)[...]) for k in _STACK_FIELDS}

    @classmethod
    def from_arrays(cls, arrays: dict) -> "PredictorStack":
        n_layers, d, r = np.shape(arrays["w_in_ldr"])
        f = np.shape(arrays["w_out_lrf"])[-1]
        stack = nnx.eval_shape(lambda: cls(n_layers, d, r, f, rngs=nnx.Rngs(0)))
        for k in _STACK_FIELDS:
            want = getattr(stack, k).shape
            got = np.shape(arrays[k])
            if tuple(got) != tuple(want):
                raise ValueError(f"predictor tensor {k}: expected shape {want}, got {got}")
            setattr(stack, k, nnx.Param(jnp.asarray(arrays[k], F32)))
        return stack

    def layer(self, l: int, *, dtype=F32, kernels: str = "xla") -> Predictor:
        """Layer l's predictor for inference: weights transposed to [out, in], in `dtype`."""
        n_layers, d, r, f = self.shape
        p = nnx.eval_shape(lambda: Predictor(d, r, f, dtype=dtype, kernels=kernels))
        p.w_in_rd = nnx.Param(jnp.asarray(self.w_in_ldr[...][l].T, dtype))
        p.b_in_r = nnx.Param(self.b_in_lr[...][l])
        p.w_out_fr = nnx.Param(jnp.asarray(self.w_out_lrf[...][l].T, dtype))
        p.b_out_f = nnx.Param(self.b_out_lf[...][l])
        return p


_STACK_FIELDS = ("w_in_ldr", "b_in_lr", "w_out_lrf", "b_out_lf")


def _init(rngs, shape, fan_in):
    if rngs is None:
        return jnp.zeros(shape, F32)
    return jax.random.normal(rngs.params(), shape, F32) * fan_in ** -0.5


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    rank: int = 128
    steps: int = 600
    batch_tokens: int = 256
    learning_rate: float = 3e-3
    # Missing an active neuron costs quality; a false positive only costs compute. Weighting the
    # positives' loss tilts the fit toward recall before the held-out threshold fixes it exactly.
    positive_weight: float = 3.0
    target_recall: float = 0.92  # a margin over the 0.90 the evaluation asks for on other text
    holdout_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        for name in ("rank", "steps", "batch_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"predictor {name}: expected a positive integer, got {v!r}")
        if not 0.0 < self.target_recall < 1.0:
            raise ValueError(f"target recall: expected a float in (0, 1), got {self.target_recall!r}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout fraction: expected a float in (0, 1), "
                             f"got {self.holdout_fraction!r}")
        if not self.positive_weight > 0:
            raise ValueError(f"positive weight: expected a float > 0, got {self.positive_weight!r}")


def weighted_bce(logits, labels, positive_weight: float):
    """Binary cross-entropy with the positives' term scaled by positive_weight (mean over all)."""
    y = labels.astype(F32)
    return jnp.mean(positive_weight * y * jax.nn.softplus(-logits)
                    + (1.0 - y) * jax.nn.softplus(logits))


def train_predictors(x_lnd: np.ndarray, mask_lnf: np.ndarray, cfg: TrainConfig = TrainConfig(), *,
                     progress: bool = True) -> tuple[PredictorStack, dict]:
    """Train L predictors on (FFN input [L, N, D], active mask [L, N, F]) pairs.

    The last holdout_fraction of the tokens is held out: it picks each layer's decision threshold
    (for cfg.target_recall) and gives the reported recall, precision and predicted sparsity.
    """
    n_layers, n, d = x_lnd.shape
    if mask_lnf.shape[:2] != (n_layers, n):
        raise ValueError(f"active mask shape: expected [L, N, F] with L, N = {(n_layers, n)}, got "
                         f"{mask_lnf.shape}")
    n_hold = max(1, int(round(n * cfg.holdout_fraction)))
    n_train = n - n_hold
    if n_train < cfg.batch_tokens:
        raise ValueError(f"predictor training tokens: expected at least batch_tokens="
                         f"{cfg.batch_tokens} after holding out {n_hold}, got {n_train} "
                         "(use a longer corpus)")
    f = mask_lnf.shape[2]
    stack = PredictorStack(n_layers, d, cfg.rank, f, rngs=nnx.Rngs(cfg.seed))
    schedule = optax.cosine_decay_schedule(cfg.learning_rate, cfg.steps)
    opt = nnx.Optimizer(stack, optax.adam(schedule), wrt=nnx.Param)

    @nnx.jit
    def step(stack, opt, x, y):
        loss, grads = nnx.value_and_grad(
            lambda s: weighted_bce(s(x), y, cfg.positive_weight))(stack)
        opt.update(stack, grads)
        return loss

    rng = np.random.default_rng(cfg.seed)
    order = np.concatenate([rng.permutation(n_train) for _ in
                            range(-(-cfg.steps * cfg.batch_tokens // n_train))])
    it = range(cfg.steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"predictors: train (L={n_layers}, R={cfg.rank})", unit="step")
    for s in it:
        idx = np.sort(order[s * cfg.batch_tokens:(s + 1) * cfg.batch_tokens])
        loss = step(stack, opt, jnp.asarray(x_lnd[:, idx]), jnp.asarray(mask_lnf[:, idx]))
        if progress and s % 50 == 0:
            it.set_postfix(loss=f"{float(loss):.4f}")
    hold = slice(n_train, n)
    logits = _logits(stack, x_lnd[:, hold])
    shift = decision_thresholds(logits, mask_lnf[:, hold], cfg.target_recall)
    stack.b_out_lf.set_value(stack.b_out_lf[...] - jnp.asarray(shift, F32)[:, None])
    report = predictor_quality(stack, x_lnd[:, hold], mask_lnf[:, hold])
    report.update(rank=cfg.rank, target_recall=cfg.target_recall, train_tokens=n_train,
                  holdout_tokens=n_hold)
    return stack, report


def _logits(stack: PredictorStack, x_lnd: np.ndarray, batch: int = 1024) -> np.ndarray:
    fn = nnx.jit(lambda s, x: s(x))
    return np.concatenate([np.asarray(fn(stack, jnp.asarray(x_lnd[:, i:i + batch])))
                           for i in range(0, x_lnd.shape[1], batch)], axis=1)


def decision_thresholds(logits_lnf: np.ndarray, mask_lnf: np.ndarray,
                        target_recall: float) -> np.ndarray:
    """[L] the largest logit threshold per layer that keeps recall >= target_recall (a layer
    without positives keeps 0)."""
    out = np.zeros(logits_lnf.shape[0])
    for l in range(logits_lnf.shape[0]):
        pos = np.sort(logits_lnf[l][mask_lnf[l]])
        if pos.size == 0:
            continue
        # active = logit > t: keep at least ceil(target * P) positives above t
        k = pos.size - int(np.ceil(target_recall * pos.size))
        out[l] = np.nextafter(pos[k], -np.inf, dtype=pos.dtype) if k < pos.size else pos[0]
    return out


def predictor_quality(stack: PredictorStack, x_lnd: np.ndarray, mask_lnf: np.ndarray) -> dict:
    """Per-layer recall, precision and predicted sparsity of `logit > 0` vs the true mask."""
    return mask_quality(_logits(stack, x_lnd) > 0, mask_lnf)


def mask_quality(pred_lnf: np.ndarray, mask_lnf: np.ndarray) -> dict:
    """Per-layer recall, precision and predicted sparsity of a predicted mask vs the true one."""
    pred = pred_lnf
    tp = (pred & mask_lnf).sum(axis=(1, 2))
    recall = tp / np.maximum(mask_lnf.sum(axis=(1, 2)), 1)
    precision = tp / np.maximum(pred.sum(axis=(1, 2)), 1)
    return {"recall": recall.round(4).tolist(), "precision": precision.round(4).tolist(),
            "predicted_sparsity": (1.0 - pred.mean(axis=(1, 2))).round(4).tolist(),
            "true_sparsity": (1.0 - mask_lnf.mean(axis=(1, 2))).round(4).tolist(),
            "mean_recall": float(recall.mean()), "mean_precision": float(precision.mean()),
            "mean_predicted_sparsity": float(1.0 - pred.mean())}


# Cost fractions (predictor bytes / FFN bytes) are reported for one weight width, the bfloat16 the
# fast modes run at, for every predictor: the low-rank matrices are stored at the model's dtype
# (Predictor), like the FFN, so their ratio is the same at float32.
COST_BYTES_PER_PARAM = 2.0


def predictor_cost(*, d_model: int, d_ff: int, rank: int, gated: bool) -> dict:
    """Per-token FLOPs and weight bytes of one layer's low-rank predictor, as fractions of its
    dense FFN's (matrices at COST_BYTES_PER_PARAM like the FFN, biases float32)."""
    matrices = d_model * rank + rank * d_ff
    pred_params = matrices + rank + d_ff
    ffn_params = (3 if gated else 2) * d_model * d_ff
    pred_bytes = COST_BYTES_PER_PARAM * matrices + 4.0 * (rank + d_ff)
    return {"flops_fraction": pred_params / ffn_params,
            "bytes_fraction": pred_bytes / (COST_BYTES_PER_PARAM * ffn_params),
            "predictor_flops_per_token": 2 * pred_params, "ffn_flops_per_token": 2 * ffn_params}
