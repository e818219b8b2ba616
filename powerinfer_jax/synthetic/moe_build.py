"""A synthetic mixture-of-experts model (SYNTHETIC: random weights, for speed only; it knows
no language) whose routers pick each layer's experts with prescribed frequencies on text, and
whose ReLU experts, optionally, fire their neurons with prescribed frequencies inside.

How expert e is made to be routed on a fraction p_e of tokens (top-k of softmax(router . x)):
  * build.py's reserved bias block: the embeddings hold a constant at residual dim 0, no layer
    writes dims [0, 32), so every FFN input has x_0 > 0, a bias every token carries.
  * The router (float32 in the file, so exact) is random plus a bias column: r_e = R_e + b_e e_0.
  * Expert e is among a token's k largest logits iff R_e . x + b_e x_0 > m_e(x), the k-th
    largest of the other experts' logits. Given the others' biases, b_e = the p_e-quantile of
    (m_e(x_t) - R_e . x_t) / x_t0 over the calibration tokens routes e to exactly p_e of them
    (build._column_quantiles). Sweeps over the experts (each setting one bias with the others
    fixed, Gauss-Seidel) until every expert is within one token of its frequency.
  * The frequencies p_e: profile.power_law over the E experts with mean k / E (every token
    picks k), a stated hot share ("80% of routings to 25% of experts"), the order of experts
    seeded per layer.
  * ReLU experts (a = relu(gate . x) * (up . x)): as build.py's dense ReLU neurons, each gate row
    gets a bias column, set on the tokens routed to its expert, so neuron i of expert e fires on
    q_ei of them; q_e. a power law with mean 1 - neuron sparsity.
Weights: attention as build.py's (o rows over the reserved dims zero), experts' gate and up
random normal / sqrt(D), down integers in [-8, 7] times a power of two (build.down_integers:
exact in Q4_0 along the neurons, llama.cpp's ffn_down_exps rows), zero over the reserved dims.
The calibration forward runs the engine's own attention (models.transformer.Block, float32 XLA)
and the experts in float32 on the weights as stored (dequantized), layer by layer.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from powerinfer_jax.checkpoint import quants
from powerinfer_jax.checkpoint.base import expected_shapes
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import check, fail
from powerinfer_jax.models.layers import shapes_only
from powerinfer_jax.models.transformer import Block
from powerinfer_jax.ops.reference import gated_activate
from powerinfer_jax.synthetic.build import (EMBED_CONSTANT, F32, FFN_OUT_STD, Q_VAR, RESERVED,
                                            Tensor, _bias_for, _q4_exact_scalar, _rng,
                                            attention_weights, down_integers, stored)
from powerinfer_jax.synthetic.profile import Locality, hot_share, power_law

ROUTER_STD = 1.0  # std of R_e . x on unit-RMS inputs (sets how peaked the softmax weights are)
MAX_SWEEPS = 60  # router calibration sweeps, at most (tests converge in < 30)
ARCHS = ("olmoe", "qwen3moe")
SHAPES = {  # public configs (config.json) of the models whose shapes these are
    "olmoe-1b-7b": dict(arch="olmoe", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16,
                        head_dim=128, d_ff=1024, n_experts=64, n_experts_used=8,
                        vocab_size=50304, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    "qwen3-30b-a3b": dict(arch="qwen3moe", d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, d_ff=768, n_experts=128, n_experts_used=8,
                          vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6),
}


def config_for(fields: dict, *, vocab_size: int, activation: str = "silu",
               bos: int | None = None, eos: tuple[int, ...] = ()) -> tuple[str, ModelConfig]:
    """(GGUF arch, ModelConfig) of an MoE shape's fields (`SHAPES`, overridden); the vocabulary
    is the shape's or the tokenizer's, whichever is larger (the tokenizer's padded)."""
    f = dict(fields)
    arch = f.pop("arch")
    check(arch in ARCHS, "synthetic MoE arch", f"one of {list(ARCHS)}", arch)
    e, k = f["n_experts"], f["n_experts_used"]
    check(isinstance(e, int) and e >= 4, "--n-experts", "an integer >= 4", e)
    check(isinstance(k, int) and 1 <= k <= e, "--top-k", f"an integer in [1, --n-experts={e}]",
          k, "a token cannot pick more experts than there are")
    f["vocab_size"] = max(f.get("vocab_size", 0), vocab_size)
    family = dict(qk_norm=True) if arch == "qwen3moe" else dict(qk_norm_full=True)
    return arch, ModelConfig(
        arch="llama", **f, activation=activation, gated=True, bias=False, norm="rms",
        positions="rope", tie_embeddings=False, norm_topk_prob=arch == "qwen3moe",
        bos_token_id=bos, eos_token_ids=eos, **family)


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """What to build: the shape (`config`, activation silu or relu), the experts' routing
    locality (its sparsity is 1 - k / E), the neurons' inside ReLU experts."""

    config: ModelConfig
    experts: Locality
    neurons: Locality | None = None  # ReLU experts only
    seed: int = 0
    qtype: str = "Q4_0"

    def __post_init__(self):
        c = self.config
        check(c.n_experts > 0, "synthetic MoE config", "n_experts > 0", c.n_experts)
        check(c.activation in ("silu", "relu"), "--activation", "'silu' or 'relu'", c.activation)
        check((self.neurons is not None) == (c.activation == "relu"), "--sparsity",
              "given exactly when --activation relu (the neuron sparsity inside ReLU experts)",
              None if self.neurons is None else self.neurons.sparsity)
        want = 1.0 - c.n_experts_used / c.n_experts
        check(abs(self.experts.sparsity - want) < 1e-12, "MoeSpec.experts.sparsity",
              f"1 - top_k / n_experts = {want}", self.experts.sparsity)
        check(self.qtype in quants.QUANTIZABLE_TYPES, "--qtype",
              f"one of {list(quants.QUANTIZABLE_TYPES)}", self.qtype)
        block = quants.block_size(self.qtype)[0] if self.qtype in quants.QUANTIZED_TYPES else 1
        unit = max(block, RESERVED)
        for name in ("d_model", "d_ff"):
            v = getattr(c, name)
            check(v % unit == 0 and v > RESERVED, f"--{name.replace('_', '-')}",
                  f"a multiple of {unit} above {RESERVED} (the {self.qtype} block and the "
                  "reserved bias block)", v)
        check(c.q_dim % block == 0, "--n-heads * --head-dim", f"a multiple of {block}", c.q_dim)
        check(not c.qk_norm_full or (c.n_kv_heads == c.n_heads and c.q_dim == c.d_model),
              "--n-kv-heads", "--n-heads, with --n-heads * --head-dim = --d-model, for olmoe "
              "(llama.cpp's olmoe norms k over d_model values)", c.n_kv_heads)


def expert_locality(config: ModelConfig, hot_fraction: float, hot_share: float | None
                    ) -> Locality:
    """The routing's Locality: mean frequency k / E; `hot_share` None -> 0.8, or 95% of the most
    the cap allows when that is lower (many experts per token)."""
    sparsity = 1.0 - config.n_experts_used / config.n_experts
    if hot_share is None:
        return Locality.feasible(sparsity, hot_fraction)
    return Locality(sparsity, hot_fraction, hot_share)


def routing_frequencies(spec: MoeSpec) -> np.ndarray:
    """[L, E] prescribed routing frequencies (each row sums to k): the power law in a seeded
    expert order per layer."""
    c = spec.config
    law = power_law(c.n_experts, spec.experts)
    law *= c.n_experts_used / law.sum()  # exactly k per token (the solver's mean is to ~1e-6)
    rng = np.random.default_rng([spec.seed, 0xE0E])
    return np.stack([law[rng.permutation(c.n_experts)] for _ in range(c.n_layers)])


def neuron_frequencies(spec: MoeSpec, layer: int) -> np.ndarray:
    """[E, F] prescribed firing frequencies of a layer's ReLU experts' neurons."""
    c = spec.config
    law = power_law(c.d_ff, spec.neurons)
    rng = np.random.default_rng([spec.seed, 0x4E, layer])
    return np.stack([law[rng.permutation(c.d_ff)] for _ in range(c.n_experts)])


def route(logits: np.ndarray, k: int) -> np.ndarray:
    """[N, k] expert ids: the k largest logits per token (ties do not occur on these floats)."""
    return np.argpartition(-logits, k - 1, axis=1)[:, :k]


def _largest(a: np.ndarray, m: int) -> np.ndarray:
    """[rows, m] each row's m largest values, in decreasing order."""
    return np.sort(np.partition(a, a.shape[1] - m, axis=1)[:, -m:], axis=1)[:, ::-1]


def _quantile(w: np.ndarray, p: float) -> np.float32:
    """build._column_quantiles of one column (the same float32, bit for bit), by a partition
    at the two entries it reads instead of a sort."""
    n = w.size
    c = int(np.clip(np.round(float(p) * n), 0, n))  # tokens that fire (float64, as there)
    s = np.partition(w, (max(c - 1, 0), min(c, n - 1)))
    lo = s[c - 1] if c > 0 else s[0] - np.float32(1.0)
    hi = s[c] if c < n else lo + np.float32(1.0)
    return np.float32(np.float32(0.5) * (lo + hi))


def router_bias(scores: np.ndarray, x0: np.ndarray, freq: np.ndarray, k: int
                ) -> tuple[np.ndarray, int]:
    """(biases b [E], sweeps run) with frac(e in top-k of scores + b x0) = freq[e] over the
    tokens, each expert within one token (module docstring).

    Setting b_j needs, per token, the k-th largest of the other experts' logits: the token's
    k-th largest logit if j's is not among its k largest, else its (k+1)-th. The logits and
    each token's k+1 largest (`top`) are kept as the biases change: b_j rewrites column j; a
    token whose j logit stays in or enters its top k+1 swaps it in there (everything outside
    is at most the (k+1)-th), and only the tokens whose j logit leaves it are partitioned
    again (a few a step once the biases settle). O(N) a step but those tokens, instead of
    O(N E) (the logits recomputed and partitioned for every step); the same b, bit for bit."""
    n, e = scores.shape
    b = np.zeros(e, np.float32)
    if k >= e:  # every expert on every token, whatever the biases
        return b, 1
    # by expert (a column's step reads and writes contiguous memory)
    by_expert = np.ascontiguousarray(scores.T)  # [E, N]
    logits = by_expert + b[:, None] * x0[None, :]  # [E, N] float32, row j as b_j changes
    top = _largest(logits.T, k + 1)  # [N, k+1]
    for sweep in range(1, MAX_SWEEPS + 1):
        for j in range(e):
            col, kth, last = logits[j], top[:, k - 1], top[:, k]
            others = np.where(col >= kth, last, kth)  # k-th largest of the others
            b[j] = _quantile((others - by_expert[j]) / x0, freq[j])
            new = by_expert[j] + b[j] * x0
            was, now = col >= last, new >= last
            left = np.flatnonzero(was & ~now)
            stay = np.flatnonzero(now)  # in top k+1 after: j's value swapped in
            if stay.size:
                rows = top[stay]
                slot = np.where(was[stay], np.argmax(rows == col[stay, None], axis=1), k)
                rows[np.arange(stay.size), slot] = new[stay]
                top[stay] = np.sort(rows, axis=1)[:, ::-1]
            logits[j] = new
            if left.size:
                top[left] = _largest(logits[:, left].T, k + 1)
        got = np.bincount(route(logits.T, k).ravel(), minlength=e) / n
        if np.max(np.abs(got - freq)) * n <= 1.0 + 1e-9:
            return b, sweep
    return b, MAX_SWEEPS


@dataclasses.dataclass
class MoeLayer:
    """One finished layer: canonical tensors, and the frequencies it was calibrated to."""

    tensors: dict[str, Tensor]
    routed: np.ndarray  # [E] routing frequency on the calibration tokens
    fired: np.ndarray | None  # [E, F] ReLU experts: neuron frequency among each expert's tokens


def _set(module, name: str, values: np.ndarray) -> None:
    *path, last = name.split(".")
    for part in path:
        module = getattr(module, part)
    getattr(module, last).set_value(jnp.asarray(values))


def _experts_forward(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate, up, act_name,
                     fired_out: np.ndarray | None = None):
    """Per (token, slot) activations: a list over experts of (rows of x, slots, act [n_e, F])."""
    out = []
    for e in range(gate.shape[0]):
        tok, slot = np.nonzero(ids == e)
        if tok.size == 0:
            out.append((tok, slot, None))
            continue
        xe = x[tok]
        act = np.asarray(gated_activate(act_name, jnp.asarray(xe @ gate[e].T),
                                        jnp.asarray(xe @ up[e].T)))
        if fired_out is not None:
            fired_out[e] = (act != 0).mean(axis=0)
        out.append((tok, slot, act))
    return out


def build(spec: MoeSpec, calib_ids: np.ndarray, *, on_global: Callable[[str, Tensor], None],
          on_layer: Callable[[int, MoeLayer], None],
          progress: Callable[[str], None] = lambda m: None) -> np.ndarray:
    """Generate the model layer by layer on calibration token ids [S, T] (real text). Calls
    on_global for tok_embed, final_norm.scale and lm_head first, then on_layer(i, MoeLayer) per
    layer, each tensor in checkpoint.base.expected_shapes' order. Returns the prescribed
    routing frequencies [L, E]."""
    c, seed, qt = spec.config, spec.seed, spec.qtype
    d, f, e_n, k = c.d_model, c.d_ff, c.n_experts, c.n_experts_used
    freq = routing_frequencies(spec)
    emb = _rng(seed, "tok_embed").standard_normal((c.vocab_size, d), np.float32)
    emb[:, :RESERVED] = 0.0
    emb[:, 0] = EMBED_CONSTANT
    tok = stored(emb, qt)
    on_global("tok_embed", tok)
    on_global("final_norm.scale", Tensor(np.ones(d, np.float32)))
    head = _rng(seed, "lm_head").standard_normal((c.vocab_size, d), np.float32) * d ** -0.5
    on_global("lm_head", stored(head, qt))
    del head
    h = jnp.asarray(tok.values[calib_ids])  # [S, T, D]
    del emb, tok
    positions = jnp.broadcast_to(jnp.arange(h.shape[1]), h.shape[:2])
    shapes = expected_shapes(c)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        with shapes_only():
            block = Block(c, i, dtype=F32, rngs=None, kernels="xla")
        w: dict[str, Tensor] = {}
        for name, shape in shapes.items():
            if name.startswith(p) and len(shape) == 1:
                w[name[len(p):]] = Tensor(np.ones(shape, np.float32))  # norm scales
        w.update(attention_weights(c, seed, p, qt))
        for name, t in w.items():
            _set(block, name, t.values)
        h = block.attention_residual(h, positions)
        x = np.asarray(block.ffn_norm(h)).reshape(-1, d)  # [N, D] the FFN's inputs
        x0 = x[:, 0]
        if not np.all(x0 > 0):
            fail("synthetic calibration", "x_0 > 0 on every token (the bias block)",
                 f"min {x0.min():.3g} at layer {i}")
        # the router: random, then each expert's bias column calibrated
        router = _rng(seed, p + "router").standard_normal((e_n, d), np.float32) * (
            ROUTER_STD * d ** -0.5)
        router[:, :RESERVED] = 0.0
        scores = x @ router.T  # [N, E]
        bias, sweeps = router_bias(scores, x0, freq[i], k)
        router[:, 0] = bias
        logits = x @ router.T
        ids = route(logits, k)  # [N, k]
        routed = np.bincount(ids.ravel(), minlength=e_n) / x.shape[0]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        weights = np.take_along_axis(probs, ids, axis=1)  # [N, k]
        if c.norm_topk_prob:
            weights /= weights.sum(axis=1, keepdims=True)
        # the experts
        rng = _rng(seed, p + "experts")
        gate_vals = rng.standard_normal((e_n * f, d), np.float32) * d ** -0.5
        up = stored(rng.standard_normal((e_n * f, d), np.float32) * d ** -0.5, qt)
        fired = None
        if c.activation == "relu":  # each neuron's bias column, on its expert's tokens
            gate_vals[:, :RESERVED] = 0.0
            low = stored(gate_vals, qt).values.reshape(e_n, f, d)
            q = neuron_frequencies(spec, i)
            for e in range(e_n):
                tok_e = np.nonzero((ids == e).any(axis=1))[0]
                if tok_e.size:
                    gate_vals[e * f:(e + 1) * f, 0] = _q4_exact_scalar(
                        _bias_for(x[tok_e] @ low[e].T, x0[tok_e], q[e]))
                else:  # never routed in calibration: fire never (set on no token)
                    gate_vals[e * f:(e + 1) * f, 0] = -1.0
            del low
            fired = np.zeros((e_n, f))
        gate = stored(gate_vals, qt)
        del gate_vals
        gate3, up3 = gate.values.reshape(e_n, f, d), up.values.reshape(e_n, f, d)
        parts = _experts_forward(x, ids, weights, gate3, up3, c.activation, fired)
        ssq = sum(float((weights[tok, slot][:, None] ** 2 * act.astype(np.float64) ** 2).sum())
                  for tok, slot, act in parts if act is not None) / x.shape[0]
        s = 2.0 ** np.round(np.log2(FFN_OUT_STD / max(np.sqrt(Q_VAR * ssq), 1e-30)))
        down_t = np.stack([down_integers(f, d, seed, f"{p}down.{e}") for e in range(e_n)]
                          ).astype(np.float32) * np.float32(s)  # [E, F, D]
        y = np.zeros_like(x)
        for e, (tok, slot, act) in enumerate(parts):
            if act is not None:
                np.add.at(y, tok, weights[tok, slot][:, None] * (act @ down_t[e]))
        h = h + jnp.asarray(y.reshape(h.shape))
        w.update({"ffn.router.weight": Tensor(router),
                  "ffn.experts.gate.weight": Tensor(gate3, gate.blocks, qt),
                  "ffn.experts.up.weight": Tensor(up3, up.blocks, qt),
                  "ffn.experts.down_t.weight": Tensor(down_t, None, "exact")})
        del parts, y, gate, up
        on_layer(i, MoeLayer({p + n: t for n, t in w.items()}, routed, fired))
        msg = (f"layer {i + 1}/{c.n_layers}: routing max error "
               f"{np.max(np.abs(routed - freq[i])) * x.shape[0]:.0f} tokens of {x.shape[0]} "
               f"({sweeps} sweeps), hot share {hot_share(routed, spec.experts.hot_fraction):.3f} "
               f"(prescribed {spec.experts.hot_share:.3f}), down scale 2^{int(np.log2(s))}")
        if fired is not None:
            mean_fired = float((fired.mean(axis=1) * routed).sum() / routed.sum())
            msg += f", neuron sparsity {1 - mean_fired:.3f} (prescribed {spec.neurons.sparsity})"
        progress(msg)
    return freq

