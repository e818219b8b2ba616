"""ops.moe_ffn: the MoE FFN on quantized experts (cpu_backend/moe_ffn.cc, tokens grouped by
expert, only the routed experts' rows read) against its jnp reference (every expert on every
token through the same int8 activation rounding, unrouted experts weighted 0)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.ops import _ffi

E, K = 7, 2


def operands(gate_t, down_t, n, seed=0, *, d=None, f=None):
    rng = np.random.default_rng(seed)
    d = d or (256 if quants.block_size(gate_t)[0] == 256 else 96)
    f = f or (256 if quants.block_size(down_t)[0] == 256 else 64)
    x = rng.standard_normal((n, d), dtype=np.float32)
    gate = np.stack([random_blocks(gate_t, f, d, rng) for _ in range(E)])
    up = np.stack([random_blocks(gate_t, f, d, rng) for _ in range(E)])
    down = np.stack([random_blocks(down_t, d, f, rng) for _ in range(E)])
    logits = rng.standard_normal((n, E))
    ids = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    w = rng.uniform(0.1, 1.0, (n, K)).astype(np.float32)
    return [jnp.asarray(a) for a in (x, ids, w, gate, up, down)]


def _on_one_thread(fn):
    """fn() with the kernels' pool at one thread (then back), as numpy."""
    threads = _ffi.get_num_threads()
    try:
        ops.set_num_threads(1)
        return np.asarray(fn())
    finally:
        ops.set_num_threads(threads)


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert_close(got, want, "moe_quantized")


@pytest.mark.parametrize("gate_t,down_t", [("Q4_0", "Q4_0"), ("Q8_0", "Q8_0"),
                                           ("Q4_K", "Q6_K"), ("Q4_0", "Q8_0")])
@pytest.mark.parametrize("n", [1, pytest.param(3, marks=pytest.mark.slow), 16])
def test_matches_the_dense_reference(gate_t, down_t, n):
    x, ids, w, gate, up, down = operands(gate_t, down_t, n, seed=n)
    kw = dict(gate_qtype=gate_t, up_qtype=gate_t, down_qtype=down_t)
    got = jax.jit(lambda *a: ops.moe_ffn(*a, **kw))(x, ids, w, gate, up, down)
    _close(got, ops.moe_ffn(x, ids, w, gate, up, down, impl="reference", **kw))


def _interleave_experts(stack, qtype):
    """Each expert's rows interleaved by 16 (the layout models/moe.py loads experts in)."""
    a = np.asarray(stack)
    return jnp.asarray(np.stack([quants.interleave(m, qtype) for m in a]))


@pytest.mark.parametrize("gate_t,down_t", [("Q4_0", "Q4_0"), ("Q8_0", "Q4_1")])
@pytest.mark.parametrize("n", [1, 5])
def test_interleaved_experts_match_the_file_rows_and_the_reference(gate_t, down_t, n):
    """Experts whose rows are interleaved by 16 ("Q4_0x16": the matvec layout) give the file
    rows' result up to the summation order, and the reference's (which de-interleaves); one
    thread and two give the same bits."""
    x, ids, w, gate, up, down = operands(gate_t, down_t, n, seed=10 + n, d=128, f=96)
    rows_kw = dict(gate_qtype=gate_t, up_qtype=gate_t, down_qtype=down_t)
    il_kw = {k: v + quants.INTERLEAVED_SUFFIX for k, v in rows_kw.items()}
    il = [_interleave_experts(gate, gate_t), _interleave_experts(up, gate_t),
          _interleave_experts(down, down_t)]
    assert not np.array_equal(np.asarray(il[0]), np.asarray(gate))  # rearranged bytes
    got = np.asarray(ops.moe_ffn(x, ids, w, *il, **il_kw))
    _close(got, ops.moe_ffn(x, ids, w, gate, up, down, **rows_kw))
    _close(got, ops.moe_ffn(x, ids, w, *il, impl="reference", **il_kw))
    one = _on_one_thread(lambda: ops.moe_ffn(x, ids, w, *il, **il_kw))
    np.testing.assert_array_equal(one, got)


