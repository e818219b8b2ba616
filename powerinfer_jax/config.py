"""Frozen, validated configuration dataclasses.

Every config is hashable (so it can be a static argument of `jax.jit`) and validates itself in
`__post_init__`; errors follow the project rule "<what>: expected <rule>, got <value>".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

from powerinfer_jax.errors import check as _check
from powerinfer_jax.errors import check_choice as _check_choice
from powerinfer_jax.errors import check_positive_int as _check_positive

Activation = Literal["silu", "relu", "gelu", "drelu"]
NormType = Literal["rms", "layer"]
PositionScheme = Literal["rope", "learned"]

ACTIVATIONS = ("silu", "relu", "gelu", "drelu")
NORM_TYPES = ("rms", "layer")
POSITION_SCHEMES = ("rope", "learned")
# RopeScaling.kind: HF's rope_type names (transformers modeling_rope_utils), plus "factors": per
# frequency divisors given as numbers (a GGUF's rope_freqs tensor, llama.cpp's freq_factors)
ROPE_SCALINGS = ("linear", "llama3", "yarn", "factors")
PREDICTOR_KINDS = ("q4", "lowrank")
GATE_UP_SOURCES = ("full", "q4")  # SparsityConfig.gate_up
DTYPES = ("float32", "bfloat16")
KERNELS = ("auto", "xla", "ffi")
WEIGHTS = ("auto", "dtype")  # RuntimeConfig.weights
IMPLS = ("ffi", "reference")
OFFLOADS = ("hybrid", "layers")
# --neuron-cache: the eviction policies ("score": the router's, MoE models only)
NEURON_CACHES = ("lru", "lfu", "frequency", "score")

# Defaults every entry point shares (CLIs, powerinfer_jax.load, experiments).
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CONTEXT_CAP = 2048  # KV cache slots unless max_seq_len says otherwise
DEFAULT_TARGET_SPARSITY = 0.5  # threshold/predictor modes without a target
MAX_SEED = 2 ** 32 - 1  # seeds are folded into a 32-bit PRNG key
MAX_DECODE_BLOCK = 64  # decode steps per executable call (RuntimeConfig.decode_block), at most
# the server's request bodies (serve --max-body-bytes): a prompt of ~1M tokens is past any context
DEFAULT_MAX_BODY_BYTES = 4 << 20


# The names a SparsityConfig accepts: the built-in modes of sparsity/modes.py, and any mode a
# research script registers there (modes.register adds its name). Kept here so that a config is
# checked when it is made without this layer importing the sparsity layer above it.
_SPARSITY_MODES = ["dense", "auto", "oracle", "powerinfer", "threshold", "predictor", "input_magnitude",
                   "input_weighted"]


def sparsity_modes() -> tuple[str, ...]:
    """The sparsity modes a SparsityConfig accepts (sparsity/modes.py defines what each does)."""
    return tuple(_SPARSITY_MODES)


def add_sparsity_mode(name: str) -> None:
    """Accept `name` as a sparsity mode (called by sparsity.modes.register)."""
    if name not in _SPARSITY_MODES:
        _SPARSITY_MODES.append(name)




@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a model stretches its rotary frequencies past its training context (models/rope.py
    turns it into per-frequency inverse wavelengths, as transformers' `ROPE_INIT_FUNCTIONS`).

    kind: "linear" (every frequency / factor), "llama3" (low frequencies / factor, high ones
    kept, a smooth ramp between: Llama-3.1+), "yarn" (ramp between interpolation and
    extrapolation by rotations per `original_max_position`, cos/sin scaled by
    `attention_factor`), "factors" (frequency i / factors[i]: a GGUF's `rope_freqs`).
    Fields a kind does not use keep their defaults.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None = 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    factors: tuple[float, ...] = ()  # "factors"

    def __post_init__(self):
        _check_choice("RopeScaling.kind", self.kind, ROPE_SCALINGS,
                      "unknown scalings are refused, never ignored")
        _check(math.isfinite(self.factor) and self.factor > 0, "RopeScaling.factor",
               "a finite float > 0", self.factor)
        if self.kind in ("llama3", "yarn"):
            _check(isinstance(self.original_max_position, int) and self.original_max_position > 0,
                   f"RopeScaling.original_max_position ({self.kind})", "a positive integer",
                   self.original_max_position)
        if self.kind == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor > 0,
                   "RopeScaling.high_freq_factor", "> low_freq_factor > 0",
                   (self.low_freq_factor, self.high_freq_factor))
        if not isinstance(self.factors, tuple):
            object.__setattr__(self, "factors", tuple(float(f) for f in self.factors))
        if self.kind == "factors":
            _check(len(self.factors) > 0 and all(math.isfinite(f) and f > 0 for f in self.factors),
                   "RopeScaling.factors", "finite floats > 0, one per rotary frequency",
                   self.factors[:4])


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only transformer; one `Transformer` serves every family.

    Families map onto the switches below:
      llama family (Llama-2, Mistral, SmolLM2; ReLU-LLaMA/ProSparse = ReGLU): norm="rms",
        gated=True, bias=False, positions="rope", activation in {"silu", "relu"}.
      dReLU llama/mistral (TurboSparse, PowerInfer's "bamboo"): as llama with activation="drelu",
        a_i = relu(gate_i . x) * relu(up_i . x).
      OPT: norm="layer", gated=False, bias=True, positions="learned" with position_offset=2,
        activation="relu".
      Falcon (ReluFalcon): norm="layer", gated=False, positions="rope", bias per checkpoint,
        parallel_block=True (x + attn(attn_norm(x)) + ffn(ffn_norm(x)); a checkpoint with one
        shared norm loads it as both), multi-query/grouped KV heads, activation relu or gelu.
      Qwen2: llama + qkv_bias. Qwen3: llama + qk_norm. Mistral: llama + layer_windows.
      Gemma-2/3: llama with activation "gelu" (GeGLU, tanh form), embed_scale sqrt(D),
        post_norms, query_scale, attn/final soft-caps (Gemma-2), alternating sliding-window
        layers, qk_norm and rope_local_theta (Gemma-3); their (1 + w) norm weights arrive with
        the 1 added by the loader. Phi-3: llama (its fused tensors are split by the loader).
    parallel_block: attention and FFN read the same block input (Falcon, GPT-J style) instead of
      the FFN reading the residual after attention.
    fatrelu_thresholds: FATReLU (ProSparse's activation threshold shifting), one gate threshold
      per layer of a gated relu/drelu FFN: a neuron is off where its gate is at most the layer's
      threshold (sparsify's fatrelu variant writes them; config.json "fatrelu_threshold").
      (): plain ReLU.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    activation: Activation = "silu"
    gated: bool = True
    bias: bool = False
    norm: NormType = "rms"
    norm_eps: float = 1e-5
    positions: PositionScheme = "rope"
    rope_theta: float = 10000.0
    position_offset: int = 0
    tie_embeddings: bool = False
    parallel_block: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # ---- families beyond llama (defaults: off). Norm weights are what the norm multiplies by
    # (a Gemma checkpoint's (1 + w) arrives with the 1 added), so one RMSNorm serves every family.
    qkv_bias: bool = False  # q, k, v projections have biases, o has none (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma-3)
    post_norms: bool = False  # a norm on attention's and the FFN's outputs too (Gemma-2/3)
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(d_model))
    query_scale: float | None = None  # scores q.k times this; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax; 0: off
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c); 0: off
    # per layer: attend to the last W positions only (W > 0) or to all (0); () = all full
    layer_windows: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None  # full-attention layers' RoPE scaling
    rope_local_theta: float | None = None  # sliding-window layers' RoPE base, unscaled (Gemma-3)
    # q/k norms over the whole projection ([N * H], [K * H]) instead of per head (OLMoE)
    qk_norm_full: bool = False
    # ---- mixture of experts (models/moe.py; 0 experts: a dense FFN). Each layer's FFN is
    # n_experts gated FFNs of d_ff neurons; a router (softmax over the experts) picks
    # n_experts_used per token, weighted by their probabilities, renormalized to sum to 1 with
    # norm_topk_prob (Mixtral always, Qwen-MoE/OLMoE as their config says); d_ff_shared > 0:
    # a shared expert every token runs, scaled by sigmoid(shared_gate . x) (Qwen2-MoE)
    n_experts: int = 0
    n_experts_used: int = 0
    norm_topk_prob: bool = False
    d_ff_shared: int = 0
    fatrelu_thresholds: tuple[float, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "d_ff", "max_seq_len"):
            _check_positive(f"ModelConfig.{name}", getattr(self, name))
        _check_choice("ModelConfig.activation", self.activation, ACTIVATIONS)
        _check(self.gated or self.activation != "drelu", "ModelConfig.activation",
               "not 'drelu' on a non-gated FFN (dReLU applies ReLU to gate and up)",
               self.activation, "use 'relu'")
        _check_choice("ModelConfig.norm", self.norm, NORM_TYPES)
        _check_choice("ModelConfig.positions", self.positions, POSITION_SCHEMES)
        _check(self.n_heads % self.n_kv_heads == 0, "ModelConfig.n_heads",
               f"a multiple of n_kv_heads={self.n_kv_heads}", self.n_heads)
        _check(self.positions != "rope" or self.head_dim % 2 == 0, "ModelConfig.head_dim",
               "an even number with rotary positions", self.head_dim)
        _check(math.isfinite(self.norm_eps) and self.norm_eps > 0, "ModelConfig.norm_eps",
               "a finite positive float", self.norm_eps)
        _check(self.position_offset >= 0, "ModelConfig.position_offset", ">= 0",
               self.position_offset)
        if not isinstance(self.eos_token_ids, tuple):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for t in self.eos_token_ids:
            _check(0 <= t < self.vocab_size, "ModelConfig.eos_token_ids",
                   f"ids in [0, {self.vocab_size})", self.eos_token_ids)
        if not isinstance(self.layer_windows, tuple):
            object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        _check(len(self.layer_windows) in (0, self.n_layers)
               and all(isinstance(w, int) and w >= 0 for w in self.layer_windows),
               "ModelConfig.layer_windows", f"() or {self.n_layers} integers >= 0 (0: full "
               "attention)", self.layer_windows)
        for name in ("embed_scale", "attn_softcap", "final_softcap"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                   f"ModelConfig.{name}", "a finite float >= 0", v)
        _check(self.embed_scale > 0, "ModelConfig.embed_scale", "> 0", self.embed_scale)
        if self.query_scale is not None:
            _check(math.isfinite(self.query_scale) and self.query_scale > 0,
                   "ModelConfig.query_scale", "a finite float > 0 or None", self.query_scale)
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
               "ModelConfig.rope_scaling", "a RopeScaling or None", self.rope_scaling)
        if self.rope_scaling is not None and self.rope_scaling.kind == "factors":
            _check(len(self.rope_scaling.factors) == self.head_dim // 2,
                   "ModelConfig.rope_scaling.factors", f"{self.head_dim // 2} values (head_dim / 2)",
                   len(self.rope_scaling.factors))
        _check(not (self.qk_norm and self.qk_norm_full), "ModelConfig.qk_norm_full",
               "False when qk_norm (per head) is True", self.qk_norm_full)
        for name in ("n_experts", "n_experts_used", "d_ff_shared"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                   f"ModelConfig.{name}", "an integer >= 0", v)
        if self.n_experts:
            _check(1 <= self.n_experts_used <= self.n_experts, "ModelConfig.n_experts_used",
                   f"an integer in [1, n_experts={self.n_experts}] (experts routed per token)",
                   self.n_experts_used)
            _check(self.gated and not self.bias, "ModelConfig.n_experts",
                   "experts only in a gated FFN without biases", self.n_experts,
                   f"gated={self.gated}, bias={self.bias}")
        else:
            _check(self.n_experts_used == 0 and self.d_ff_shared == 0,
                   "ModelConfig.n_experts_used", "0 (and d_ff_shared 0) without experts",
                   (self.n_experts_used, self.d_ff_shared))
        if not isinstance(self.fatrelu_thresholds, tuple):
            object.__setattr__(self, "fatrelu_thresholds", tuple(self.fatrelu_thresholds))
        if self.fatrelu_thresholds:
            t = self.fatrelu_thresholds
            _check(len(t) == self.n_layers and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and v >= 0 for v in t), "ModelConfig.fatrelu_thresholds",
                f"() or {self.n_layers} finite floats >= 0 (one per layer)", t)
            _check(self.gated and self.activation in ("relu", "drelu") and not self.n_experts,
                   "ModelConfig.fatrelu_thresholds", "() unless the FFN is a gated relu/drelu "
                   "FFN without experts (FATReLU shifts a ReLU gate)", t,
                   f"activation {self.activation!r}, gated={self.gated}, "
                   f"n_experts={self.n_experts}")
        _check(not (self.qkv_bias and self.bias), "ModelConfig.qkv_bias",
               "False when bias is True (bias already covers q, k and v)", self.qkv_bias)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
    """How the FFN's active neuron set is found.

    dense: every neuron computed with XLA's dense matmuls (the reference).
    oracle: the true active set from the layer's own activations: neuron i is active for a token when
      |a_i| > threshold (ReLU with threshold 0: a_i != 0). Quality upper bound; FFN through the custom call.
    threshold: per-layer calibrated thresholds (CATS-style); the gate is computed densely.
    predictor: per-layer predictors decide the active set before any FFN row is read. `predictor`
      picks which: "q4" (default: each neuron's |a_i| estimated from 4-bit gate/up rows,
      sparsity/nibble_predictor.py) or "lowrank" (trained D -> R -> F MLPs, sparsity/predictor.py).
    gate_up: where predictor mode takes the active neurons' gate/up dots from. "full": their gate
      and up rows at the run's dtype (the predictor only selects). "q4": from the q4 predictor's
      estimate itself (4-bit rows, 8-bit activations), so only the active neurons' down rows are
      read: a third of the bytes. For a Q4_1 checkpoint (the default model) the 4-bit rows are
      the checkpoint's own gate/up weights; the approximation is the 8-bit activations, as in
      llama.cpp's Q4_1 matmuls. Requires mode "predictor" with predictor "q4".
    target_sparsity: which calibrated artifacts to use (fraction of FFN neurons skipped). Required
      by threshold/predictor modes (the CLIs default it to 0.5); with oracle mode it replaces the
      scalar threshold by the calibrated per-layer ones.
    """

    mode: str = "dense"
    threshold: float = 0.0
    impl: Literal["ffi", "reference"] = "ffi"
    target_sparsity: float | None = None
    predictor: Literal["q4", "lowrank"] = "q4"
    gate_up: Literal["full", "q4"] = "full"
    # mode "powerinfer": the GGUF holding the predictors (blk.i.fc1/fc2); None: the model file
    predictor_file: str | None = None

    def __post_init__(self):
        _check_choice("sparsity", self.mode, sparsity_modes())
        _check_choice("predictor", self.predictor, PREDICTOR_KINDS)
        _check_choice("gate_up", self.gate_up, GATE_UP_SOURCES)
        if self.gate_up == "q4":
            _check(self.mode == "predictor" and self.predictor == "q4", "gate_up",
                   "'full' unless sparsity is 'predictor' with predictor 'q4' (the q4 estimate "
                   "supplies the activations)", self.gate_up,
                   f"sparsity={self.mode!r}, predictor={self.predictor!r}")
        _check_choice("impl", self.impl, IMPLS)
        _check(self.predictor_file is None or self.mode == "powerinfer", "predictor_file",
               "only with sparsity 'powerinfer' (PowerInfer-form predictors fc1/fc2)",
               self.predictor_file, f"sparsity={self.mode!r}")
        _check(math.isfinite(self.threshold) and self.threshold >= 0, "threshold",
               "a finite float >= 0", self.threshold)
        if self.target_sparsity is not None:
            # input sparsity takes 0 too: its thresholds of 0 are the dense model
            low_ok = self.mode.startswith("input_")
            _check(isinstance(self.target_sparsity, float) and 1 > self.target_sparsity >= 0
                   and (low_ok or self.target_sparsity > 0), "target_sparsity",
                   "a float in [0, 1)" if low_ok else "a float in (0, 1)", self.target_sparsity)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one sequence's next token is drawn: greedy (temperature 0) or temperature / top-k /
    top-p sampling (runtime/sampling.py)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut

    def __post_init__(self):
        _check(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", "a finite float >= 0 (0 means greedy)",
               self.temperature)
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
               and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables)", self.top_k)
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
               "a float in (0, 1]", self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_THREADS = 256  # the kernels' thread pool's cap (cpu_backend ThreadPool::MaxThreads)


def check_threads(value) -> int:
    """A thread count for this process (the CLIs' --threads, load(threads=)): an integer in
    [1, the CPUs this process may run on], one rule and one message for both."""
    import os

    most = min(len(os.sched_getaffinity(0)), MAX_THREADS)
    _check(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most,
           "threads", f"an integer in [1, {most}] (the CPUs this process may run on)", value)
    return value


def check_decode_block(name: str, value) -> None:
    """A number of decode steps per executable call: an integer in [1, MAX_DECODE_BLOCK]."""
    _check(isinstance(value, int) and 1 <= value <= MAX_DECODE_BLOCK, name,
           f"an integer in [1, {MAX_DECODE_BLOCK}]", value)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one generation run."""

    dtype: str = "float32"
    threads: int | None = None
    max_seq_len: int | None = None  # KV cache length; None: min(model context, 2048)
    kernels: str = "auto"  # dense matmuls: "xla", "ffi" (custom calls), "auto" (ffi on CPU)
    # ablation knobs (benchmarks/e2e_ab.py): decode attention through XLA's ops instead of the
    # custom call; q, k, v as three linear calls instead of one linear_many call
    decode_attention: str = "auto"  # "auto" (the custom call with kernels ffi on CPU) | "xla"
    fuse_qkv: bool = True
    # decode steps per executable call (runtime/decode.py DECODE_BLOCK; 1: a call per token)
    decode_block: int = 4
    # "auto": a quantized file's matrices stay in its block format and are computed on as stored
    # (the custom calls on CPU; models/qweights.py); "dtype": dequantized to `dtype` at load
    weights: str = "auto"
    # tensor parallel over the first `devices` devices (runtime/mesh.py); None: one device
    devices: int | None = None

    def __post_init__(self):
        _check_choice("dtype", self.dtype, DTYPES)
        if self.devices is not None:
            _check_positive("devices", self.devices)
        _check_choice("kernels", self.kernels, KERNELS)
        _check_choice("decode_attention", self.decode_attention, ("auto", "xla"))
        _check_choice("weights", self.weights, WEIGHTS)
        check_decode_block("decode_block", self.decode_block)
        if self.threads is not None:
            check_threads(self.threads)
        if self.max_seq_len is not None:
            _check_positive("max_seq_len", self.max_seq_len)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Where FFN neurons live under an accelerator memory budget (sparsity/placement.py).

    vram_budget_gib: accelerator bytes for the whole model (dense parts, KV cache, hot FFN rows), in
      GiB. None: on a GPU, its free memory minus a margin; on a CPU-only machine, no placement (every
      FFN row is "cold", run by the FFI pool as without the flag).
    offload: "hybrid" (hot neurons by activation frequency, PowerInfer) or "layers" (the first k
      whole layers on the accelerator, llama.cpp -ngl style).
    """

    vram_budget_gib: float | None = None
    offload: Literal["hybrid", "layers"] = "hybrid"
    # --ram-budget: host memory for the model (dense parts, KV cache, resident FFN neurons) in
    # GiB; FFN neurons beyond it are read from a neuron bundle file per token (runtime/offload.py)
    ram_budget_gib: float | None = None
    neuron_cache: Literal["lru", "lfu", "frequency"] = "frequency"  # the dynamic part's eviction
    cache_share: float | None = None  # of the neuron memory, dynamic (None: offload's default)
    lookahead: bool = True  # read the next layer's guessed active set ahead (powerinfer mode)

    def __post_init__(self):
        _check_choice("offload", self.offload, OFFLOADS)
        _check_choice("neuron_cache", self.neuron_cache, NEURON_CACHES)
        if self.ram_budget_gib is not None:
            _check(isinstance(self.ram_budget_gib, (int, float))
                   and not isinstance(self.ram_budget_gib, bool)
                   and math.isfinite(self.ram_budget_gib) and self.ram_budget_gib > 0,
                   "ram_budget", "a finite number of GiB > 0", self.ram_budget_gib)
            _check(self.vram_budget_gib is None, "ram_budget", "without vram_budget (the "
                   "GPU tier of a disk-offloaded model is not built yet)", self.ram_budget_gib)
        if self.cache_share is not None:
            _check(isinstance(self.cache_share, float) and 0.0 <= self.cache_share <= 1.0,
                   "PlacementConfig.cache_share", "a float in [0, 1]", self.cache_share)
        if self.vram_budget_gib is not None:
            _check(isinstance(self.vram_budget_gib, (int, float))
                   and math.isfinite(self.vram_budget_gib) and self.vram_budget_gib >= 0,
                   "vram_budget", "a finite number of GiB >= 0", self.vram_budget_gib)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.vram_budget_gib is None else int(self.vram_budget_gib * (1 << 30))

    @property
    def ram_budget_bytes(self) -> int | None:
        return None if self.ram_budget_gib is None else int(self.ram_budget_gib * (1 << 30))


def kv_length(config: ModelConfig, runtime: RuntimeConfig) -> int:
    """Positions of the KV cache per sequence: --max-seq-len, else the model's context capped
    at DEFAULT_CONTEXT_CAP."""
    return runtime.max_seq_len or min(config.max_seq_len, DEFAULT_CONTEXT_CAP)
