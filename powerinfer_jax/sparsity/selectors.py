"""The selectors: how one FFN layer finds its active neurons (models.ffn.Selector).

Each holds its own per-layer threshold (a static float) and, where it has one, its predictor (an
nnx Module, so its arrays move, permute and jit with the model):
  Oracle         |a_i| > threshold from the true activations (the quality upper bound)
  GateMagnitude  |act(gate_i . x)| > threshold, the gate computed densely (CATS-style)
  Scores         predictor(x)_i > threshold: any module mapping x [B, T, D] -> scores [B, T, F]
                 (the q4 estimate of |a_i|, the low-rank MLPs, a PowerInfer predictor)
  Q4Activations  the q4 estimates a_i are the activations themselves (--gate-up q4): only the
                 active neurons' down rows are read, in one fused custom call when unplaced
"""
from __future__ import annotations

from flax import nnx

from powerinfer_jax.models.ffn import Selection, Selector
from powerinfer_jax.models.qweights import MATVEC, ROWS

EVERY_NEURON = ((MATVEC, ROWS), (MATVEC, ROWS))  # the sparse call's oracle computes all gates


class Oracle(Selector):
    def __init__(self, threshold: float):
        self.threshold = float(threshold)

    def select(self, ffn, x_btd) -> Selection:
        return Selection("oracle", self.threshold)

    def layouts(self, ffn):
        return EVERY_NEURON

    def describe(self) -> dict:
        return {"selector": "oracle", "threshold": self.threshold}


class GateMagnitude(Selector):
    def __init__(self, threshold: float):
        self.threshold = float(threshold)

    def select(self, ffn, x_btd) -> Selection:
        return Selection("scores", self.threshold, ffn.gate_magnitude(x_btd))

    def describe(self) -> dict:
        return {"selector": "gate_magnitude", "threshold": self.threshold}


class Scores(Selector):
    """Active where predictor(x) > threshold (low-rank predictors fold their decision threshold
    into the output bias and run at 0)."""

    def __init__(self, predictor: nnx.Module, threshold: float = 0.0):
        self.predictor = predictor
        self.threshold = float(threshold)

    def select(self, ffn, x_btd) -> Selection:
        return Selection("scores", self.threshold, self.predictor(x_btd))

    def permute(self, perm) -> None:
        self.predictor.permute(perm)

    def describe(self) -> dict:
        return {"selector": f"scores({type(self.predictor).__name__})",
                "threshold": self.threshold}


class Q4Activations(Selector):
    """The q4 predictor's signed estimates a_i as the activations (sparsity/nibble_predictor.py): a
    float model's neurons whose 4-bit estimate clears the threshold contribute that estimate,
    and only their down rows are read (--gate-up q4)."""

    def __init__(self, predictor, threshold: float):
        self.predictor = predictor  # a NibblePredictor
        self.threshold = float(threshold)

    def select(self, ffn, x_btd) -> Selection:
        ffn.require_no_gate_floor("--gate-up q4 (4-bit estimates as the activations)")
        return Selection("activations", self.threshold, self.predictor(x_btd, signed=True))

    def fused(self, ffn, x_btd):
        ffn.require_no_gate_floor("--gate-up q4 (4-bit estimates as the activations)")
        return self.predictor.sparse_ffn(x_btd, ffn.down_t.weight[...],
                                         None if ffn.down_t.bias is None else ffn.down_t.bias[...],
                                         threshold=self.threshold)

    def permute(self, perm) -> None:
        self.predictor.permute(perm)

    def describe(self) -> dict:
        return {"selector": "q4_activations", "threshold": self.threshold}