def test_unrouted_experts_are_not_read_and_threads_do_not_change_bits():
    """Experts no token routes to, filled with NaN scales, leave the result finite (their rows
    are never read); the reference, which reads every expert, turns NaN. One thread and two give
    the same bits."""
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", 5, seed=3)
    kw = dict(gate_qtype="Q4_0", up_qtype="Q4_0", down_qtype="Q4_0")
    before = np.asarray(ops.moe_ffn(x, ids, w, gate, up, down, **kw))
    unused = [e for e in range(E) if e not in set(np.asarray(ids).ravel().tolist())]
    assert unused
    nan16 = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    poisoned = []
    for m in (gate, up, down):
        a = np.array(m)
        a[unused, :, 0:2] = nan16  # every row's first block scale (Q4_0: f16 d first)
        poisoned.append(jnp.asarray(a))
    after = np.asarray(ops.moe_ffn(x, ids, w, *poisoned, **kw))
    np.testing.assert_array_equal(after, before)
    assert np.isnan(np.asarray(ops.moe_ffn(x, ids, w, *poisoned, impl="reference", **kw))).any()
    one = _on_one_thread(lambda: ops.moe_ffn(x, ids, w, gate, up, down, **kw))
    np.testing.assert_array_equal(one, before)


def test_bad_operands_are_one_line_errors():
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", 2)
    kw = dict(gate_qtype="Q4_0", up_qtype="Q4_0", down_qtype="Q4_0")
    with pytest.raises(ValueError, match=r"moe_ffn ids: expected int32 \[2, k\] with 1 <= k "
                                         r"<= 7 \(experts\), got \(2, 8\)"):
        ops.moe_ffn(x, jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8)), gate, up, down, **kw)
    with pytest.raises(ValueError, match=r"moe_ffn down"):
        ops.moe_ffn(x, ids, w, gate, up, down[:, :-1], **kw)
    with pytest.raises(ValueError, match=r"moe_ffn weights: expected float32 \(2, 2\)"):
        ops.moe_ffn(x, ids, w[:, :1], gate, up, down, **kw)
    # an id outside [0, E) reaches the handler only when traced: its error names the rule
    bad = ids.at[1, 0].set(E)
    with pytest.raises(Exception, match=r"moe_ffn: ids: expected experts in \[0, 7\) or -1 "
                                        r"\(another shard's\), got 7"):
        jax.block_until_ready(ops.moe_ffn(x, bad, w, gate, up, down, **kw))


def _relu_layouts(gate, up, down, gate_t, down_t, d, f):
    """A relu expert stack as models/moe.py keeps it: the gate interleaved by 16, up the file's
    rows, down as each expert's down groups."""
    groups = np.stack([quants.down_groups(np.asarray(b), down_t, d, f) for b in np.asarray(down)])
    return _interleave_experts(gate, gate_t), up, jnp.asarray(groups)


@pytest.mark.parametrize("gate_t,down_t", [("Q4_0", "Q4_0"), ("Q8_0", "Q8_0"), ("Q4_0", "Q4_1")])
@pytest.mark.parametrize("n", [1, 6])
def test_relu_experts_sparse_inside_equal_the_dense_reference(gate_t, down_t, n):
    """relu experts through the sparse path (only the neurons whose gate fires read their up row
    and down group) give the dense result: every neuron computed, the ones that do not fire
    adding 0 (the reference; for the 4-bit downs, whose groups round their coefficients to 8
    bits as the dense matvec rounds its input, also the file rows' reference and custom call);
    one thread and two give the same bits."""
    d, f = 128, 96
    x, ids, w, gate, up, down = operands(gate_t, down_t, n, seed=20 + n, d=d, f=f)
    rows_kw = dict(gate_qtype=gate_t, up_qtype=gate_t, down_qtype=down_t, activation="relu")
    sparse_kw = dict(rows_kw, gate_qtype=gate_t + quants.INTERLEAVED_SUFFIX,
                     down_qtype=down_t + quants.GROUPS_SUFFIX)
    sparse = _relu_layouts(gate, up, down, gate_t, down_t, d, f)
    got = np.asarray(jax.jit(lambda *a: ops.moe_ffn(*a, **sparse_kw))(x, ids, w, *sparse))
    _close(got, ops.moe_ffn(x, ids, w, *sparse, impl="reference", **sparse_kw))
    if down_t in quants.DOWN_PAIR_TYPES:
        _close(got, ops.moe_ffn(x, ids, w, gate, up, down, impl="reference", **rows_kw))
        _close(got, ops.moe_ffn(x, ids, w, gate, up, down, **rows_kw))
    one = _on_one_thread(lambda: ops.moe_ffn(x, ids, w, *sparse, **sparse_kw))
    np.testing.assert_array_equal(one, got)


