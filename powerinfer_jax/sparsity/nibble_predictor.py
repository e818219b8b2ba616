"""The nibble predictor (`--predictor q4`, the artifacts' kind "q4"): each neuron's |a_i|
estimated from 4-bit copies of its gate and up rows, in nibble rows (ops/nibble_rows.py; not
GGUF Q4_x blocks).

Why a second predictor: a gated (SwiGLU) FFN's contribution is the product act(gate.x) * (up.x),
which a low-rank MLP fits poorly (on SmolLM2 the trained R=128 predictors need ~80% of the neurons
for 0.9 recall). Computing the product itself from Q4_1-style weights and Q8 activations costs
~5 bits per gate/up weight read, a fifth of bf16 gate+up, and ranks neurons almost like the exact
|a_i|. No training: the rows are quantized from the model's own weights at load; only the per-layer
decision thresholds are calibrated (`calibrate_thresholds`, on profiled FFN inputs).

`NibblePredictor(x)` returns scores = estimated |a_i|; "active" is scores > the layer's threshold
(SparsityArtifacts.thresholds_for("predictor") with kind "q4").
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from powerinfer_jax import ops
from powerinfer_jax.models.layers import Module, op_impl
from powerinfer_jax.ops import nibble_rows
from powerinfer_jax.sparsity.predictor import COST_BYTES_PER_PARAM, mask_quality

class NibbleRows(nnx.Variable):
    """Packed 4-bit rows (not trained, not a checkpoint parameter)."""


class NibblePredictor(Module):
    def __init__(self, q, dm, b_up, *, activation: str, kernels: str = "xla"):
        self.q = NibbleRows(jnp.asarray(q, jnp.uint8))  # [F, G, P * 32]
        self.dm = NibbleRows(jnp.asarray(dm, jnp.float16))  # [F, G, 4P]
        self.b_up = None if b_up is None else NibbleRows(jnp.asarray(b_up, jnp.float32))
        self.activation = activation
        self.kernels = kernels

    @classmethod
    def from_ffn(cls, ffn, *, kernels: str = "xla") -> "NibblePredictor":
        """Quantize an (unplaced) FFN's gate and up rows."""
        if ffn.placed:
            raise ValueError("NibblePredictor.from_ffn: expected an unsplit FFN, got a placed one "
                             "(attach predictors before placement)")
        lins = [ffn.up] if ffn.gate is None else [ffn.gate, ffn.up]
        q, dm = nibble_rows.quantize(np.stack([_float_rows(l) for l in lins], axis=1))
        b = None if ffn.up.bias is None else ffn.up.bias[...]
        return cls(q, dm, b, activation=ffn.activation, kernels=kernels)

    def __call__(self, x_btd, *, signed: bool = False):
        """Estimated |a_i| [..., F] (a_i with signed=True: the gate_up="q4" coefficients)."""
        return ops.q4_scores(x_btd, self.q[...], self.dm[...],
                             None if self.b_up is None else self.b_up[...],
                             activation=self.activation, signed=signed,
                             impl=op_impl(self.kernels))

    def sparse_ffn(self, x_btd, w_down_t, b_down, *, threshold: float):
        """The q4 FFN (SparsityConfig.gate_up == "q4"): these estimates as the activations, in one
        custom call (ops.q4_sparse_ffn). Returns (y, n_active)."""
        return ops.q4_sparse_ffn(x_btd, self.q[...], self.dm[...], w_down_t,
                                 None if self.b_up is None else self.b_up[...], b_down,
                                 threshold=threshold, activation=self.activation, impl="ffi")

    def permute(self, perm) -> None:
        self.q.set_value(self.q[...][perm])
        self.dm.set_value(self.dm[...][perm])
        if self.b_up is not None:
            self.b_up.set_value(self.b_up[...][perm])

    def bytes_per_token(self) -> int:
        return int(self.q[...].nbytes + self.dm[...].nbytes)


def _float_rows(lin) -> np.ndarray:
    """A Linear's weight [out, in] as float32 (the file's blocks dequantized when quantized)."""
    if lin.qtype is None:
        return np.asarray(lin.weight[...], np.float32)
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    return quants.dequantize(np.asarray(lin.weight[...]), lin.kernel_qtype)[:, :lin.d_in]


def layer_scores(model, x_lnd: np.ndarray, *, batch: int = 512, progress: bool = False,
                 desc: str = "q4 scores") -> np.ndarray:
    """[L, N, F] float32 scores of q4 predictors built from `model`'s (unplaced) FFNs on their
    inputs x_lnd [L, N, D] (a progress bar over layers with `progress`: a layer compiles once)."""
    import jax

    out = []
    layers = model.layers
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc=desc, unit="layer")
    for l, layer in enumerate(layers):
        fn = jax.jit(NibblePredictor.from_ffn(layer.ffn, kernels=model.kernels).__call__)
        out.append(np.concatenate([np.asarray(fn(jnp.asarray(x_lnd[l, i:i + batch])))
                                   for i in range(0, x_lnd.shape[1], batch)], axis=0))
    return np.stack(out)


def calibrate_thresholds(scores_lnf: np.ndarray, target: float) -> np.ndarray:
    """[L] per layer the score quantile that leaves `target` of the neurons inactive."""
    return np.quantile(scores_lnf.reshape(scores_lnf.shape[0], -1), target, axis=1)


def quality(scores_lnf: np.ndarray, thresholds: np.ndarray, mask_lnf: np.ndarray) -> dict:
    """Per-layer recall, precision and predicted sparsity of scores > threshold vs the true mask."""
    return mask_quality(scores_lnf > np.asarray(thresholds)[:, None, None], mask_lnf)


def cost(*, d_model: int, d_ff: int, gated: bool) -> dict:
    """Bytes and multiply-adds per token of one layer's q4 predictor vs its dense FFN (at
    predictor.COST_BYTES_PER_PARAM, like every predictor's report)."""
    g = 2 if gated else 1
    p = nibble_rows.num_pairs(d_model)
    pred_bytes = d_ff * g * (p * nibble_rows.PAIR_BYTES + 4 * p * 2)
    ffn_params = (g + 1) * d_model * d_ff
    return {"bytes_fraction": pred_bytes / (COST_BYTES_PER_PARAM * ffn_params),
            "flops_fraction": g * d_model * d_ff / ffn_params,
            "predictor_bytes_per_token": pred_bytes}
