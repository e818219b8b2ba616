"""PowerInfer's predictors in our engine: fc1 -> ReLU -> fc2, no biases, on the residual stream.

`PowerInferPredictor` maps the residual [B, T, D] to scores [B, T, F]: +1 where PowerInfer computes
the neuron (fc2 output >= its sparse threshold), -1 elsewhere, so "scores > 0 = active" reproduces
PowerInfer's decision exactly, ">=" included (a zero predictor marks every neuron active).
`PowerInferSelector` (a models.ffn.Selector) runs it: unlike the Scores selector, which feeds its
predictor the FFN input (after ffn_norm), it reads the block's residual (the `residual` a Block
passes to its FFN), the tensor the FFN's norm normalizes (the residual after attention; a parallel block's input), as
PowerInfer's llama.cpp does (`ffn_inp` for llama/bamboo/opt, `inpL` for falcon).

Attach: `attach(model, predictors)` with a checkpoint.powerinfer.PowerInferPredictors (e.g. from
`load_predictors(file, config)`): every FFN gets a PowerInferSelector (placement's hot-first
permutation reorders its fc2 rows). A sparsity mode for it (modes.register) is not registered
here: the lead's registry decides how CLIs name it.

Our own low-rank predictors (PredictorStack) have biases and read the FFN input, and their
trained decision threshold lives in the output bias, so they cannot be written as PowerInfer's
fc1/fc2. What can: a bias-free predictor trained on the FFN input of an RMSNorm model
(`train` here), because ffn_norm(x) = x * s / rms(x) with rms(x) > 0, a bias-free ReLU MLP is
positively homogeneous, and so fc1' = fc1 * s (per input column) on the residual gives the same
sign, hence the same decisions at threshold 0 (`to_powerinfer`). LayerNorm models (OPT, Falcon)
subtract the mean and add a bias: not expressible, an error.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from powerinfer_jax.checkpoint.base import QuantTensor
from powerinfer_jax.errors import fail
from powerinfer_jax.models.ffn import Selection, Selector, require_residual
from powerinfer_jax.models.layers import Linear, Module
from powerinfer_jax.models.qweights import MATVEC, SELECTED_LAYOUT, arrange, check_ffn_layout
from powerinfer_jax.sparsity.predictor import mask_quality, weighted_bce

F32 = jnp.float32


class PowerInferPredictor(Module):
    """One layer's PowerInfer predictor: scores = +1 if relu(x @ fc1.T) @ fc2.T >= threshold."""

    def __init__(self, fc1_rd, fc2_fr, threshold: float = 0.0, *, dtype=F32,
                 kernels: str = "xla", f16_inputs: bool = False, quantized: bool = False):
        """fc1_rd, fc2_fr: float arrays or `QuantTensor`s (a quantized PowerInfer GGUF's blocks).
        quantized: keep QuantTensors as blocks, computed on by ops.qlinear with 8-bit activations
        as PowerInfer's ggml computes a Q4_0 predictor (a quantized model's predictors: their
        bytes are read every token); otherwise they are dequantized to `dtype`.
        f16_inputs: round both matmuls' inputs to float16 first, as PowerInfer's CPU matmuls on
        F16 weights do (ggml converts the activations to F16): to measure how much of a
        disagreement with PowerInfer that rounding alone explains. Off for normal runs."""

        self.threshold = float(threshold)
        self.f16_inputs = f16_inputs
        self.fc1 = Linear(fc1_rd.shape[1], fc1_rd.shape[0], bias=False, dtype=dtype, rngs=None,
                          kernels=kernels)
        self.fc2 = Linear(fc2_fr.shape[1], fc2_fr.shape[0], bias=False, dtype=dtype, rngs=None,
                          kernels=kernels)
        # quantized fc2's output order after `permute` (None: the file's): its interleaved
        # rows stay as arranged at load, the scores are gathered instead
        self.order = None
        for lin, w in ((self.fc1, fc1_rd), (self.fc2, fc2_fr)):
            if isinstance(w, QuantTensor) and quantized:
                if f16_inputs:
                    fail("PowerInferPredictor f16_inputs", "float weights (quantized ones "
                         "round their inputs to 8 bits)", f"{w.qtype} blocks")
                # a matvec per token: interleaved blocks (a 7B layer's Q4_0 pair in 0.058 ms
                # against 0.127 ms as the file's rows, 2 threads, DRAM); permute re-arranges
                lin.load(arrange(w, MATVEC))
            else:
                w = w.dequantize() if isinstance(w, QuantTensor) else w
                lin.weight.set_value(jnp.asarray(w, dtype))

    def raw(self, x_btd):
        """fc2's output [B, T, F] (float32): PowerInfer's `sparse_idx`."""
        r = (lambda v: v.astype(jnp.float16).astype(F32)) if self.f16_inputs else (lambda v: v)
        y = self.fc2(r(jax.nn.relu(self.fc1(r(x_btd)))))
        return y if self.order is None else jnp.take(y, self.order[...], axis=-1)

    def __call__(self, x_btd):
        return jnp.where(self.raw(x_btd) >= self.threshold, 1.0, -1.0).astype(F32)

    def permute(self, perm) -> None:
        """Reorder the output neurons (FFN.permute): float fc2's rows move; a quantized fc2
        keeps its blocks as arranged at load (rows interleaved by 16 are never converted back)
        and its scores are gathered in the new order (F int32 indices, one gather a token)."""

        fc2 = self.fc2
        if fc2.qtype is None:
            fc2.weight.set_value(fc2.weight[...][perm])
            return
        perm = np.asarray(perm)
        order = perm if self.order is None else np.asarray(self.order[...])[perm]
        self.order = nnx.Variable(jnp.asarray(order, jnp.int32))


