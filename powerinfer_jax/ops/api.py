"""Public ops: validate once, then run the FFI kernel or its pure-jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax.ops import _checks, reference


def sparse_ffn(x, w_up, w_down_t, *, w_gate=None, b_up=None, b_down=None, scores=None,
               threshold=0.0, activation="silu", criterion="scores", gate_floor=0.0,
               impl="ffi"):
    """Sparse FFN over the neurons active for each token.

    x: [..., T, D] any float dtype (cast to f32 for the kernel); weights f32/bf16/f16 same dtype,
    neuron-major: w_up, w_gate, w_down_t all [F, D]; b_up [F], b_down [D].
    scores [..., T, F] float32 (required unless criterion == "oracle").
    Active: "scores": scores > threshold; "oracle": |a| > threshold from the true activations;
    "activations": scores *are* the activations a (e.g. `q4_scores(..., signed=True)`), active
    where |a| > threshold, and only the active neurons' down rows are read (w_up/w_gate are
    checked for shape but never read).
    a = act(gate.x) * (up.x + b_up) (gated) or act(up.x + b_up); gelu is the tanh approximation.
    gate_floor > 0 (gated relu/drelu): FATReLU, gate values <= gate_floor count as 0
    (`reference.floor_gate`).
    Returns (y [..., T, D] float32, n_active [..., T] int32). impl: "ffi" | "reference".
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    t = _checks.check_sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, b_up=b_up, b_down=b_down,
                                 scores=scores, threshold=threshold, activation=activation,
                                 criterion=criterion)
    kwargs = dict(w_gate=w_gate, b_up=b_up, b_down=b_down, scores=scores, threshold=t,
                  activation=activation, criterion=criterion,
                  gate_floor=_checks.check_gate_floor(gate_floor, activation, w_gate is not None))
    if impl == "reference":
        return reference.sparse_ffn(x, w_up, w_down_t, **kwargs)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.sparse_ffn(x, w_up, w_down_t, **kwargs)