def test_relu_experts_all_active_equal_dense():
    """Gate rows and inputs >= 0: every neuron fires, and the sparse path equals the dense one."""
    d, f, n = 128, 64, 3
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.uniform(0.1, 1.0, (n, d)).astype(np.float32))
    gate = np.stack([quants.quantize(rng.uniform(0.0, 0.1, (f, d)).astype(np.float32), "Q4_0")
                     for _ in range(E)])
    _, ids, w, _, up, down = operands("Q4_0", "Q4_0", n, seed=6, d=d, f=f)
    g = np.asarray(ops.moe_ffn(x, ids, w, jnp.asarray(gate), up, down, gate_qtype="Q4_0",
                               up_qtype="Q4_0", down_qtype="Q4_0", activation="relu"))
    kw = dict(gate_qtype="Q4_0x16", up_qtype="Q4_0", down_qtype="Q4_0g32", activation="relu")
    got = np.asarray(ops.moe_ffn(x, ids, w, *_relu_layouts(gate, up, down, "Q4_0", "Q4_0", d, f),
                                 **kw))
    _close(got, g)
    from powerinfer_jax.ops import reference

    for e in range(E):  # every neuron fires (the premise)
        assert (np.asarray(reference.qlinear(x, jnp.asarray(gate[e]), "Q4_0", d)) > 0).all()


