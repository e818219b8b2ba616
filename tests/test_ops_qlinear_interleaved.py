"""Rows interleaved by 16 (checkpoint.quants.interleave, cpu_backend/quant_interleaved.h): the
layout ops.qlinear reads fastest, for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K. Checked
against the file's rows (the same bytes rearranged), the jnp reference, the portable kernel's
bits, and bad input."""
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.qweights import gather_rows, interleaved
from powerinfer_jax.ops import _ffi

TYPES = list(quants.INTERLEAVE_TYPES)


def _operands(qtype, seed, *, t, o=48, d=None):
    """d: 5 blocks of a 32-weight format (the AVX-512 block pairs and an odd last one), 2
    super-blocks of a K-quant."""
    d = d or (512 if quants.block_size(qtype)[0] == 256 else 160)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d), dtype=np.float32)
    return jnp.asarray(x), random_blocks(qtype, o, d, rng), d


def _record_offset(qtype, r, k):
    """Where byte k of row r's block lies in its record, spelled out per format as the kernels
    read it (quant_interleaved.h), apart from the generic map in quants.interleave_index."""
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):  # f16 fields, then 4-byte chunks
        head = 4 if qtype in ("Q4_1", "Q5_1") else 2  # (Q5's high bits: the first chunk)
        if k < head:
            return 32 * (k // 2) + 2 * r + k % 2
        j = k - head
        return 16 * head + 64 * (j // 4) + 4 * r + j % 4
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin, 3 scale words, (Q5_K: 8 high-bit chunks), quants
        if k < 4:
            return 32 * (k // 2) + 2 * r + k % 2
        j = k - 4
        return 64 + 64 * (j // 4) + 4 * r + j % 4
    if k < 192:  # Q6_K: low nibbles and high bits in chunks, 16 int8 scales, d
        return 64 * (k // 4) + 4 * r + k % 4
    if k < 208:
        return 3072 + 16 * (k - 192) + r
    return 3328 + 2 * r + (k - 208)


@pytest.mark.parametrize("qtype", TYPES)
def test_layout_round_trip_and_byte_map(qtype):
    rng = np.random.default_rng(0)
    block, nbytes = quants.block_size(qtype)
    b = random_blocks(qtype, 32, 3 * block, rng)
    packed = quants.interleave(b, qtype)
    assert packed.shape == b.shape and not np.array_equal(packed, b)
    assert np.array_equal(quants.deinterleave(packed, qtype + "x16"), b)
    rec = packed.reshape(2, 3, 16 * nbytes)  # [group, block, record]
    for g, blk, r in ((1, 2, 5), (0, 0, 15)):
        row = b[16 * g + r, blk * nbytes:(blk + 1) * nbytes]
        assert [rec[g, blk, _record_offset(qtype, r, k)] for k in range(nbytes)] == list(row)
    # the C++ packer writes the same bytes
    fast, name = interleaved(b, qtype)
    assert name == qtype + "x16" and np.array_equal(np.asarray(fast), packed)
    # dequantizing the interleaved name gives the file's weights
    assert np.array_equal(quants.dequantize(packed, name), quants.dequantize(b, qtype))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("t", [1, 2, 5, 17])
def test_matches_the_files_rows_and_the_reference(qtype, t):
    x, b, d = _operands(qtype, 1, t=t)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(48), jnp.float32)
    packed, name = interleaved(b, qtype)
    got = np.asarray(ops.qlinear(x, packed, name, d, bias))
    for want in (ops.qlinear(x, b, qtype, d, bias),
                 ops.qlinear(x, packed, name, d, bias, impl="reference")):
        assert_close(got, want, "quantized")


@pytest.mark.parametrize("qtype", TYPES)
def test_vector_kernels_give_the_portable_bits(qtype):
    """Every ISA runs the same per-lane arithmetic (quant_interleaved.h): the build's vector code
    against the portable loops, bit for bit; and a token alone equals its row in a prefill."""
    x, b, d = _operands(qtype, 3, t=7)
    packed, name = interleaved(b, qtype)
    got = np.asarray(ops.qlinear(x, packed, name, d))
    portable = np.empty_like(got)
    _ffi._pij_ext.qlinear_interleaved_portable(np.asarray(x), np.asarray(packed),
                                               quants.type_id(qtype), portable)
    assert np.array_equal(got, portable)
    alone = np.concatenate([np.asarray(ops.qlinear(x[i:i + 1], packed, name, d))
                            for i in range(x.shape[0])])
    assert np.array_equal(got, alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_across_thread_counts_and_many(threads):
    x, b, d = _operands("Q4_1", 4, t=3, o=160)
    packed, name = interleaved(b, "Q4_1")
    _, k, _ = _operands("Q4_0", 5, t=3, o=32)
    kp, kname = interleaved(k, "Q4_0")
    before = _ffi.get_num_threads()
    try:
        ops.set_num_threads(threads)
        one = np.asarray(ops.qlinear(x, packed, name, d))
        # one job over products of several layouts (the file's rows between two interleaved)
        rows = random_blocks("Q5_0", 37, d, np.random.default_rng(6))
        many = ops.qlinear_many(x, [kp, rows, packed], [kname, "Q5_0", name], d)
    finally:
        ops.set_num_threads(before)
    assert np.array_equal(one, np.asarray(many[2]))
    assert np.array_equal(np.asarray(many[0]), np.asarray(ops.qlinear(x, kp, kname, d)))
    assert np.array_equal(np.asarray(many[1]), np.asarray(ops.qlinear(x, rows, "Q5_0", d)))
    ops.set_num_threads(1 if threads == 2 else 2)
    try:
        assert np.array_equal(one, np.asarray(ops.qlinear(x, packed, name, d)))
    finally:
        ops.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES)
def test_embedding_lookup_reads_the_layout(qtype):
    rng = np.random.default_rng(7)
    b = random_blocks(qtype, 64, 3 * quants.block_size(qtype)[0], rng)
    packed, name = interleaved(b, qtype)
    ids = jnp.asarray([[0, 17, 63], [5, 5, 40]])
    assert np.array_equal(np.asarray(gather_rows(jnp.asarray(packed), ids, name)),
                          b[np.asarray(ids)])


def test_non_finite_input_reaches_only_its_token():
    x, b, d = _operands("Q4_0", 8, t=3)
    x = x.at[1, 7].set(jnp.nan)
    packed, name = interleaved(b, "Q4_0")
    y = np.asarray(ops.qlinear(x, packed, name, d))
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


def test_shapes_and_types_that_cannot_interleave_stay_as_the_files():
    rng = np.random.default_rng(9)
    for qtype, rows in (("Q4_0", 37), ("Q2_K", 32), ("Q3_K", 32), ("Q6_K", 40)):
        b = random_blocks(qtype, rows, 256, rng)
        same, name = interleaved(b, qtype)
        assert name == qtype and same is b


def test_bad_input_is_a_clear_error():
    x, b, d = _operands("Q4_0", 10, t=1)
    packed, name = interleaved(b, "Q4_0")
    with pytest.raises(UserError, match="multiple of 16 rows"):
        ops.qlinear(x, packed[:40], name, d)
    with pytest.raises(UserError, match="qtype"):
        ops.qlinear(x, packed, "Q3_Kx16", d)
    with pytest.raises(UserError, match="multiple of 16"):
        quants.interleave(b[:20], "Q4_0")
    with pytest.raises(UserError, match="interleaved rows type"):
        quants.interleave_index("Q3_K")
    # the handler checks too (an id with the interleave flag on a format without the layout)
    with pytest.raises(Exception, match="a multiple of 16 rows, got Q5_0 with 40 rows"):
        _handler_bad(x, d)
    with pytest.raises(ValueError, match="interleave_into"):
        _ffi._pij_ext.interleave_into(np.zeros((20, 18), np.uint8), 2,
                                      np.zeros((20, 18), np.uint8))
    # the batch form checks every job before it writes any: the good one's output is untouched
    good = random_blocks("Q4_0", 32, 64, np.random.default_rng(2))
    out = np.zeros_like(good)
    with pytest.raises(ValueError, match="interleave_many: expected .* got qtype 2, 20 rows"):
        _ffi._pij_ext.interleave_many([(good, 2, out), (np.zeros((20, 18), np.uint8), 2,
                                                        np.zeros((20, 18), np.uint8))])
    assert not out.any()
    _ffi._pij_ext.interleave_many([(good, 2, out)])
    np.testing.assert_array_equal(out, quants.interleave(good, "Q4_0"))
    with pytest.raises(ValueError, match="qlinear_interleaved_portable"):  # y of the wrong size
        _ffi._pij_ext.qlinear_interleaved_portable(np.asarray(x), np.asarray(packed), 2,
                                                   np.zeros((1, 47), np.float32))


def _handler_bad(x, d):
    import jax

    blocks = jnp.asarray(random_blocks("Q5_0", 40, d, np.random.default_rng(1)))  # 40 rows
    out = jax.ShapeDtypeStruct((1, 40), jnp.float32)
    call = jax.ffi.ffi_call(_ffi.QLINEAR_TARGET, out, vmap_method="expand_dims")
    return np.asarray(call(x, blocks, jnp.zeros((0,), jnp.float32),
                           qtype=np.int32(quants.type_id("Q5_0") | quants.INTERLEAVED_ID_FLAG)))


# ------------------------------------------------- the sparse FFN's oracle on interleaved gate/up
def _sparse_operands(gu, dn, seed, *, t, f=64, d=160, layout="groups", activation="silu",
                     threshold=None):
    from test_ops_qsparse_ffn import activations, gap_threshold

    rng = np.random.default_rng(seed)
    w = dict(up=random_blocks(gu, f, d, rng), gate=random_blocks(gu, f, d, rng), up_qtype=gu,
             gate_qtype=gu, down_qtype=dn, b_up=None, b_down=None)
    down_rows = random_blocks(dn, f, d, rng)  # [F, D] neuron rows; as the file: [D, F] blocks
    w["down"] = down_rows if layout == "rows" else quants.down_groups(
        quants.quantize(quants.dequantize(down_rows, dn).T.copy(), dn), dn, d, f)
    if layout == "groups":
        w["down_qtype"] = dn + quants.GROUPS_SUFFIX
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    thr = threshold if threshold is not None else gap_threshold(
        activations(x, {**w, "gate": w["gate"]}, activation))
    packed = dict(w, up=interleaved(w["up"], gu)[0], gate=interleaved(w["gate"], gu)[0],
                  up_qtype=gu + "x16", gate_qtype=gu + "x16")
    kw = dict(threshold=thr, activation=activation, criterion="oracle")
    return x, w, packed, kw


def _call(x, w, **kw):
    rest = {k: v for k, v in w.items() if k not in ("up", "down")}
    return ops.qsparse_ffn(x, w["up"], w["down"], **rest, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("gu,dn,layout", [("Q4_1", "Q4_1", "groups"), ("Q4_0", "Q8_0", "rows"),
                                          ("Q8_0", "Q4_0", "groups")])
@pytest.mark.parametrize("t", [1, 3, 6])
def test_sparse_oracle_on_interleaved_gate_up(gu, dn, layout, t):
    """Every neuron's gate/up from the interleaved groups: the same active neurons and output
    as the file's rows (other summation order) and the reference on the interleaved names; each
    token's bits alone as in the batch, whatever the thread count."""
    x, rows, packed, kw = _sparse_operands(gu, dn, t, t=t, layout=layout)
    y, n = _call(x, packed, **kw)
    y_rows, n_rows = _call(x, rows, **kw)
    y_ref, n_ref = _call(x, packed, impl="reference", **kw)
    assert np.array_equal(np.asarray(n), np.asarray(n_rows))
    assert np.array_equal(np.asarray(n), np.asarray(n_ref))
    for want in (y_rows, y_ref):
        assert_close(y, want, "quantized")
    alone = np.concatenate([np.asarray(_call(x[i:i + 1], packed, **kw)[0]) for i in range(t)])
    assert np.array_equal(np.asarray(y), alone)
    before = _ffi.get_num_threads()
    try:
        ops.set_num_threads(1 if before > 1 else 2)
        assert np.array_equal(np.asarray(_call(x, packed, **kw)[0]), np.asarray(y))
    finally:
        ops.set_num_threads(before)


def test_sparse_interleaved_gate_up_needs_the_oracle():
    x, rows, packed, kw = _sparse_operands("Q4_0", "Q4_0", 11, t=1)
    scores = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(UserError, match="interleaved by 16"):
        _call(x, packed, **{**kw, "criterion": "scores"}, scores=scores)
    with pytest.raises(UserError, match="interleaved by 16"):  # one of the two only
        _call(x, dict(packed, gate=rows["gate"], gate_qtype="Q4_0"), **kw)
    with pytest.raises(UserError, match="interleaved by 16"):  # up alone: no
        _call(x, dict(packed, gate=rows["gate"], gate_qtype="Q4_0"),
              **{**kw, "activation": "relu"})
    with pytest.raises(UserError, match="interleaved by 16"):  # the gate alone needs relu/drelu
        _call(x, dict(packed, up=rows["up"], up_qtype="Q4_0"), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["relu", "drelu"])
@pytest.mark.parametrize("gu,dn,layout", [("Q4_0", "Q4_0", "groups"), ("Q8_0", "Q8_0", "rows")])
@pytest.mark.parametrize("t", [1, 4])
def test_relu_oracle_on_interleaved_gate_and_up_rows(activation, gu, dn, layout, t):
    """A ReLU-family FFN's exact mode: every gate from the interleaved groups, up rows read only
    for neurons whose gate fires: the same active neurons and output as both on rows, and as
    the reference; each token alone as in the batch."""
    x, rows, packed, kw = _sparse_operands(gu, dn, 20 + t, t=t, layout=layout,
                                           activation=activation, threshold=0.0)
    mixed = dict(packed, up=rows["up"], up_qtype=gu)
    y, n = _call(x, mixed, **kw)
    y_rows, n_rows = _call(x, rows, **kw)
    y_ref, n_ref = _call(x, mixed, impl="reference", **kw)
    assert np.array_equal(np.asarray(n), np.asarray(n_rows))
    assert np.array_equal(np.asarray(n), np.asarray(n_ref))
    assert 0 < int(np.asarray(n).sum()) < t * 64  # some neurons off, some on
    for want in (y_rows, y_ref):
        assert_close(y, want, "quantized")
    alone = np.concatenate([np.asarray(_call(x[i:i + 1], mixed, **kw)[0]) for i in range(t)])
    assert np.array_equal(np.asarray(y), alone)