def linear(x, w, b=None, *, impl="ffi"):
    """Dense y = x @ w.T (+ b) with w stored [O, D] (f32/bf16/f16), float32 accumulation.

    x: [..., D] any float dtype (cast to f32). Returns y [..., O] float32. The FFI kernel streams
    each weight row once per call at its stored width: the decode-time matvec.
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    _checks.check_linear(x, w, b)
    if impl == "reference":
        return reference.linear(x, w, b)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.linear(x, w, b)


def linear_many(x, ws, bs=None, *, impl="ffi"):
    """Several dense products of the same x: [linear(x, w, b) for w, b in zip(ws, bs)], in one
    custom call whose rows are split across the pool as one job (attention's q, k and v at
    decode: one dispatch instead of three). Every w has the same dtype. Returns a tuple."""
    _checks.check_choice("impl", impl, _checks.IMPLS)
    ws = tuple(ws)
    bs = (None,) * len(ws) if bs is None else tuple(bs)
    if not ws or len(bs) != len(ws):
        _checks.fail("ws/bs", "one or more weights and as many biases (None: no bias)",
                     f"{len(ws)} weights, {len(bs)} biases")
    for w, b in zip(ws, bs):
        _checks.check_linear(x, w, b)
    dtypes = sorted({str(w.dtype) for w in ws})
    if len(dtypes) != 1:
        _checks.fail("ws dtype", "one dtype for every weight", dtypes)
    if impl == "reference":
        return tuple(reference.linear(x, w, b) for w, b in zip(ws, bs))
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.linear_many(x, ws, bs)


def q4_scores(x, q, dm, b_up=None, *, activation="silu", signed=False, impl="ffi"):
    """The q4 predictor's estimate of every neuron's |a_i| from 4-bit gate/up rows.

    x: [..., T, D] any float dtype (cast to f32, then quantized per 32-block to int8).
    q: uint8 [F, G, P * 32], dm: float16 [F, G, 4P] from `ops.nibble_rows.quantize` of the stacked
    (gate, up) rows (G = 2) or the up rows alone (G = 1); b_up [F]. Returns float32 [..., T, F]:
    |act(gate.x) * (up.x + b_up)| (G = 2) or |act(up.x + b_up)| (G = 1), estimated; with
    signed=True the estimates a themselves (sparse_ffn's "activations" criterion takes them).
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    _checks.check_q4_scores(x, q, dm, b_up, activation)
    if impl == "reference":
        return reference.q4_scores(x, q, dm, b_up, activation=activation, signed=bool(signed))
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.q4_scores(x, q, dm, b_up, activation=activation, signed=bool(signed))


def q4_sparse_ffn(x, q, dm, w_down_t, b_up=None, b_down=None, *, threshold, activation="silu",
                  impl="ffi"):
    """The q4 FFN: the q4 estimates a (`q4_scores(..., signed=True)`) are the activations.

    y = b_down + sum over neurons with |a_i| > threshold of a_i * w_down_t[i]; one custom call
    that estimates, selects and reads only the active neurons' down rows (the same result as
    `sparse_ffn(..., scores=a, criterion="activations")`, without the second call).
    x: [..., T, D]; q, dm, b_up as `q4_scores`; w_down_t [F, D] f32/bf16/f16; b_down [D].
    Returns (y [..., T, D] float32, n_active [..., T] int32).
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    t = _checks.check_q4_sparse_ffn(x, q, dm, b_up, w_down_t, b_down, threshold, activation)
    if impl == "reference":
        return reference.q4_sparse_ffn(x, q, dm, w_down_t, b_up, b_down, threshold=t,
                                       activation=activation)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.q4_sparse_ffn(x, q, dm, w_down_t, b_up, b_down, threshold=t, activation=activation)


def qlinear(x, blocks, qtype, in_features: int, b=None, *, impl="ffi"):
    """y = x @ dequant(W).T (+ b) with W kept as a GGUF tensor's blocks, as llama.cpp computes it.

    blocks: uint8 [O, row_bytes], the file's rows of W [O, in_features] (e.g. a `QuantTensor`'s
    `.blocks`) in `qtype`: a GGML block type name (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
    Q4_K, Q5_K, Q6_K) or its id. x: [..., D], D == in_features (a multiple of the type's block:
    32, or 256 for K-quants), rounded to int8 per block (`qblocks.round_activations`; Q8_0-style
    for the legacy types, Q8_K-style for the K-quants) for integer dot products. b: [O].
    Returns y [..., O] float32. Decode (one token) streams each row once; prefill reads a block
    of rows once per 64 tokens.
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    name, _ = _checks.check_qlinear(x, blocks, qtype, in_features, b)
    if impl == "reference":
        return reference.qlinear(x, blocks, name, int(in_features), b)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.qlinear(x, blocks, name, b)


def qlinear_many(x, blocks_list, qtypes, in_features: int, bs=None, *, impl="ffi"):
    """[qlinear(x, w, t, in_features, b) for w, t, b in zip(blocks_list, qtypes, bs)] in one
    custom call whose rows are split across the pool as one job (attention's q, k and v at
    decode). The types may differ (a Q4_K_M file's Q6_K attn_v beside Q4_K q and k)."""
    _checks.check_choice("impl", impl, _checks.IMPLS)
    blocks_list, qtypes = tuple(blocks_list), tuple(qtypes)
    bs = (None,) * len(blocks_list) if bs is None else tuple(bs)
    if not blocks_list or len(qtypes) != len(blocks_list) or len(bs) != len(blocks_list):
        _checks.fail("blocks_list/qtypes/bs", "one or more blocks with as many qtypes and biases",
                     f"{len(blocks_list)} blocks, {len(qtypes)} qtypes, {len(bs)} biases")
    names = tuple(_checks.check_qlinear(x, w, t, in_features, b)[0]
                  for w, t, b in zip(blocks_list, qtypes, bs))
    if impl == "reference":
        return tuple(reference.qlinear(x, w, t, int(in_features), b)
                     for w, t, b in zip(blocks_list, names, bs))
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.qlinear_many(x, blocks_list, names, bs)