class PowerInferSelector(Selector):
    """Active where the PowerInfer predictor, on the block's residual, says so (module doc)."""

    reads_residual = True

    def __init__(self, predictor: PowerInferPredictor):
        self.predictor = predictor

    def select(self, ffn, x_btd) -> Selection:
        return self.select_in_block(ffn, x_btd, None)

    def select_in_block(self, ffn, x_btd, residual) -> Selection:
        return Selection("scores", 0.0,
                         self.predictor(require_residual(residual, "the PowerInfer predictor")))

    def permute(self, perm) -> None:
        self.predictor.permute(perm)

    def describe(self) -> dict:
        return {"selector": "powerinfer", "threshold": self.predictor.threshold}


def selectors(model, predictors, *, f16_inputs: bool = False) -> list:
    """One PowerInferSelector per layer with its layer's predictor (checked against the model):
    the "powerinfer" sparsity mode (sparsity/modes.py)."""
    predictors.check(model.config, "PowerInfer predictors")
    quantized = model.kernels == "ffi" and model.layers[0].ffn.quantized  # the model's own form
    return [PowerInferSelector(PowerInferPredictor(
        predictors.fc1[l], predictors.fc2[l], predictors.threshold, dtype=model.dtype,
        kernels=model.kernels, f16_inputs=f16_inputs, quantized=quantized))
        for l in range(model.config.n_layers)]


def attach(model, predictors, *, impl: str = "ffi", f16_inputs: bool = False) -> None:
    """Give every FFN of `model` a PowerInferSelector with its layer's predictor (checked against
    the model). impl: the sparse call's implementation ("ffi" or "reference")."""

    for layer, sel in zip(model.layers, selectors(model, predictors, f16_inputs=f16_inputs)):
        # rows read per predicted neuron: the model loaded with ffn_layout=SELECTED_LAYOUT
        check_ffn_layout(layer.ffn, SELECTED_LAYOUT, "PowerInfer predictors")
        layer.ffn.set_selector(sel, impl=impl)


# ------------------------------------------------------------------------ PowerInfer's shape
class BiasFreeStack(Module):
    """L bias-free predictors, trained together: fc1 [L, R, D], fc2 [L, F, R]."""

    def __init__(self, n_layers: int, d_model: int, rank: int, d_ff: int, *, rngs: nnx.Rngs):
        k1, k2 = rngs.params(), rngs.params()
        self.fc1 = nnx.Param(jax.random.normal(k1, (n_layers, rank, d_model), F32)
                             * d_model ** -0.5)
        self.fc2 = nnx.Param(jax.random.normal(k2, (n_layers, d_ff, rank), F32) * rank ** -0.5)

    def __call__(self, x_lnd):
        h = jax.nn.relu(jnp.einsum("LND,LRD->LNR", x_lnd.astype(F32), self.fc1[...]))
        return jnp.einsum("LNR,LFR->LNF", h, self.fc2[...])


