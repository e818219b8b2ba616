"""The quantized sparse FFN custom call vs its jnp reference (gguf dequantization + the same int8
activation rounding), over every block format as gate/up and as re-blocked down rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import quants
from powerinfer_jax.ops import _ffi, reference

F = 37
# (gate/up type, down type): every format appears on both sides.
PAIRS = [("Q4_0", "Q8_0"), ("Q4_1", "Q4_1"), ("Q5_0", "Q5_1"), ("Q5_1", "Q4_0"),
         ("Q8_0", "Q5_0"), ("Q2_K", "Q6_K"), ("Q3_K", "Q4_K"), ("Q4_K", "Q8_0"),
         ("Q5_K", "Q3_K"), ("Q6_K", "Q2_K"), ("Q4_K", "Q5_K")]


def _dim(*qtypes):
    return 512 if any(quants.block_size(t)[0] == 256 for t in qtypes) else 160


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    assert_close(got, want, "quantized")


def ffn(gu, dn, seed, *, t, gated=True, bias=False, f=F, gate_type=None):
    rng = np.random.default_rng(seed)
    gate_type = gate_type or gu
    d = _dim(gu, dn, gate_type)
    w = dict(up=random_blocks(gu, f, d, rng), down=random_blocks(dn, f, d, rng), up_qtype=gu,
             down_qtype=dn, gate=random_blocks(gate_type, f, d, rng) if gated else None,
             gate_qtype=gate_type if gated else None,
             b_up=rng.standard_normal(f).astype(np.float32) if bias else None,
             b_down=rng.standard_normal(d).astype(np.float32) if bias else None)
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    return x, w, rng


def activations(x, w, activation="silu"):
    """The reference's a [T, F] (to place thresholds away from any a)."""
    d = x.shape[-1]
    up = reference.qlinear(x, w["up"], w["up_qtype"], d, w["b_up"])
    if w["gate"] is None:
        return np.asarray(reference.activate(activation, up))
    gate = reference.qlinear(x, w["gate"], w["gate_qtype"], d)
    return np.asarray(reference.gated_activate(activation, gate, up))


def gap_threshold(a, q=0.5):
    """A threshold near the q-quantile of |a| in the middle of a gap between values, so that
    float rounding cannot move any neuron across it."""
    v = np.sort(np.abs(a).ravel())
    k = int(q * (len(v) - 1))
    lo, hi = max(k - 5, 0), min(k + 5, len(v) - 1)
    gaps = np.diff(v[lo:hi + 1])
    i = lo + int(np.argmax(gaps))
    assert v[i + 1] - v[i] > 1e-4 * v[i + 1], "no clear gap near the quantile"
    return float((v[i] + v[i + 1]) / 2)


def run_both(x, w, **kw):
    got = ops.qsparse_ffn(x, w["up"], w["down"], **{k: v for k, v in w.items()
                                                      if k not in ("up", "down")}, **kw)
    want = ops.qsparse_ffn(x, w["up"], w["down"], impl="reference",
                           **{k: v for k, v in w.items() if k not in ("up", "down")}, **kw)
    return got, want


@pytest.mark.slow
@pytest.mark.parametrize("gu,dn", PAIRS)
@pytest.mark.parametrize("t", [1, 3, 8, 17])
def test_oracle_matches_reference(gu, dn, t):
    x, w, _ = ffn(gu, dn, t, t=t)
    thr = gap_threshold(activations(x, w))
    (y, n), (y_ref, n_ref) = run_both(x, w, threshold=thr, criterion="oracle")
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    assert 0 < int(np.asarray(n).min()) and int(np.asarray(n).max()) < F


@pytest.mark.slow
@pytest.mark.parametrize("gu,dn", PAIRS[::2])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_scores_match_reference(gu, dn, t):
    x, w, rng = ffn(gu, dn, 100 + t, t=t)
    scores = jnp.asarray(rng.standard_normal((t, F), dtype=np.float32))
    (y, n), (y_ref, n_ref) = run_both(x, w, scores=scores, threshold=0.3, criterion="scores")
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["silu", "relu", "gelu", "drelu"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t", [1, 5])
def test_activations_gating_and_biases(activation, gated, bias, t):
    x, w, _ = ffn("Q4_1", "Q8_0", 7, t=t, gated=gated, bias=bias)
    (y, n), (y_ref, n_ref) = run_both(x, w, threshold=0.0, activation=activation)
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))


