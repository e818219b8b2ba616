"""Argument validation shared by the FFI and reference implementations.

Errors follow the project rule "<what>: expected <rule>, got <value>". The C++ handlers validate
again (they can be called without this module), so both layers are tested.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from powerinfer_jax.errors import check_choice, fail  # noqa: F401  (the ops' validators)
from powerinfer_jax.ops.nibble_rows import PAIR_BYTES, num_pairs

ACTIVATIONS = ("silu", "relu", "gelu", "drelu")
CRITERIA = ("scores", "oracle", "activations")
IMPLS = ("ffi", "reference")
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)




def check_threshold(threshold) -> float:
    try:
        t = float(threshold)
    except (TypeError, ValueError):
        fail("threshold", "a Python float (a static attribute, not a traced array)", threshold)
    if not math.isfinite(t) or t < 0:
        fail("threshold", "a finite float >= 0", threshold,
             "shift predictor logits rather than using a negative threshold")
    return t


def check_gate_floor(gate_floor, activation: str, gated: bool) -> float:
    """FATReLU's gate threshold: a finite float >= 0, > 0 only on a gated relu/drelu FFN."""
    try:
        t = float(gate_floor)
    except (TypeError, ValueError):
        fail("gate_floor", "a Python float (a static attribute, not a traced array)", gate_floor)
    if not math.isfinite(t) or t < 0:
        fail("gate_floor", "a finite float >= 0", gate_floor)
    if t > 0 and not (gated and activation in ("relu", "drelu")):
        fail("gate_floor", "0 unless the FFN is gated with relu or drelu (FATReLU)", gate_floor,
             f"activation {activation!r}, gated={gated}")
    return t


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a))


def check_sparse_ffn(x, w_up, w_down_t, *, w_gate, b_up, b_down, scores, threshold, activation,
                     criterion) -> float:
    """Validates shapes, dtypes and options; returns the threshold as a float."""
    check_choice("activation", activation, ACTIVATIONS)
    check_choice("criterion", criterion, CRITERIA)
    t = check_threshold(threshold)
    if np.ndim(x) < 2:
        fail("x shape", "rank >= 2 ([..., T, D])", _shape(x))
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail("x dtype", "a floating dtype", jnp.result_type(x))
    d = _shape(x)[-1]
    if np.ndim(w_up) != 2:
        fail("w_up shape", "rank 2 ([F, D])", _shape(w_up))
    f = _shape(w_up)[0]
    w_dtype = jnp.result_type(w_up)
    if w_dtype not in WEIGHT_DTYPES:
        fail("w_up dtype", "float32, bfloat16 or float16", w_dtype)
    for name, w in (("w_up", w_up), ("w_down_t", w_down_t), ("w_gate", w_gate)):
        if w is None:
            continue
        if _shape(w) != (f, d):
            fail(f"{name} shape", f"[F, D] = {(f, d)} (D from x, F from w_up)", _shape(w))
        if jnp.result_type(w) != w_dtype:
            fail(f"{name} dtype", f"the same dtype as w_up ({w_dtype})", jnp.result_type(w))
    for name, b, n in (("b_up", b_up, f), ("b_down", b_down, d)):
        if b is not None and _shape(b) != (n,):
            fail(f"{name} shape", f"[{n}]", _shape(b))
    if criterion != "oracle":
        if scores is None:
            fail("scores", f"an array [..., T, F] when criterion={criterion!r}", None,
                 "pass scores, or use criterion='oracle'")
        if _shape(scores)[-1:] != (f,) or np.ndim(scores) != np.ndim(x) or \
                _shape(scores)[:-1] != _shape(x)[:-1]:
            fail("scores shape", f"x's leading dims + [F] = {_shape(x)[:-1] + (f,)}",
                 _shape(scores))
    return t