def train(x_lnd: np.ndarray, mask_lnf: np.ndarray, *, rank: int = 64, steps: int = 300,
          batch_tokens: int = 256, learning_rate: float = 3e-3, positive_weight: float = 3.0,
          seed: int = 0, progress: bool = False) -> tuple[BiasFreeStack, dict]:
    """Bias-free predictors (PowerInfer's shape) on (FFN input [L, N, D], active mask [L, N, F]),
    with sparsity/predictor.py's weighted BCE; "active" is output >= 0 (no threshold to tune:
    PowerInfer's one threshold is global and, on the residual, not scale-free). Returns the
    stack and its quality on the last 10% of tokens (held out)."""
    n_layers, n, d = x_lnd.shape
    n_hold = max(1, n // 10)
    n_train = n - n_hold
    if n_train < batch_tokens:
        fail("PowerInfer predictor training tokens", f">= batch_tokens={batch_tokens} after "
             f"holding out {n_hold}", n_train, "use a longer corpus")
    stack = BiasFreeStack(n_layers, d, rank, mask_lnf.shape[2], rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(stack, optax.adam(optax.cosine_decay_schedule(learning_rate, steps)),
                        wrt=nnx.Param)

    @nnx.jit
    def step(stack, opt, x, y):
        loss, grads = nnx.value_and_grad(
            lambda s: weighted_bce(s(x), y, positive_weight))(stack)
        opt.update(stack, grads)
        return loss

    rng = np.random.default_rng(seed)
    it = range(steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"PowerInfer predictors (L={n_layers}, R={rank})", unit="step")
    for _ in it:
        idx = np.sort(rng.choice(n_train, batch_tokens, replace=False))
        step(stack, opt, jnp.asarray(x_lnd[:, idx]), jnp.asarray(mask_lnf[:, idx]))
    fn = nnx.jit(lambda s, x: s(x) >= 0)
    pred = np.concatenate([np.asarray(fn(stack, jnp.asarray(x_lnd[:, i:i + 1024])))
                           for i in range(n_train, n, 1024)], axis=1)
    report = mask_quality(pred, mask_lnf[:, n_train:])
    report.update(rank=rank, train_tokens=n_train, holdout_tokens=n_hold)
    return stack, report


def to_powerinfer(stack: BiasFreeStack, config, params):
    """The stack (trained on FFN inputs) as PowerInfer predictors on the residual: fc1 columns
    scaled by each layer's ffn_norm scale (module docstring). RMSNorm models only."""
    # lazy: start-up (gguf only for GGUF files)
    from powerinfer_jax.checkpoint.powerinfer import PowerInferPredictors

    if config.norm != "rms":
        fail("PowerInfer predictor export: model norm", "'rms' (fc1 on the residual can absorb "
             "RMSNorm's scale, not LayerNorm's mean and bias)", config.norm,
             "train predictors on the residual stream for LayerNorm models")
    fc1 = np.asarray(stack.fc1[...])
    fc2 = np.asarray(stack.fc2[...])
    scaled = tuple(fc1[l] * np.asarray(params[f"layers.{l}.ffn_norm.scale"], np.float32)[None, :]
                   for l in range(config.n_layers))
    return PowerInferPredictors(scaled, tuple(fc2[l] for l in range(config.n_layers)), 0.0)


def from_predictor_stack(stack, config, params):
    """Our low-rank PredictorStack as PowerInfer predictors, where it can be: only with every bias
    zero (PowerInfer's fc1/fc2 have none, and our trained stacks keep their decision threshold in
    the output bias) and an RMSNorm model. Otherwise a UserError saying why."""
    arrays = stack.arrays()
    worst = max(float(np.abs(arrays[k]).max()) for k in ("b_in_lr", "b_out_lf"))
    if worst != 0.0:
        fail("PowerInfer predictor export: low-rank predictor biases", "all zero (PowerInfer's "
             "fc1 -> ReLU -> fc2 has no biases)", f"max |b| = {worst:.3g}",
             "train PowerInfer-shape predictors with sparsity.powerinfer_predictor.train")
    bias_free = nnx.eval_shape(lambda: BiasFreeStack(*stack.shape[:3], stack.shape[3],
                                                     rngs=nnx.Rngs(0)))
    bias_free.fc1 = nnx.Param(jnp.asarray(np.swapaxes(arrays["w_in_ldr"], 1, 2)))
    bias_free.fc2 = nnx.Param(jnp.asarray(np.swapaxes(arrays["w_out_lrf"], 1, 2)))
    return to_powerinfer(bias_free, config, params)