@pytest.mark.slow
@pytest.mark.parametrize("gate_type,up_type", [("Q4_K", "Q6_K"), ("Q8_0", "Q4_K")])
def test_gate_and_up_of_different_types(gate_type, up_type):
    """Separate passes (and, for Q8_0 + Q4_K, activations rounded per 32 and per 256)."""
    x, w, _ = ffn(up_type, "Q8_0", 8, t=3, gate_type=gate_type)
    (y, n), (y_ref, n_ref) = run_both(x, w, threshold=0.0)
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))


@pytest.mark.parametrize("t", [1, 4])
def test_all_active_is_the_dense_quantized_ffn(t):
    """threshold 0, every neuron active: y == act(qlinear(gate)) * qlinear(up) @ dequant(down)."""
    x, w, _ = ffn("Q4_K", "Q6_K", 9, t=t)
    y, n = ops.qsparse_ffn(x, w["up"], w["down"], up_qtype="Q4_K", down_qtype="Q6_K",
                           gate=w["gate"], threshold=0.0)
    assert np.all(np.asarray(n) == F)
    d = x.shape[-1]
    a = jax.nn.silu(ops.qlinear(x, w["gate"], "Q4_K", d)) * ops.qlinear(x, w["up"], "Q4_K", d)
    dense = np.asarray(a) @ quants.dequantize(w["down"], "Q6_K")
    _close(y, dense)