def check_linear(x, w, b) -> None:
    if np.ndim(x) < 1:
        fail("x shape", "rank >= 1 ([..., D])", _shape(x))
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail("x dtype", "a floating dtype", jnp.result_type(x))
    if np.ndim(w) != 2 or _shape(w)[1] != _shape(x)[-1]:
        fail("w shape", f"[O, D] with D = {_shape(x)[-1]} (x's last dim)", _shape(w))
    if jnp.result_type(w) not in WEIGHT_DTYPES:
        fail("w dtype", "float32, bfloat16 or float16", jnp.result_type(w))
    if b is not None and _shape(b) != _shape(w)[:1]:
        fail("b shape", f"[O] = {_shape(w)[:1]}", _shape(b))


def check_q4_scores(x, q, dm, b_up, activation) -> None:
    check_choice("activation", activation, ACTIVATIONS)
    if np.ndim(x) < 1 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail("x", "a floating array [..., D]", f"{jnp.result_type(x)} {_shape(x)}")
    d = _shape(x)[-1]
    p = num_pairs(d)
    if (np.ndim(q) != 3 or _shape(q)[1] not in (1, 2) or _shape(q)[2] != p * PAIR_BYTES
            or jnp.result_type(q) != jnp.uint8):
        fail("q", f"uint8 [F, G in (1, 2), {p * PAIR_BYTES}] for D = {d}",
             f"{jnp.result_type(q)} {_shape(q)}")
    f, g = _shape(q)[:2]
    if _shape(dm) != (f, g, 4 * p) or jnp.result_type(dm) != jnp.float16:
        fail("dm", f"float16 [{f}, {g}, {4 * p}]", f"{jnp.result_type(dm)} {_shape(dm)}")
    if b_up is not None and _shape(b_up) != (f,):
        fail("b_up shape", f"[F] = ({f},)", _shape(b_up))


def check_q4_sparse_ffn(x, q, dm, b_up, w_down_t, b_down, threshold, activation) -> float:
    """The q4 FFN's operands: check_q4_scores's, plus down_t [F, D] and b_down [D]."""
    check_q4_scores(x, q, dm, b_up, activation)
    t = check_threshold(threshold)
    f, d = _shape(q)[0], _shape(x)[-1]
    if _shape(w_down_t) != (f, d):
        fail("w_down_t shape", f"[F, D] = {(f, d)} (F from q, D from x)", _shape(w_down_t))
    if jnp.result_type(w_down_t) not in WEIGHT_DTYPES:
        fail("w_down_t dtype", "float32, bfloat16 or float16", jnp.result_type(w_down_t))
    if b_down is not None and _shape(b_down) != (d,):
        fail("b_down shape", f"[{d}]", _shape(b_down))
    return t


def check_decode_attention(q, k_new, v_new, k_cache, v_cache, where, kv_len) -> int:
    """One token per sequence: B = where.shape[0] sequences against cache rows [0, B). Returns
    the head dim H."""
    if np.ndim(k_cache) != 4 or jnp.result_type(k_cache) not in (jnp.float32, jnp.uint16):
        fail("k_cache", "float32 or uint16 [R, S, NK, H]",
             f"{jnp.result_type(k_cache)} {_shape(k_cache)}")
    rows, s, nk, h = _shape(k_cache)
    if _shape(v_cache) != _shape(k_cache) or jnp.result_type(v_cache) != jnp.result_type(k_cache):
        fail("v_cache", f"k_cache's dtype and shape {_shape(k_cache)}",
             f"{jnp.result_type(v_cache)} {_shape(v_cache)}")
    ws = (1,) + _shape(where) if np.ndim(where) == 1 else _shape(where)  # (2,): one sequence
    if len(ws) != 2 or ws[1] != 2 or not 1 <= ws[0] <= rows:
        fail("where shape", f"(B, 2) = (slot, position) per sequence, 1 <= B <= {rows} cache rows",
             _shape(where))
    b = ws[0]
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if int(np.prod(_shape(a))) != b * nk * h:
            fail(f"{name} shape", f"one token of NK * H = {nk * h} values per sequence ({b})",
                 _shape(a))
    nq = int(np.prod(_shape(q)))
    if nq % (b * nk * h) != 0:
        fail("q shape", f"one token of NH * H values per sequence ({b}), NH a multiple of "
             f"NK = {nk}", _shape(q))
    if not isinstance(kv_len, (int, np.integer)) or not 1 <= int(kv_len) <= s:
        fail("kv_len", f"a static int in [1, S = {s}]", kv_len)
    return h