def moe_ffn(x, ids, weights, gate, up, down, *, gate_qtype, up_qtype, down_qtype,
            activation="silu", mid_thresholds=None, return_kept=False, impl="ffi"):
    """The MoE FFN on quantized experts: y[n] = sum_j weights[n, j] * down[e]^T (act(gate[e] .
    x_n) * (up[e] . x_n)), e = ids[n, j], act silu or relu, as llama.cpp computes it (int8
    activations).

    x: float32 [N, D]; ids: int32 [N, k], each token's experts in [0, E), or -1 for an expert
    another shard holds (expert parallelism: that pair adds nothing); weights: float32 [N, k];
    gate, up: uint8 [E, F, row_bytes(D)]; down: uint8 [E, D, row_bytes(F)] (a GGUF's
    ffn_{gate,up,down}_exps as stored) in their GGML types, or with each expert's rows
    interleaved by 16 (a "Q4_0x16" type name, as ops.qlinear takes). With impl "ffi" only the
    routed experts' rows are read, the tokens grouped by expert (each expert's rows read once
    per call); "reference" runs every expert on every token (unrouted ones weighted 0).
    down_qtype a down-groups name ("Q4_0g32", relu only): down is each expert's down groups,
    uint8 [E, F / 32, D * block bytes] (checkpoint.quants.down_groups, a 32-weight format), and
    each routed
    expert is sparse inside: only the neurons whose gate fires read their up row and down group
    (the exact oracle); the gate may be interleaved over the up's file rows.
    Input sparsity: gate, up and down in the columns layout ("Q4_0c64", each expert arranged as
    ops.qlinear's columns) read only the channels of their input that are nonzero (x as given);
    down's h = act(gate . x) * (up . x) is zeroed where |h| < mid_thresholds[e] (float32 [E, F]).
    return_kept: also each token's nonzero channels of down's input summed over its routed
    experts (int32 [N]: the sparse path's firing neurons), as (y, kept)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    _checks.check_choice("impl", impl, _checks.IMPLS)
    _checks.check_choice("moe_ffn activation", activation, ("silu", "relu"))
    names = [_checks.check_qlinear_type(t, w) for w, t in (("gate_qtype", gate_qtype),
                                                          ("up_qtype", up_qtype))]
    names.append(_checks.check_down_type(down_qtype, interleaved=True, columns=True))
    x_shape = tuple(np.shape(x))
    if len(x_shape) != 2:
        _checks.fail("moe_ffn x", "float32 [N, D]", x_shape)
    n, d = x_shape
    if len(np.shape(gate)) != 3:
        _checks.fail("moe_ffn gate", "uint8 [E, F, row_bytes]", tuple(np.shape(gate)))
    e, f = np.shape(gate)[:2]
    mats = [("gate", gate, names[0], f, d), ("up", up, names[1], f, d)]
    if quants.groups_base(names[2]) is None:
        mats.append(("down", down, names[2], d, f))
    else:
        if activation != "relu":
            _checks.fail("moe_ffn down_qtype", "rows for silu experts (down groups: the sparse "
                         "path of relu experts)", names[2])
        if mid_thresholds is not None or any(quants.columns_base(t) for t in names[:2]):
            _checks.fail("moe_ffn down groups", "rows for gate and up and no mid_thresholds "
                         "(the sparse path of relu experts reads its own neurons)",
                         f"{names[:2]}, mid_thresholds {mid_thresholds is not None}")
        _checks.check_down_groups("moe_ffn down (groups)", down, names[2], d, f, lead=(e,))
    if mid_thresholds is not None and (tuple(np.shape(mid_thresholds)) != (e, f) or
                                       jnp.result_type(mid_thresholds) != jnp.float32):
        _checks.fail("moe_ffn mid_thresholds", f"float32 [{e}, {f}] (a threshold per expert "
                     "and neuron)", f"{jnp.result_type(mid_thresholds)} "
                     f"{tuple(np.shape(mid_thresholds))}")
    for what, w, t, rows, cols in mats:
        if tuple(np.shape(w))[:1] != (e,):
            _checks.fail(f"moe_ffn {what}", f"{e} experts first (as gate)", tuple(np.shape(w)))
        _checks.check_qweight(f"moe_ffn {what}",
                              jax.ShapeDtypeStruct(np.shape(w)[1:], jnp.result_type(w)), t,
                              cols, rows)
    k_shape = tuple(np.shape(ids))
    if len(k_shape) != 2 or k_shape[0] != n or not 1 <= k_shape[1] <= e:
        _checks.fail("moe_ffn ids", f"int32 [{n}, k] with 1 <= k <= {e} (experts)", k_shape)
    if tuple(np.shape(weights)) != k_shape:
        _checks.fail("moe_ffn weights", f"float32 {k_shape} (as ids)", tuple(np.shape(weights)))
    kw = dict(gate_qtype=names[0], up_qtype=names[1], down_qtype=names[2], activation=activation,
              mid_thresholds=mid_thresholds)
    if impl == "reference":
        y, kept = reference.moe_ffn(x, ids, weights, gate, up, down, **kw)
    else:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
        y, kept = _ffi.moe_ffn(x, ids, weights, gate, up, down, **kw)
    return (y, kept) if return_kept else y


def qembedding(ids, blocks, qtype, in_features: int, *, impl="ffi"):
    """Rows `ids` of a quantized table (e.g. token_embd's blocks, uint8 [V, row_bytes] in
    `qtype`), dequantized: float32 [..., in_features]. The table stays quantized in memory (only
    the looked-up rows are expanded). An id outside [0, V) is an error (raised by the handler
    when ids are traced)."""
    _checks.check_choice("impl", impl, _checks.IMPLS)
    name = _checks.check_qtype("qtype", qtype)
    _checks.check_qweight("blocks", blocks, name, int(in_features))
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        _checks.fail("ids", "an integer array", jnp.result_type(ids))
    if impl == "reference":
        return reference.qembedding(ids, blocks, name, int(in_features))
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.qembedding(ids, blocks, name, int(in_features))


def qsparse_ffn(x, up, down, *, up_qtype, down_qtype, gate=None, gate_qtype=None, b_up=None,
                b_down=None, scores=None, threshold=0.0, activation="silu", criterion="oracle",
                gate_floor=0.0, impl="ffi"):
    """The sparse FFN on quantized weights, in one custom call.

    up, gate: the file's ffn_up / ffn_gate blocks, uint8 [F, row_bytes] (neuron-major rows of D
    values; gate None: non-gated FFN); down: neuron i's down row (down_t [F, D]) blocked along D,
    uint8 [F, row_bytes], e.g. `QuantTensor.reblocked("Q8_0").blocks` of ffn.down_t.weight, or
    the file's own ffn_down blocks in groups of 32 neurons, uint8 [F / 32, D * block bytes],
    `checkpoint.quants.down_groups`, named by the format's down-groups name ("Q4_0g32", "Q4_1g32",
    "Q5_0g32", "Q5_1g32", "Q8_0g32": nothing re-quantized, and a group's scales read once for
    all its active neurons). The types are GGML block type names or ids (gate_qtype defaults
    to up_qtype; gate and up rows may be interleaved by 16, "Q4_0x16", as ops.qlinear takes).
    a = act(gate.x) * (up.x + b_up) (gated) or act(up.x + b_up) from int8-rounded x (as qlinear);
    active: criterion "oracle": |a| > threshold (threshold 0 with every neuron active is the dense
    quantized FFN); "scores": scores [..., F] > threshold, and only those neurons' gate/up rows
    are read. y = b_down + sum over active i of a_i * down_t[i]. gate_floor > 0 (gated
    relu/drelu): FATReLU, as in `sparse_ffn`.
    x: [..., D]. Returns (y [..., D] float32, n_active [...] int32).
    """
    _checks.check_choice("impl", impl, _checks.IMPLS)
    t, g, u, dn = _checks.check_qsparse_ffn(
        x, up, down, up_qtype=up_qtype, down_qtype=down_qtype, gate=gate, gate_qtype=gate_qtype,
        b_up=b_up, b_down=b_down, scores=scores, threshold=threshold, activation=activation,
        criterion=criterion)
    kwargs = dict(up_qtype=u, down_qtype=dn, gate=gate, gate_qtype=g, b_up=b_up, b_down=b_down,
                  scores=scores, threshold=t, activation=activation, criterion=criterion,
                  gate_floor=_checks.check_gate_floor(gate_floor, activation, gate is not None))
    if impl == "reference":
        return reference.qsparse_ffn(x, up, down, **kwargs)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.qsparse_ffn(x, up, down, **kwargs)


def decode_attention(q, k_new, v_new, k_cache, v_cache, where, *, kv_len: int,
                     inv_freq=None, rope_factor: float = 1.0, scale: float | None = None,
                     softcap: float = 0.0, window: int = 0, q_norm=None, k_norm=None,
                     norm_eps: float = 1e-6):
    """Attention of one decode token per sequence against a fixed-size KV cache, one custom call.

    B sequences: q [B, ..., NH * H], k_new / v_new [B, ..., NK * H] (projections, before rope);
    k_cache / v_cache [R, S, NK, H] float32 or uint16 (bfloat16 bits, models/layers.py's cache
    storage), R >= B: sequence b reads and writes cache row b; where int32 [B, 2] = per sequence
    (slot the new key/value go to, the token's position); [2] for one sequence. Sequence b attends
    to slots [0, min(kv_len, position_b + 1)), with `window` > 0 only to the last `window` of
    them (slot s holds position s). Per head, before the rotation: q and k RMS-normed with
    weights q_norm / k_norm [H] (None: no norm; eps norm_eps). Rotation: pairs (i, i + H/2) by
    position * inv_freq[i] ([H/2] float32, models/rope.py; None: none), cos/sin times
    rope_factor. Scores q.k * scale (None: H ** -0.5), soft-capped to softcap * tanh(s / softcap)
    when softcap > 0. Returns (out like q float32, k_cache, v_cache), the caches updated in place
    (donate them). The reference is models/layers.py's XLA attention path.
    """
    h = _checks.check_decode_attention(q, k_new, v_new, k_cache, v_cache, where, kv_len)
    for name, a, n in (("inv_freq", inv_freq, h // 2), ("q_norm", q_norm, h), ("k_norm", k_norm, h)):
        if a is not None and tuple(np.shape(a)) != (n,):
            _checks.fail(f"{name} shape", f"[{n}]", tuple(np.shape(a)))
    if (q_norm is None) != (k_norm is None):
        _checks.fail("q_norm/k_norm", "both given or both None",
                     (q_norm is not None, k_norm is not None))
    for name, v, ok, rule in (("rope_factor", rope_factor, rope_factor > 0, "> 0"),
                              ("softcap", softcap, softcap >= 0, ">= 0"),
                              ("norm_eps", norm_eps, norm_eps > 0, "> 0"),
                              ("scale", scale, scale is None or scale > 0, "> 0 or None")):
        if not ok:
            _checks.fail(name, rule, v)
    if not (isinstance(window, (int, np.integer)) and window >= 0):
        _checks.fail("window", "an int >= 0 (0: full attention)", window)
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    return _ffi.decode_attention(q, k_new, v_new, k_cache, v_cache, where.reshape(-1, 2),
                                 kv_len=int(kv_len), inv_freq=inv_freq,
                                 rope_factor=float(rope_factor),
                                 scale=0.0 if scale is None else float(scale),
                                 softcap=float(softcap), window=int(window), q_norm=q_norm,
                                 k_norm=k_norm, norm_eps=float(norm_eps))


def set_num_threads(n: int) -> None:
    """Threads used by the CPU kernels (the calling thread counts as one)."""
    from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension
    _ffi.set_num_threads(n)