def test_scores_never_read_unselected_rows():
    """Unselected neurons' gate/up/down blocks hold NaN scales: the output stays finite and equal
    to the reference on the selected ones."""
    x, w, rng = ffn("Q4_1", "Q8_0", 10, t=1)
    scores = rng.standard_normal((1, F)).astype(np.float32)
    off = scores[0] <= 0.3
    poisoned = {k: v.copy() for k, v in w.items() if k in ("up", "gate", "down")}
    for name, qtype in (("up", "Q4_1"), ("gate", "Q4_1"), ("down", "Q8_0")):
        nbytes = quants.block_size(qtype)[1]
        rows = poisoned[name][off].reshape(int(off.sum()), -1, nbytes)
        rows[..., 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        poisoned[name][off] = rows.reshape(int(off.sum()), -1)
    kw = dict(up_qtype="Q4_1", down_qtype="Q8_0", scores=scores, threshold=0.3,
              criterion="scores")
    y, _ = ops.qsparse_ffn(x, poisoned["up"], poisoned["down"], gate=poisoned["gate"], **kw)
    y_ref, _ = ops.qsparse_ffn(x, w["up"], w["down"], gate=w["gate"], impl="reference", **kw)
    assert np.all(np.isfinite(np.asarray(y)))
    _close(y, y_ref)


@pytest.mark.parametrize("t", [1, 5, 40])
def test_bitwise_deterministic_across_runs_and_thread_counts(t):
    """Pieces depend on the neuron count only, so 1, 2 and 3 threads sum the same partials in the
    same order (40 tokens: two token chunks)."""
    x, w, _ = ffn("Q4_K", "Q8_0", 11, t=t, f=700)
    assert_same_bits_over_threads(lambda: ops.qsparse_ffn(
        x, w["up"], w["down"], up_qtype="Q4_K", down_qtype="Q8_0", gate=w["gate"], threshold=0.0))


def assert_same_bits_over_threads(call):
    """call() -> (y, n) gives the same bits with 1, 2 and 3 threads (and 2 again)."""
    results = []
    for threads in (1, 2, 3, 2):
        ops.set_num_threads(threads)
        y, n = call()
        results.append((np.asarray(y), np.asarray(n)))
    ops.set_num_threads(2)
    for y, n in results[1:]:
        np.testing.assert_array_equal(y, results[0][0])
        np.testing.assert_array_equal(n, results[0][1])


def test_jit_vmap_and_no_neurons():
    x, w, _ = ffn("Q8_0", "Q4_0", 12, t=2)
    kw = dict(up_qtype="Q8_0", down_qtype="Q4_0", gate=w["gate"], threshold=0.0)
    f = jax.jit(lambda x, up, down: ops.qsparse_ffn(x, up, down, **kw))
    y, n = f(x, w["up"], w["down"])
    y_v, n_v = jax.vmap(lambda xi: ops.qsparse_ffn(xi, w["up"], w["down"], **kw))(x[:, None])
    np.testing.assert_array_equal(np.asarray(y_v)[:, 0], np.asarray(y))
    np.testing.assert_array_equal(np.asarray(n_v)[:, 0], np.asarray(n))
    b_down = np.arange(160, dtype=np.float32)
    empty = np.zeros((0, 170), np.uint8)
    y0, n0 = ops.qsparse_ffn(x, empty, np.zeros((0, 90), np.uint8), up_qtype="Q8_0",
                             down_qtype="Q4_0", b_down=b_down)
    np.testing.assert_array_equal(np.asarray(y0), np.broadcast_to(b_down, (2, 160)))
    assert np.asarray(n0).tolist() == [0, 0]


@pytest.mark.slow
def test_real_smollm2_layer_with_reblocked_down():
    """A real SmolLM2 FFN: the file's Q4_1 gate/up, down_t re-blocked to Q8_0 along D."""
    from helpers_models import real_gguf_path
    from powerinfer_jax.checkpoint import load_checkpoint

    path = real_gguf_path()
    if path is None:
        pytest.skip("no SmolLM2 GGUF: set PIJ_TEST_GGUF or fetch smollm2-135m into the cache")
    p = load_checkpoint(path, keep_quantized=True).params
    gate, up = p["layers.5.ffn.gate.weight"], p["layers.5.ffn.up.weight"]
    down = p["layers.5.ffn.down_t.weight"].reblocked("Q8_0")
    assert down.shape == (1536, 576) and not down.transposed
    x = jnp.asarray(np.random.default_rng(13).standard_normal((3, 576), dtype=np.float32))
    kw = dict(up_qtype=up.qtype, down_qtype="Q8_0", gate=gate.blocks, gate_qtype=gate.qtype,
              threshold=0.05)
    y, n = ops.qsparse_ffn(x, up.blocks, down.blocks, **kw)
    y_ref, n_ref = ops.qsparse_ffn(x, up.blocks, down.blocks, impl="reference", **kw)
    _close(y, y_ref)
    assert np.abs(np.asarray(n) - np.asarray(n_ref)).max() <= 1  # a neuron may sit at 0.05


@pytest.mark.parametrize("bad,match", [
    (dict(up_qtype="F32"), r"up_qtype: expected one of .*got 'F32' \(float weights take"),
    (dict(down=np.zeros((F, 99), np.uint8)),
     r"down \(down_t rows blocked along D\): expected uint8 \[37, 170\]"),
    (dict(down=np.zeros((36, 170), np.uint8)), r"down .*expected uint8 \[37, 170\]"),
    (dict(gate=np.zeros((F, 99), np.uint8)), r"gate: expected uint8 \[37, 100\]"),
    (dict(b_up=np.zeros(5, np.float32)), r"b_up shape: expected \[37\]"),
    (dict(criterion="scores"), r"scores: expected an array \[..., F\]"),
    (dict(criterion="activations"), r"criterion: expected one of \['scores', 'oracle'\]"),
    (dict(threshold=-1.0), r"threshold: expected a finite float >= 0"),
    (dict(activation="tanh"), r"activation: expected one of"),
])
def test_bad_input_is_a_clear_error(bad, match):
    x, w, _ = ffn("Q4_1", "Q4_0", 14, t=2)  # gate/up rows 100 bytes, down rows (Q4_0) 90
    w["down"] = random_blocks("Q8_0", F, 160, np.random.default_rng(0))
    w["down_qtype"] = "Q8_0"
    args = {**dict(up=w["up"], down=w["down"], gate=w["gate"], up_qtype="Q4_1",
                   down_qtype="Q8_0", b_up=None, threshold=0.0, activation="silu",
                   criterion="oracle"), **bad}
    if "gate" in bad:
        args["gate_qtype"] = "Q4_1"
    with pytest.raises(ValueError, match=match):
        ops.qsparse_ffn(x, args.pop("up"), args.pop("down"), **args)


def test_handler_validates_too():
    x, w, _ = ffn("Q4_1", "Q8_0", 15, t=2)
    base = dict(up_qtype="Q4_1", down_qtype="Q8_0", gate=w["gate"], gate_qtype="Q4_1",
                b_up=None, b_down=None, scores=None, threshold=0.0, activation="silu",
                criterion="oracle")
    call = lambda **kw: jax.block_until_ready(
        _ffi.qsparse_ffn(x, kw.pop("up", w["up"]), kw.pop("down", w["down"]), **{**base, **kw}))
    with pytest.raises(Exception, match=r"qsparse_ffn: down qtype: expected a GGML block type id"):
        call(down_qtype="F32")
    with pytest.raises(Exception, match=r"qsparse_ffn: down: expected uint8 \[37, 170\]"):
        call(down=w["down"][:30])
    with pytest.raises(Exception,
                       match=r"qsparse_ffn: gate: expected uint8 \[37, 120\].*\[37, 100\]"):
        call(gate_qtype="Q5_1", gate=np.zeros((F, 100), np.uint8))
    with pytest.raises(Exception, match=r"qsparse_ffn: criterion: expected one of scores, oracle"):
        call(criterion="activations")
    with pytest.raises(Exception, match=r"qsparse_ffn: scores: expected float32 \[..., 37\]"):
        call(criterion="scores", scores=np.zeros((2, 5), np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["oracle", "scores"])
def test_nan_input_or_score_reaches_the_output(criterion):
    """A NaN activation (or score) counts as active, as in ops.sparse_ffn: a NaN input token gives
    a NaN output instead of a silently all-zero FFN."""
    x, w, rng = ffn("Q4_1", "Q8_0", 17, t=2)
    x = x.at[1, 5].set(jnp.nan)
    scores = rng.standard_normal((2, F)).astype(np.float32)
    scores[0, 3] = np.nan
    (y, n), (y_ref, n_ref) = run_both(x, w, scores=scores, threshold=0.05, criterion=criterion)
    y, y_ref = np.asarray(y), np.asarray(y_ref)
    assert np.all(np.isnan(y[1])) and np.all(np.isnan(y_ref[1]))
    if criterion == "oracle":
        assert int(np.asarray(n)[1]) == F == int(np.asarray(n_ref)[1])
    else:  # the NaN score selects neuron 3 for token 0
        assert int(np.asarray(n)[0]) == int(np.asarray(n_ref)[0]) == int((~(scores[0] <= 0.05)).sum())
    _close(y[:1], y_ref[:1])


@pytest.mark.slow
@pytest.mark.parametrize("criterion", ["oracle", "scores"])
@pytest.mark.parametrize("gu,dn", [("Q4_1", "Q8_0"), ("Q4_K", "Q6_K")])
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(gu, dn, criterion):
    """Batched decoding: each token's sum over its own active down rows, in the same order as
    when it is decoded alone (the multi-token path once shared a row's dequantization across
    tokens and rounded differently). Many neurons and 16 tokens: several pieces and tiles."""
    x, w, rng = ffn(gu, dn, 23, t=16, f=300)
    scores = rng.standard_normal((16, 300)).astype(np.float32)
    kw = dict(scores=scores if criterion == "scores" else None, criterion=criterion,
              threshold=0.3 if criterion == "scores" else float(gap_threshold(activations(x, w))))
    y, n = ops.qsparse_ffn(x, **w, **kw)
    for t in range(16):
        one = dict(kw, scores=None if kw["scores"] is None else scores[t:t + 1])
        y1, n1 = ops.qsparse_ffn(x[t:t + 1], **w, **one)
        np.testing.assert_array_equal(np.asarray(y1)[0], np.asarray(y)[t])
        assert int(np.asarray(n1)[0]) == int(np.asarray(n)[t])


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["relu", "drelu"])
@pytest.mark.parametrize("criterion", ["oracle", "scores"])
@pytest.mark.parametrize("t", [1, 3])
def test_relu_gate_off_rows_are_never_read(activation, criterion, t):
    """ReLU-family gates: where no token's gate is positive, a_i is exactly 0 whatever the up row
    holds, so its down row (selected by scores or not) is never read and its up value never
    reaches the output (the oracle reads no such up row; selected by scores, the up row is read
    with the gate's, in one tile, and its value dropped). Those rows are poisoned with NaN scales
    here: the output still equals the reference on clean rows, and the counts still count every
    selected neuron."""
    x, w, rng = ffn("Q4_0", "Q4_0", 40 + t, t=t, f=64)
    d = x.shape[-1]
    gate = np.asarray(reference.qlinear(x, w["gate"], "Q4_0", d))  # [T, F]
    off = np.all(gate <= 0, axis=0)
    assert 0 < off.sum() < 64
    scores = np.ones((t, 64), np.float32) if criterion == "scores" else None
    clean = run_both(x, w, scores=scores, threshold=0.0, criterion=criterion,
                     activation=activation)[1]
    poisoned = dict(w)
    for name in ("up", "down"):
        rows = np.array(w[name]).reshape(64, -1, 18)  # Q4_0: fp16 scale + 16 bytes per block
        rows[off, :, 0], rows[off, :, 1] = 0x00, 0x7E  # scale = NaN
        poisoned[name] = rows.reshape(64, -1)
    y, n = ops.qsparse_ffn(x, poisoned["up"], poisoned["down"],
                           **{k: v for k, v in poisoned.items() if k not in ("up", "down")},
                           scores=scores, threshold=0.0, criterion=criterion,
                           activation=activation)
    assert np.all(np.isfinite(np.asarray(y)))
    _close(y, clean[0])
    np.testing.assert_array_equal(np.asarray(n), np.asarray(clean[1]))


# ------------------------------------------------------------------- down groups (the file's blocks)
def grouped(seed, gu, dn, *, t, f=96, d=160):
    """An FFN whose down is a random file-layout ffn_down [D, F] in `dn`, as down groups (its
    type the down-groups name, "Q4_1g32")."""
    rng = np.random.default_rng(seed)
    file_down = random_blocks(dn, d, f, rng)
    w = dict(up=random_blocks(gu, f, d, rng), down=quants.down_groups(file_down, dn, d, f),
             up_qtype=gu, down_qtype=dn + quants.GROUPS_SUFFIX, gate=random_blocks(gu, f, d, rng), gate_qtype=gu,
             b_up=None, b_down=rng.standard_normal(d).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    return x, w, file_down, rng


def test_one_encoding_of_the_arrangement_from_name_to_id():
    """A type name's suffix is its arrangement, and the id the kernels take its format's with
    one bit (cpu_backend/quant_formats.h Arrangement): the file's rows none, x16 0x100, c64
    0x200, g32 0x400."""
    for names, flag in (((t for t in quants.QUANTIZED_TYPES), 0),
                        (quants.INTERLEAVED_TYPES, 0x100), (quants.COLUMNS_TYPES, 0x200),
                        (quants.GROUPS_TYPES, 0x400)):
        for name in names:
            base, bit = quants.arrangement(name)
            assert bit == flag and quants.type_id(name) == quants.type_id(base) | flag
            assert quants.block_size(name) == quants.block_size(base)
    assert quants.groups_base("Q5_1g32") == "Q5_1" and quants.groups_base("Q5_1") is None
    with pytest.raises(ValueError, match="Q4_Kg32"):  # Q4_K has no down groups
        quants.type_id("Q4_Kg32")


def test_down_groups_round_trip_and_dequantize_as_the_file():
    """down_groups rearranges bytes only: back to the file's blocks bit for bit, and the neuron
    rows the reference reads are the file's dequantized columns."""
    rng = np.random.default_rng(20)
    for dn in quants.DOWN_GROUP_TYPES:
        file_down = random_blocks(dn, 64, 96, rng)
        groups = quants.down_groups(file_down, dn, 64, 96)
        assert groups.shape == (3, 64 * quants.block_size(dn)[1])
        np.testing.assert_array_equal(quants.down_groups_to_file(groups, dn, 64, 96), file_down)
        want = quants.dequantize(file_down, dn).T
        got = quants.dequantize(quants.down_groups_to_file(groups, dn, 64, 96), dn).T
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="Q4_K"):
        quants.down_groups(random_blocks("Q4_K", 256, 256, rng), "Q4_K", 256, 256)
    with pytest.raises(ValueError, match="multiples of 32"):
        quants.down_groups(random_blocks("Q8_0", 48, 32, rng), "Q8_0", 48, 32)


@pytest.mark.slow
@pytest.mark.parametrize("dn", quants.DOWN_GROUP_TYPES)
@pytest.mark.parametrize("t", [1, 3, 17])
def test_down_groups_match_the_file_down(dn, t):
    """Groups vs the reference on the file's own down blocks (dequantized, transposed): the
    same y up to float sum order, the same counts; oracle and scores. The 4-bit formats' pair
    rows sum 8-bit coefs (rounded per group of 32 neurons, as a dense down matvec rounds its
    input), the others float coefs."""
    x, w, file_down, rng = grouped(30 + t, "Q4_1", dn, t=t)
    d, f = 160, 96
    thr = gap_threshold(activations(x, w))
    kw = {k: v for k, v in w.items() if k not in ("up", "down")}
    y, n = ops.qsparse_ffn(x, w["up"], w["down"], threshold=thr, **kw)
    dense_down = quants.dequantize(file_down, dn).T  # [F, D]
    a = activations(x, w)
    on = np.abs(a) > thr
    coef = np.where(on, a, 0.0)
    if dn in quants.DOWN_PAIR_TYPES:
        coef = np.asarray(reference.round_activations(coef, 32))
    want = coef @ dense_down + w["b_down"]
    _close(y, want)
    np.testing.assert_array_equal(np.asarray(n), on.sum(-1))
    y_ref, n_ref = ops.qsparse_ffn(x, w["up"], w["down"], threshold=thr, impl="reference",
                                   **kw)
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    scores = rng.standard_normal((t, f)).astype(np.float32)
    ys, ns = ops.qsparse_ffn(x, w["up"], w["down"], threshold=0.3, scores=scores,
                             criterion="scores", **kw)
    ys_ref, ns_ref = ops.qsparse_ffn(x, w["up"], w["down"], threshold=0.3, scores=scores,
                                     criterion="scores", impl="reference", **kw)
    _close(ys, ys_ref)
    np.testing.assert_array_equal(np.asarray(ns), np.asarray(ns_ref))
    assert d % 32 == 0


@pytest.mark.parametrize("t", [1, 5, 40])
def test_down_groups_bitwise_deterministic_across_thread_counts(t):
    x, w, _, _ = grouped(40 + t, "Q4_0", "Q4_1", t=t, f=704)
    kw = {k: v for k, v in w.items() if k not in ("up", "down")}
    assert_same_bits_over_threads(lambda: ops.qsparse_ffn(
        x, w["up"], w["down"], threshold=0.0, **kw))


def test_down_groups_bad_input(monkeypatch):
    x, w, _, _ = grouped(50, "Q4_1", "Q4_1", t=1)
    kw = {k: v for k, v in w.items() if k not in ("up", "down", "down_qtype")}
    with pytest.raises(ValueError, match="down_qtype: expected one of"):
        ops.qsparse_ffn(x, w["up"], w["down"], down_qtype="Q4_1c64", **kw)
    with pytest.raises(ValueError, match=r"groups of 32 neurons.*\(3, 3200\)"):
        ops.qsparse_ffn(x, w["up"], w["down"][:, :-1], down_qtype="Q4_1g32", **kw)
    with pytest.raises(ValueError, match="Q6_Kg32"):
        ops.qsparse_ffn(x, w["up"], w["down"], down_qtype="Q6_Kg32", **kw)
    # the handler checks on its own (a caller past ops' checks): a clear error, no crash
    ffi_kw = dict(up_qtype="Q4_1", gate=None, gate_qtype="Q4_1", b_up=None, b_down=None,
                  scores=None, threshold=0.0, activation="silu", criterion="oracle")
    with pytest.raises(Exception, match=r"groups of 32 neurons.*\[3, 3200\]"):
        _ffi.qsparse_ffn(x, w["up"], w["down"][:, :-1], down_qtype="Q4_1g32", **ffi_kw)
    qid = _ffi._qid
    monkeypatch.setattr(_ffi, "_qid", lambda q: np.int32(q) if isinstance(q, int) else qid(q))
    with pytest.raises(Exception, match=r"down_qtype \(down groups\).*got 1038"):
        _ffi.qsparse_ffn(x, w["up"], w["down"], down_qtype=14 | 0x400, **ffi_kw)  # Q6_K
    # arrangements the down projection has not (interleaved), or two at once: refused by id
    for bad in (3 | 0x100, 3 | 0x600, 3 | 0x800):
        with pytest.raises(Exception, match=rf"down qtype: expected .*rows.*down groups.*got {bad}"):
            _ffi.qsparse_ffn(x, w["up"], w["down"], down_qtype=bad, **ffi_kw)


# ------------------------------------- 4-bit neuron rows: 8-bit coefs per 32 ids (as PowerInfer)
@pytest.mark.slow
@pytest.mark.parametrize("dn", quants.DOWN_PAIR_TYPES)
@pytest.mark.parametrize("t", [1, 3, 17])
def test_row_coefs_round_per_32_neurons(dn, t):
    """Q4_0 / Q4_1 neuron rows with F a multiple of 32 sum coefs rounded to 8 bits per 32 ids (the
    masked activations' round_activations, as PowerInfer's Q4_0 axpy takes them as Q8_0), then in
    float: against numpy on those coefs, and against the reference; oracle and scores. F = 37
    (other tests) keeps float coefs."""
    x, w, rng = ffn("Q4_1", dn, 70 + t, t=t, f=96)
    a = activations(x, w)
    thr = gap_threshold(a)
    (y, n), (y_ref, n_ref) = run_both(x, w, threshold=thr, criterion="oracle")
    coef = np.asarray(reference.round_activations(np.where(np.abs(a) > thr, a, 0.0), 32))
    assert np.any(coef != np.where(np.abs(a) > thr, a, 0.0))  # the rounding is not a no-op
    _close(y, coef @ quants.dequantize(w["down"], dn))
    _close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    scores = jnp.asarray(rng.standard_normal((t, 96), dtype=np.float32))
    (ys, ns), (ys_ref, ns_ref) = run_both(x, w, scores=scores, threshold=0.3, criterion="scores")
    _close(ys, ys_ref)
    np.testing.assert_array_equal(np.asarray(ns), np.asarray(ns_ref))


@pytest.mark.parametrize("t", [1, 5, 40])
def test_row_coefs_bitwise_deterministic_across_thread_counts(t):
    x, w, _ = ffn("Q4_0", "Q4_0", 80 + t, t=t, f=704)
    assert_same_bits_over_threads(lambda: ops.qsparse_ffn(
        x, w["up"], w["down"], up_qtype="Q4_0", down_qtype="Q4_0", gate=w["gate"],
        threshold=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("layout,dn", [("groups", "Q4_0"), ("groups", "Q4_1"), ("rows", "Q4_1")])
def test_rounded_coefs_nan_input_reaches_only_its_token(layout, dn):
    """A token whose input holds a NaN gets a non-finite y through the 8-bit coefs (down groups'
    pairs and 4-bit rows), never a silently finite one, as the reference does; the other tokens
    are unchanged."""
    if layout == "groups":
        x, w, _, _ = grouped(60, "Q4_1", dn, t=3)
    else:
        x, w, _ = ffn("Q4_1", dn, 90, t=3, f=64)
    kw = {k: v for k, v in w.items() if k not in ("up", "down")}
    bad = x.at[1, 7].set(jnp.nan)
    y, _ = ops.qsparse_ffn(bad, w["up"], w["down"], threshold=0.0, **kw)
    clean, _ = ops.qsparse_ffn(x, w["up"], w["down"], threshold=0.0, **kw)
    y_ref, _ = ops.qsparse_ffn(bad, w["up"], w["down"], threshold=0.0, impl="reference", **kw)
    y, clean, y_ref = np.asarray(y), np.asarray(clean), np.asarray(y_ref)
    assert not np.isfinite(y[1]).any() and not np.isfinite(y_ref[1]).any()
    np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])