def check_qtype(what: str, qtype) -> str:
    """A block-quantized GGML type, by name ("Q4_K") or id (12) -> its name."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        by_id = {quants.type_id(n): n for n in quants.QUANTIZED_TYPES}
        if int(qtype) in by_id:
            return by_id[int(qtype)]
    elif qtype in quants.QUANTIZED_TYPES:
        return qtype
    hint = ("float weights take ops.linear / ops.sparse_ffn" if qtype in quants.FLOAT_TYPES
            else "a GGML block type name or its id")
    fail(what, f"one of {list(quants.QUANTIZED_TYPES)}", qtype, hint)


def check_qlinear_type(qtype, what: str = "qtype") -> str:
    """ops.qlinear's formats: the block types, or the file's rows interleaved by 16
    ("Q4_0x16", checkpoint.quants.interleave) -> the name."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if isinstance(qtype, str) and (qtype in quants.INTERLEAVED_TYPES
                                   or qtype in quants.COLUMNS_TYPES):
        return qtype
    return check_qtype(what, qtype)


def check_down_type(qtype, what: str = "down_qtype", *, interleaved: bool = False,
                    columns: bool = False) -> str:
    """A down projection's formats: the block types or their down groups ("Q4_0g32",
    checkpoint.quants.down_groups), with `interleaved` also rows interleaved by 16, with
    `columns` also the columns layout ("Q4_0c64") -> the name."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    arranged = (quants.GROUPS_TYPES + (quants.INTERLEAVED_TYPES if interleaved else ())
                + (quants.COLUMNS_TYPES if columns else ()))
    if isinstance(qtype, str) and qtype in arranged:
        return qtype
    if isinstance(qtype, str) and qtype not in quants.SUPPORTED_TYPES:
        fail(what, f"one of {list(quants.QUANTIZED_TYPES)} or {list(arranged)}", qtype)
    return check_qtype(what, qtype)


def check_down_groups(what: str, down, qtype: str, d: int, f: int, lead: tuple = ()) -> None:
    """down groups in `qtype` ("Q4_0g32") of a [D, F] down projection: uint8 lead + [F / 32,
    D * block bytes]."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    block_bytes, _ = quants.check_down_groups(quants.groups_base(qtype), d, f)
    want = tuple(lead) + (f // 32, d * block_bytes)
    if _shape(down) != want or jnp.result_type(down) != jnp.uint8:
        fail(what, f"uint8 {want}", f"{jnp.result_type(down)} {_shape(down)}")


def check_qweight(what: str, blocks, qtype: str, in_features: int, rows: int | None = None) -> int:
    """blocks: uint8 [R, row_bytes] for rows of in_features values in qtype; returns R."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    block, nbytes = quants.block_size(qtype)
    if in_features <= 0 or in_features % block:
        fail(f"{what}: in_features (x's last dim)",
             f"a positive multiple of the {qtype} block ({block})", in_features)
    rb = in_features // block * nbytes
    shape, dtype = _shape(blocks), jnp.result_type(blocks)
    if quants.columns_base(qtype) is not None and len(shape) == 2:
        if shape[0] <= 0 or shape[0] % quants.COLUMNS_TILE:
            fail(what, f"the columns layout ({qtype}): a positive multiple of "
                       f"{quants.COLUMNS_TILE} rows", shape[0])
        rb = quants.columns_row_bytes(qtype, shape[0], in_features)
    if (len(shape) != 2 or dtype != jnp.uint8 or shape[1] != rb
            or (rows is not None and shape[0] != rows)):
        want = f"[{'R' if rows is None else rows}, {rb}]"
        fail(what, f"uint8 {want} ({in_features // block} {qtype} blocks of {nbytes} bytes per "
                   f"row of {in_features})", f"{dtype} {shape}",
             "a truncated row, or blocks of another type"
             if len(shape) == 2 and dtype == jnp.uint8 else "")
    return shape[0]


def check_qlinear(x, blocks, qtype, in_features, b) -> tuple[str, int]:
    """Validates a quantized product; returns (qtype name, O)."""
    if np.ndim(x) < 1 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail("x", "a floating array [..., D]", f"{jnp.result_type(x)} {_shape(x)}")
    if not isinstance(in_features, (int, np.integer)) or _shape(x)[-1] != in_features:
        fail("in_features", f"x's last dim ({_shape(x)[-1]}), a static int", in_features)
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    name = check_qlinear_type(qtype)
    o = check_qweight("blocks", blocks, name, int(in_features))
    if quants.interleaved_base(name) is not None and o % quants.INTERLEAVE:
        fail("blocks", f"rows interleaved by 16 ({name}): a multiple of 16 rows", o)
    if quants.columns_base(name) is not None and o % quants.COLUMNS_TILE:
        fail("blocks", f"the columns layout ({name}): a multiple of {quants.COLUMNS_TILE} rows", o)
    if b is not None and _shape(b) != (o,):
        fail("b shape", f"[O] = ({o},)", _shape(b))
    return name, o


def check_qsparse_ffn(x, up, down, *, up_qtype, down_qtype, gate, gate_qtype, b_up, b_down,
                      scores, threshold, activation, criterion) -> tuple[float, str, str, str]:
    """Validates the quantized sparse FFN's operands; returns (threshold, gate, up and down type
    names; gate's is up's when absent)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    check_choice("activation", activation, ACTIVATIONS)
    check_choice("criterion", criterion, ("scores", "oracle"))
    t = check_threshold(threshold)
    if np.ndim(x) < 1 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        fail("x", "a floating array [..., D]", f"{jnp.result_type(x)} {_shape(x)}")
    d = _shape(x)[-1]
    u = check_qlinear_type(up_qtype, "up_qtype")
    f = check_qweight("up", up, u, d)
    g = u
    if gate is not None:
        g = check_qlinear_type(gate_qtype if gate_qtype is not None else up_qtype, "gate_qtype")
        check_qweight("gate", gate, g, d, rows=f)
    base_u, base_g = quants.interleaved_base(u), quants.interleaved_base(g)
    if base_u or base_g:  # rows interleaved by 16: every neuron's gate estimated
        # both, or the gate alone on a relu/drelu FFN (up rows read for neurons whose gate fires)
        pair_ok = bool(base_u) if gate is None else bool(base_g) and (
            bool(base_u) or activation in ("relu", "drelu"))
        if not pair_ok or criterion != "oracle" or f % quants.INTERLEAVE:
            fail("gate/up rows interleaved by 16", "both interleaved (or the gate alone with "
                 "relu/drelu), F a multiple of 16, criterion 'oracle'",
                 f"up {u}, gate {g}, F {f}, criterion {criterion!r}",
                 "a selector that reads rows per neuron takes the file's rows")
    dn = check_down_type(down_qtype)
    if quants.groups_base(dn) is None:
        check_qweight("down (down_t rows blocked along D)", down, dn, d, rows=f)
    else:
        check_down_groups("down (groups of 32 neurons)", down, dn, d, f)
    for name, b, n in (("b_up", b_up, f), ("b_down", b_down, d)):
        if b is not None and _shape(b) != (n,):
            fail(f"{name} shape", f"[{n}]", _shape(b))
    if criterion == "scores":
        if scores is None:
            fail("scores", "an array [..., F] when criterion='scores'", None,
                 "pass scores, or use criterion='oracle'")
        if _shape(scores) != _shape(x)[:-1] + (f,):
            fail("scores shape", f"x's leading dims + [F] = {_shape(x)[:-1] + (f,)}",
                 _shape(scores))
    return t, g, u, dn
