"""The tests' one tolerance table and one comparison helper.

`assert_close(got, want, tol)` compares float arrays (or scalars) elementwise,
|got - want| <= atol + rtol * |want|, with `tol` either a weight dtype (a custom call against its
pure-jnp reference at that dtype: the default) or the name of an entry of TOL. An entry says why
its bound is what it is; a comparison that needs another bound gets its own entry here, with its
reason, rather than numbers at the call. `scaled` entries give atol as a fraction of max |want|,
for outputs whose magnitude depends on the random model (quantized weights, whole-model logits).

Scalar expectations about a measured quantity (a perplexity, a sparsity fraction) are claims of
their test, not rounding allowances: they stay as `pytest.approx` where they are stated.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float
    why: str
    scaled: bool = False  # atol is a fraction of max |want|


# A custom call against its pure-jnp reference, by weight dtype: both sides widen the same stored
# weights to float32 and accumulate in float32, so only the summation order and the exp/tanh
# implementations differ.
_KERNEL = "kernel vs its jnp reference: same widened weights, float32 sums in another order"

TOL: dict[str, Tol] = {
    "float32": Tol(2e-5, 2e-5, _KERNEL),
    "bfloat16": Tol(2e-5, 2e-5, _KERNEL),
    "float16": Tol(2e-5, 2e-5, _KERNEL),
    # -- the same float32 math, grouped or ordered differently
    "regrouped": Tol(1e-5, 1e-5, "the same float32 operations in another grouping: cached vs "
                     "uncached decode, a permuted or placed model (hot and cold rows in two "
                     "calls) vs the original, the scanned vs the unrolled forward, one predictor "
                     "layer vs the stacked call, routed vs dense experts, the attention custom "
                     "call vs XLA's"),
    "ffn_vs_float64": Tol(1e-5, 2e-5, "one block's output against a float64 numpy FFN over the "
                          "predicted neurons: float32 rounding of D-long sums"),
    "sparse_vs_dense_logits": Tol(1e-5, 5e-5, "all-active predictors vs the dense model: the "
                                  "sparse call's per-neuron accumulation against the dense "
                                  "matvec's, seen up to 1.4e-5 on logits of magnitude ~3 in CI"),
    "sharded_float32": Tol(3e-5, 3e-5, "a model sharded over devices vs one device: the partial "
                           "sums of tensor-parallel matmuls are added in another order"),
    "sharded_bfloat16": Tol(2e-3, 2e-3, "as sharded_float32 with bfloat16 weights: the partial "
                            "products round to bfloat16's 8 bits before they are summed"),
    "norms": Tol(2e-6, 2e-6, "RMS/layer norm against float64 numpy: a handful of ulps"),
    "ulps": Tol(1e-6, 0.0, "a few float32 operations on both sides (a softmax over the top k, "
                "rope frequencies from the config): one or two ulps, no absolute floor"),
    # -- float32 along another path
    "other_path": Tol(1e-4, 1e-4, "float32 computed along another path: a GPU kernel (FMA, "
                      "reduction trees), a whole model end to end, another library's dequantize, "
                      "another thread split, bfloat16 weights widened in another order"),
    "dot_products": Tol(1e-4, 1e-5, "long float32 dot products (q4 scores, expert FFNs) against "
                        "a float64 numpy twin, the jnp twin or another thread split: relative "
                        "error of the sums, an absolute floor for values near zero"),
    "moe_dense_execution": Tol(1e-5, 1e-4, "an MoE model's logits with every expert run on every "
                               "token (the reference execution) vs routed: the same sums, "
                               "gathered in another order"),
    "gpu_kernel": Tol(2e-4, 2e-4, "the CUDA hybrid call against the jnp reference: FMA "
                      "contraction and the GPU's reduction order"),
    # -- against other implementations (transformers, the GGUF spec)
    "hf_logits": Tol(1e-4, 2e-5, "llama and OPT logits against transformers' float32 torch on "
                     "tiny random models: other matmul and softmax kernels over two layers"),
    "family_logits": Tol(1e-4, 5e-5, "the model families (Falcon, Gemma, Qwen, MoE, ...) against "
                         "transformers, or a family's sparse mode against its dense path: more "
                         "ops per layer (parallel blocks, layer norms, soft-caps) than hf_logits"),
    "gelu_tanh": Tol(1e-7, 0.05, "Falcon with exact-erf GELU run with our tanh form: the "
                     "approximation's error through the model, 5% of max |logit|", scaled=True),
    "loaded_weights": Tol(1e-6, 1e-6, "a tensor as we load it (GGUF or safetensors, float16 "
                          "widened, transposed) against transformers' copy"),
    "dequantize": Tol(1e-6, 1e-7, "our dequantizer against the spec's per-block decode: "
                      "d * q (- m) in float32 on both sides, contraction differences only"),
    "float64": Tol(1e-12, 1e-12, "float64 arithmetic that is exact up to reassociation"),
    "float_equal": Tol(1e-7, 0.0, "the same arithmetic on both sides (frequencies from counts, "
                       "routing weights that sum to k): numpy's default bound"),
    # -- quantized weights: error relative to max |y|
    "quantized": Tol(0.0, 5e-6, "a quantized kernel vs its reference: the same dequantized "
                     "weights times the same rounded activations, only the summation order (and "
                     "s * sum(u q) vs sum(s u) q) differs: measured < 1e-6 of max |y|",
                     scaled=True),
    "moe_quantized": Tol(0.0, 2e-5, "the quantized MoE FFN vs its reference: as quantized, and "
                         "the hidden activations are rounded to int8 after a float silu on both "
                         "sides, so a value on a rounding edge can move one step; measured < "
                         "3e-6 of max |y|", scaled=True),
    "powerinfer_predictor": Tol(1e-5, 1e-5, "PowerInfer's Q4_0 predictor through the qlinear call vs "
                        "the reference's two qlinears: as quantized, over two layers",
                        scaled=True),
    "quantized_layouts": Tol(0.0, 1e-4, "one quantized FFN read through other layouts "
                             "(interleaved, rows, down groups): activation rounding per layout",
                             scaled=True),
    "moe_placed": Tol(0.0, 2e-2, "an MoE model placed hot/cold vs unplaced: its hot experts run "
                      "as floats (float activations), its cold ones as the file's blocks with "
                      "int8 activations, so each routed token moves by the activation rounding "
                      "of the part that changed sides; measured <= 0.9% of max |logit|",
                      scaled=True),
    "quantized_model": Tol(0.0, 2e-3, "a quantized model's custom calls vs the jnp references "
                           "on the same blocks (dequantize + the same 8-bit activation "
                           "rounding): an activation on a rounding edge moves one step, and "
                           "that carries through the layers", scaled=True),
    "sparse_model_logits": Tol(1e-7, 1e-5, "oracle and predictor modes at every neuron active vs "
                               "dense, on a float16 model: float32 reordering, relative to the "
                               "logits' scale", scaled=True),
    "q4_estimate": Tol(1e-7, 0.02, "gate/up read from the q4 estimate instead of the weights: "
                       "4-bit weights, within 2% of max |y|", scaled=True),
    # -- approximations: how far a cheaper computation may be from the exact one
    "bf16_cache": Tol(2e-2, 2e-2, "attention with a bfloat16 KV cache vs float32: the new key "
                      "rounds to bfloat16 after rope"),
    "bf16_weights": Tol(1e-7, 0.1, "bfloat16 weights vs float32 on the llama test model: "
                        "logits within 0.1 (and the same argmax, checked beside it)"),
    "bf16_model": Tol(0.05, 0.05, "a model with its matrices cast to bfloat16 vs float32"),
    "one_neuron": Tol(0.0, 0.05, "a sparse mode whose active set differs by one neuron (a flip "
                      "or a swap at the threshold): logits held to one neuron's contribution"),
    "predictor_ties": Tol(1e-7, 2e-3, "an exact-score predictor vs the oracle: float32 ties at "
                          "the threshold flip at most one neuron per token"),
    "quantiles": Tol(1e-7, 0.02, "a rewritten frequency table keeps its source's distribution: "
                     "deciles within 0.02"),
    "batch_quantile": Tol(1e-5, 0.03, "a per-batch quantile threshold zeroes ~75% of the "
                          "activations in every layer, within 3% (ties and the batch sample)"),
    "hot_bytes": Tol(1e-5, 0.01, "hot neuron counts from a placement report's fractions "
                     "(rounded to 4 digits) vs its byte counts"),
    # -- self-distillation (powerinfer_jax.sparsify)
    "trained_logits": Tol(1e-4, 2e-4, "a student's logits two ways: the runtime's threshold "
                          "mode vs the training forward with FATReLU, or the exported model vs "
                          "transformers on the export: float32 through other kernels"),
    "teacher_cache": Tol(1e-3, 2e-3, "top-k teacher log-probs read back from the cache (stored "
                         "as float16) vs computed"),
    "training_aux": Tol(1e-7, 1e-5, "the scanned forward's auxiliary outputs (zero fractions, "
                        "L1 terms, hidden MSE) vs the unrolled forward's"),
    "weight_updates": Tol(1e-4, 1e-6, "a gradient step's weight change, scanned vs unrolled: "
                          "float32 gradients summed in another order, tiny absolute changes"),
    "ridge": Tol(1e-7, 1e-5, "a ridge solve (ridge 1e-9) against the exact rows of a "
                 "noise-free system"),
    "ridge_untouched": Tol(1e-7, 1e-6, "a row the data never activates keeps its old value up "
                           "to the ridge's pull (ridge 1e-6)"),
}


def _entry(tol) -> Tol:
    if isinstance(tol, Tol):
        return tol
    if isinstance(tol, str) and tol in TOL:
        return TOL[tol]
    try:
        name = np.dtype(tol).name
    except TypeError:
        name = None
    if name not in TOL:
        raise KeyError(f"tolerance: expected a weight dtype or one of {sorted(TOL)}, got {tol!r}")
    return TOL[name]


def assert_close(got, want, tol="float32", *, err_msg: str = "") -> None:
    """|got - want| <= atol + rtol * |want| elementwise, with the bound of `tol` (see the table)."""
    t = _entry(tol)
    got, want = np.asarray(got), np.asarray(want)
    atol = t.atol * float(np.abs(want).max(initial=0.0)) if t.scaled else t.atol
    np.testing.assert_allclose(got, want, rtol=t.rtol, atol=atol, err_msg=err_msg)