def test_relu_neurons_that_do_not_fire_are_not_read():
    """The up rows of one token's neurons whose gate does not fire, and the down groups with no
    neuron that fires, filled with NaN scales, leave the sparse result as it was."""
    d, f = 128, 64
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", 1, seed=8, d=d, f=f)
    from powerinfer_jax.ops import reference

    nan16 = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    up_p, down_p = np.array(up), np.array(down)
    rb_f = quants.row_bytes("Q4_0", f)
    for e in range(E):
        silent = np.asarray(reference.qlinear(x, gate[e], "Q4_0", d))[0] <= 0  # [F]
        up_p[e, silent, 0:2] = nan16
        for grp in range(f // 32):
            if silent[grp * 32:(grp + 1) * 32].all():  # the file's down blocks of that group
                for r in range(d):
                    down_p[e, r, grp * 18:grp * 18 + 2] = nan16
        assert silent.any() and rb_f == (f // 32) * 18
    kw = dict(gate_qtype="Q4_0x16", up_qtype="Q4_0", down_qtype="Q4_0g32", activation="relu")
    before = np.asarray(ops.moe_ffn(x, ids, w, *_relu_layouts(gate, up, down, "Q4_0", "Q4_0",
                                                                d, f), **kw))
    after = np.asarray(ops.moe_ffn(x, ids, w, *_relu_layouts(gate, jnp.asarray(up_p),
                                                               jnp.asarray(down_p), "Q4_0",
                                                               "Q4_0", d, f), **kw))
    np.testing.assert_array_equal(after, before)
    assert np.isnan(np.asarray(ops.moe_ffn(x, ids, w, gate, jnp.asarray(up_p), down,
                                           gate_qtype="Q4_0", up_qtype="Q4_0",
                                           down_qtype="Q4_0", activation="relu"))).any()


def test_relu_bad_layouts_are_one_line_errors(monkeypatch):
    qid = _ffi._qid
    monkeypatch.setattr(_ffi, "_qid", lambda q: np.int32(q) if isinstance(q, int) else qid(q))
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", 2, d=128, f=64)
    kw = dict(gate_qtype="Q4_0", up_qtype="Q4_0", down_qtype="Q4_0")
    groups = dict(kw, down_qtype="Q4_0g32")
    with pytest.raises(ValueError, match=r"moe_ffn down_qtype: expected rows for silu"):
        ops.moe_ffn(x, ids, w, gate, up, down, **groups)
    with pytest.raises(ValueError, match=r"moe_ffn down \(groups\): expected uint8 \(7, 2, 2304\)"):
        ops.moe_ffn(x, ids, w, gate, up, down, activation="relu", **groups)
    with pytest.raises(ValueError, match=r"moe_ffn activation: expected one of"):
        ops.moe_ffn(x, ids, w, gate, up, down, activation="gelu", **kw)
    # the handler on its own refuses an arrangement a matrix cannot take, by id
    with pytest.raises(Exception, match=r"gate qtype: expected .*rows.*interleaved by 16.*got 1026"):
        _ffi.moe_ffn(x, ids, w, gate, up, down, **dict(kw, gate_qtype=2 | 0x400))
    with pytest.raises(Exception,
                       match=r"down qtype: expected .*down groups.*columns.*got 1538"):
        _ffi.moe_ffn(x, ids, w, gate, up, down, **dict(kw, down_qtype=2 | 0x600))  # two bits
    with pytest.raises(Exception,
                       match=r"gate: expected uint8 \[7, 64, 136\] \(Q4_0 in columns"):
        _ffi.moe_ffn(x, ids, w, gate, up, down, **dict(kw, gate_qtype=2 | 0x200))  # file rows
    with pytest.raises(Exception, match=r"down_qtype \(down groups\): expected .*got 1038"):
        _ffi.moe_ffn(x, ids, w, gate, up, down, **dict(kw, down_qtype=14 | 0x400,
                                                       activation="relu"))  # Q6_K: no groups
    # the op's own check names the down-groups names a down projection takes
    with pytest.raises(ValueError, match=r"down_qtype: expected one of .*'Q4_0g32'.*got 'Q4_Kg32'"):
        ops.moe_ffn(x, ids, w, gate, up, down, **dict(kw, down_qtype="Q4_Kg32"))


@pytest.mark.parametrize("relu", [False, True])
def test_ids_of_other_shards_add_nothing(relu):
    """An id of -1 (an expert another shard holds) adds nothing: the same as its weight 0."""
    d, f, n = 128, 64, 4
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", n, seed=9, d=d, f=f)
    other = np.asarray(ids).copy()
    other[::2, 0] = -1  # every other token's first expert lives elsewhere
    w0 = np.where(other < 0, 0.0, np.asarray(w)).astype(np.float32)
    kw = dict(gate_qtype="Q4_0", up_qtype="Q4_0", down_qtype="Q4_0")
    mats = (gate, up, down)
    if relu:
        kw = dict(kw, gate_qtype="Q4_0x16", down_qtype="Q4_0g32", activation="relu")
        mats = _relu_layouts(gate, up, down, "Q4_0", "Q4_0", d, f)
    got = np.asarray(ops.moe_ffn(x, jnp.asarray(other), w, *mats, **kw))
    _close(got, ops.moe_ffn(x, ids, jnp.asarray(w0), *mats, impl="reference", **kw))
    _close(got, ops.moe_ffn(x, jnp.asarray(other), w, *mats, impl="reference", **kw))


def _columns_experts(stack, qtype):
    """Each expert in the columns layout (models/moe.py's "columns": input sparsity)."""
    from powerinfer_jax.models.qweights import columns

    return jnp.asarray(np.stack([columns(np.asarray(m), qtype).blocks
                                 for m in np.asarray(stack)]))


@pytest.mark.parametrize("gate_t,down_t,n", [
    ("Q4_0", "Q4_0", 1), ("Q4_K", "Q6_K", 4),  # the fast tier: both block sizes
    pytest.param("Q4_0", "Q4_0", 4, marks=pytest.mark.slow),
    pytest.param("Q4_1", "Q8_0", 1, marks=pytest.mark.slow),
    pytest.param("Q4_1", "Q8_0", 4, marks=pytest.mark.slow),
    pytest.param("Q4_K", "Q6_K", 1, marks=pytest.mark.slow)])
def test_columns_experts_with_masks_match_the_reference(gate_t, down_t, n):
    """Input sparsity inside experts: gate, up and down in the columns layout ("Q4_0c64"), x with
    zeroed channels and down's input zeroed below random per-expert thresholds, against the
    reference (every expert, the same masks); without masks they equal the file rows' result;
    each token's kept channels equal the reference's count and fall as the thresholds rise; one
    thread and two give the same bits."""
    big = quants.block_size(gate_t)[0] == 256 or quants.block_size(down_t)[0] == 256
    d, f = (256, 256) if big else (128, 128)
    x, ids, w, gate, up, down = operands(gate_t, down_t, n, seed=20 + n, d=d, f=f)
    rows_kw = dict(gate_qtype=gate_t, up_qtype=gate_t, down_qtype=down_t)
    col_kw = {k: v + quants.COLUMNS_SUFFIX for k, v in rows_kw.items()}
    col = [_columns_experts(gate, gate_t), _columns_experts(up, gate_t),
           _columns_experts(down, down_t)]
    dense = np.asarray(ops.moe_ffn(x, ids, w, gate, up, down, **rows_kw))
    _close(ops.moe_ffn(x, ids, w, *col, **col_kw), dense)
    rng = np.random.default_rng(n)
    xm = jnp.where(jnp.asarray(rng.random(x.shape) < 0.5), 0.0, x)  # half the channels zeroed
    thr = jnp.asarray(rng.uniform(0.0, 2.0, (E, f)).astype(np.float32))
    mkw = dict(col_kw, mid_thresholds=thr, return_kept=True)
    got, kept = jax.jit(lambda *a: ops.moe_ffn(*a, **mkw))(xm, ids, w, *col)
    want, want_kept = ops.moe_ffn(xm, ids, w, *col, impl="reference", **mkw)
    _close(got, want)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(want_kept))
    assert 0 < int(np.asarray(kept).sum()) < n * K * f  # some channels zeroed, some kept
    _, none_kept = ops.moe_ffn(xm, ids, w, *col, **dict(col_kw, return_kept=True))
    assert (np.asarray(kept) <= np.asarray(none_kept)).all()
    one = _on_one_thread(lambda: ops.moe_ffn(xm, ids, w, *col, **mkw)[0])
    np.testing.assert_array_equal(one, np.asarray(got))


def test_columns_experts_bad_operands_are_one_line_errors():
    x, ids, w, gate, up, down = operands("Q4_0", "Q4_0", 2, d=128, f=128)
    col = [_columns_experts(m, "Q4_0") for m in (gate, up, down)]
    kw = dict(gate_qtype="Q4_0c64", up_qtype="Q4_0c64", down_qtype="Q4_0c64")
    with pytest.raises(ValueError, match=r"moe_ffn mid_thresholds: expected float32 \[7, 128\]"):
        ops.moe_ffn(x, ids, w, *col, mid_thresholds=jnp.zeros((7, 64), jnp.float32), **kw)
    with pytest.raises(ValueError, match=r"moe_ffn down groups: expected rows for gate and up"):
        ops.moe_ffn(x, ids, w, *col[:2], down, activation="relu",
                    **dict(kw, down_qtype="Q4_0g32"))
    with pytest.raises(Exception, match=r"mid_thresholds: expected float32 \[7, 128\] or \[0\]"):
        _ffi.moe_ffn(x, ids, w, *col, mid_thresholds=jnp.zeros((3,), jnp.float32), **kw)
