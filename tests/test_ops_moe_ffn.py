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


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert_close(got, want, "moe_quantized")


@pytest.mark.parametrize("gate_t,down_t", [("Q4_0", "Q4_0"), ("Q8_0", "Q8_0"),
                                           ("Q4_K", "Q6_K"), ("Q4_0", "Q8_0")])
@pytest.mark.parametrize("n", [1, 3, 16])
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
    threads = _ffi.get_num_threads()
    try:
        ops.set_num_threads(1)
        one = np.asarray(ops.moe_ffn(x, ids, w, *il, **il_kw))
    finally:
        ops.set_num_threads(threads)
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
    threads = _ffi.get_num_threads()
    try:
        ops.set_num_threads(1)
        one = np.asarray(ops.moe_ffn(x, ids, w, gate, up, down, **kw))
    finally:
        ops.set_num_threads(threads)
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
    with pytest.raises(Exception, match=r"moe_ffn: ids: expected experts in \[0, 7\), got 7"):
        jax.block_until_ready(ops.moe_ffn(x, bad, w, gate, up, down, **kw))
