"""A quantized GGUF kept in its block format inside the model (weights="auto"): logits against the
same file dequantized (the 8-bit activation rounding is the only difference), greedy tokens,
sparse modes on the blocks, batched == single, and the fallbacks (XLA kernels, placement)."""
import jax.numpy as jnp
import numpy as np
import pytest

import powerinfer_jax as pij
from helpers_models import tiny_llama_config, write_tiny_gguf
from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint, quants
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.runtime.decode import Request

LEGACY = {"tok_embed": "Q8_0"} | {f"layers.{i}.{n}": t for i in range(2) for n, t in (
    ("attn.q.weight", "Q4_1"), ("attn.k.weight", "Q4_0"), ("attn.v.weight", "Q8_0"),
    ("attn.o.weight", "Q5_1"), ("ffn.gate.weight", "Q4_1"), ("ffn.up.weight", "Q4_1"),
    ("ffn.down_t.weight", "Q4_1"))}
TOKENS = np.asarray([[5, 17, 99, 3, 250, 42, 7, 11]])


@pytest.fixture(scope="module")
def legacy_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "tiny.Q4_1.gguf"
    write_tiny_gguf(path, tiny_llama_config(activation="relu"), LEGACY)
    return path


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A Q4_K_M-like file (Q4_K with Q6_K attn_v and ffn_down). K-quants need rows of whole
    256-value blocks: D = 256, F = 512. Nothing here quantizes Q6_K, so those tensors are valid
    random blocks (helpers_quant.random_blocks)."""
    from helpers_models import gpt2_tokenizer_meta, random_params
    from powerinfer_jax.checkpoint import quants
    from powerinfer_jax.checkpoint.base import QuantTensor
    from powerinfer_jax.checkpoint.gguf import write_gguf

    cfg = tiny_llama_config(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512)
    params = random_params(cfg, 0)
    rng = np.random.default_rng(1)
    types = {}
    for i in range(2):
        for n in ("attn.q.weight", "attn.k.weight", "attn.o.weight", "ffn.gate.weight",
                  "ffn.up.weight"):
            types[f"layers.{i}.{n}"] = "Q4_K"
        v = f"layers.{i}.attn.v.weight"
        params[v] = QuantTensor(random_blocks("Q6_K", cfg.kv_dim, cfg.d_model, rng),
                                "Q6_K", (cfg.kv_dim, cfg.d_model))
        down = f"layers.{i}.ffn.down_t.weight"  # stored [D, F], blocked along F
        params[down] = QuantTensor(random_blocks("Q6_K", cfg.d_model, cfg.d_ff, rng),
                                   "Q6_K", (cfg.d_ff, cfg.d_model), transposed=True)
    path = tmp_path_factory.mktemp("k") / "tiny.Q4_K_M.gguf"
    write_gguf(path, cfg, params, gpt2_tokenizer_meta(), types)
    return path


def _models(path):
    q = load_checkpoint(path, keep_quantized=True)
    f = load_checkpoint(path)
    return (from_params(q.config, q.params, kernels="ffi"),
            from_params(f.config, f.params, kernels="ffi"))


@pytest.mark.slow
@pytest.mark.parametrize("down", ["default", "q8_rows", "file_layout"])
@pytest.mark.parametrize("which", ["legacy", "kquant"])
def test_quantized_model_equals_its_jnp_reference(which, down, request):
    """The kernels on the blocks against the ops' jnp references on the same blocks (XLA's
    attention, dequantize + the same 8-bit activation rounding): equal up to float rounding.
    down: the sparse kernel's layout by default (the file's blocks in down groups for the legacy
    file's Q4_1 down, Q8_0 neuron rows for the K-quant file's Q6_K), Q8_0 rows asked for, or the
    file's ffn_down (dense models)."""
    from powerinfer_jax.models.qweights import (DENSE_LAYOUT, GROUPS, MATVEC, ROWS,
                                                FfnLayout)

    path = request.getfixturevalue(f"{which}_gguf")
    q = load_checkpoint(path, keep_quantized=True)
    layout = {"file_layout": DENSE_LAYOUT, "q8_rows": FfnLayout(ROWS, ROWS, ROWS, "Q8_0"),
              "default": FfnLayout(ROWS, ROWS, GROUPS)}[down]
    fast = from_params(q.config, q.params, kernels="ffi", ffn_layout=layout)
    ref = from_params(q.config, q.params, kernels="xla", quantized=True, ffn_layout=layout)
    assert fast.layers[0].attn.q.qtype is not None and fast.layers[0].ffn.quantized
    stored = q.params["layers.1.ffn.down_t.weight"]
    got = ref.layers[1].ffn.down_t
    if down == "file_layout":  # interleaved by 16 for the matvec where the format has it
        assert got.layout == MATVEC and got.qtype == stored.qtype
        assert got.interleaved == quants.can_interleave(stored.qtype, stored.blocks.shape[0])
        assert got.weight.shape == stored.blocks.shape
        assert np.array_equal(
            np.asarray(got.weight[...]) if not got.interleaved
            else quants.deinterleave(np.asarray(got.weight[...]), got.qweight.kernel_qtype),
            np.asarray(stored.blocks))
    elif down == "default" and which == "legacy":
        assert got.layout == GROUPS and got.qtype == stored.qtype == "Q4_1"
        assert got.weight.shape == (q.config.d_ff // 32, stored.blocks.size // (q.config.d_ff // 32))
    else:
        assert got.qtype == "Q8_0" and got.layout == ROWS  # down rows re-blocked per neuron
    a, b = np.asarray(fast(TOKENS)), np.asarray(ref(TOKENS))
    assert_close(a, b, "quantized_model")


@pytest.mark.parametrize("which", ["legacy", "kquant"])
def test_each_quantized_matmul_is_close_to_float_math(which, request):
    """Against the same file dequantized, each matmul differs only by the 8-bit activations (and
    the down rows' re-blocking): under 1.5% of the output's scale op by op for the legacy formats
    (activations rounded per 32 values), 3% for K-quants (per 256, as llama.cpp's Q8_K)."""
    quant, dense = _models(request.getfixturevalue(f"{which}_gguf"))
    bound = 0.015 if which == "legacy" else 0.03
    d = quant.config.d_model
    x = np.random.default_rng(0).standard_normal((1, 3, d)).astype(np.float32)
    for lq, lf in zip(quant.layers, dense.layers):
        for name in ("q", "k", "v"):
            a = np.asarray(getattr(lq.attn, name)(x))
            b = np.asarray(getattr(lf.attn, name)(x))
            assert np.abs(a - b).max() < bound * np.abs(b).max(), (name, which)
        a, b = np.asarray(lq.ffn(x)), np.asarray(lf.ffn(x))
        assert np.abs(a - b).max() < bound * np.abs(b).max(), ("ffn", which)


def test_the_q4_predictor_on_kept_blocks_is_refused_by_what_it_would_do(legacy_gguf):
    """On a model kept in its file's blocks the q4 "predictor" would compute every neuron from
    the model's own rows: refused before any artifact is read, naming what runs it by its name."""
    with pytest.raises(pij.UserError, match=r"sparsity='predictor' with predictor='q4'.*blocks"
                                            r".*sparsity='oracle' with target_sparsity"):
        pij.load(str(legacy_gguf), sparsity="predictor", target_sparsity=0.5, progress=False)
    with pytest.raises(pij.UserError, match=r"predictor='q4'"):
        pij.load(str(legacy_gguf), sparsity="predictor", gate_up="q4", target_sparsity=0.5,
                 progress=False)


@pytest.mark.slow
def test_weights_auto_keeps_the_file_format_and_dtype_dequantizes(legacy_gguf):
    q = pij.load(str(legacy_gguf), progress=False)
    f = pij.load(str(legacy_gguf), weights="dtype", progress=False)
    w = q.session.describe()["weights"]
    # dense: q, gate, up and the file's ffn_down as stored in Q4_1; v and the embedding in Q8_0
    assert (w["Q4_1"], w["Q8_0"], w["Q4_0"], w["Q5_1"]) == (8, 3, 2, 2), w
    sparse = pij.load(str(legacy_gguf), sparsity="oracle", progress=False)
    # a sparse mode reads down rows per active neuron: the file's Q4_1 blocks in down groups
    w = sparse.session.describe()["weights"]
    assert (w["Q4_1"], w["Q8_0"], w["Q4_0"], w["Q5_1"]) == (8, 3, 2, 2), w
    assert all(l.ffn.down_t.layout == "groups" for l in sparse.session.model.layers)
    # the two down layouts agree up to their rounding (the 8-bit activations the file's layout
    # multiplies by; the groups take a_i as floats): the bound of the op-by-op test above
    x = np.random.default_rng(1).standard_normal((1, 3, q.config.d_model)).astype(np.float32)
    for ls, ld in zip(sparse.session.model.layers, q.session.model.layers):
        ls.ffn.set_selector(None)  # the oracle's threshold is calibrated: compare every neuron
        a, b = np.asarray(ls.ffn(x)), np.asarray(ld.ffn(x))
        assert np.abs(a - b).max() < 0.015 * np.abs(b).max()
    assert set(f.session.describe()["weights"]) == {"float32"}
    out_q = q.generate("the quick brown fox", max_new_tokens=8)
    assert 1 <= len(out_q.token_ids) <= 8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["oracle", "threshold"])
def test_sparse_modes_run_on_the_blocks(legacy_gguf, mode):
    from helpers_models import with_mode

    from powerinfer_jax.sparsity import modes

    q = load_checkpoint(legacy_gguf, keep_quantized=True)
    cfg = pij.SparsityConfig(mode=mode)
    quant = from_params(q.config, q.params, kernels="ffi",
                        ffn_layout=modes.ffn_layout(cfg, q.config))  # loaded for the mode
    with_mode(quant, cfg, thresholds=(0.0,) * 2)
    dense_like = np.asarray(quant(TOKENS))  # threshold 0: every non-zero activation
    with_mode(quant, pij.SparsityConfig())
    assert_close(dense_like, quant(TOKENS), "other_path")


@pytest.mark.slow
def test_batched_greedy_equals_single_on_blocks(legacy_gguf):
    llm = pij.load(str(legacy_gguf), max_batch=3, max_seq_len=64, progress=False)
    eng = llm.session.engine
    prompts = [llm.encode(p) for p in ("the quick brown fox", "hello", "a b c d e f")]
    alone = [eng.generate(p, max_new_tokens=6).tokens for p in prompts]
    assert [r.tokens for r in eng.run([Request(p, 6) for p in prompts])] == alone


@pytest.mark.slow
def test_placement_dequantizes_and_xla_kernels_dequantize(legacy_gguf):
    placed = pij.load(str(legacy_gguf), vram_budget=1.0, progress=False)
    assert set(placed.session.describe()["weights"]) == {"float32"}
    xla = pij.load(str(legacy_gguf), kernels="xla", progress=False)
    assert set(xla.session.describe()["weights"]) == {"float32"}
    assert len(xla.generate("hello", max_new_tokens=3).token_ids) >= 1


@pytest.mark.slow
def test_sparsity_auto_times_once_then_reuses_its_decision(legacy_gguf, tmp_path, capsys):
    """--sparsity auto on a calibrated model: dense and the q4-activations mode are timed here and
    the faster kept, with the measurements in describe(); the next build reuses the decision;
    a corrupt decision file is measured again. Without artifacts: dense, saying why."""
    from powerinfer_jax import calibrate

    arts = tmp_path / "arts"
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. a b c d e f g. " * 80)
    none = pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(tmp_path / "empty"),
                    progress=False).session.describe()["auto"]
    assert none["chosen"] == "dense" and "could not be built" in none["why"]
    calibrate.main(["--model", str(legacy_gguf), "--corpus", str(text), "--ctx", "32",
                    "--out", str(arts), "--no-progress"])
    first = pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(arts), progress=False)
    a = first.session.describe()["auto"]
    # blocks kept: the candidate is the oracle at the target (the file's own activations)
    assert a["chosen"] in ("dense", "oracle") and not a["cached"]
    assert set(a["tok_s"]) == {"dense", "oracle"} and "x dense" in a["why"]
    assert first.session.sparsity.mode == a["chosen"]
    again = pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(arts), progress=False)
    assert again.session.describe()["auto"]["cached"]
    assert again.session.describe()["auto"]["chosen"] == a["chosen"]
    [choice] = arts.glob("auto_choice-*.json")
    # another dtype is another decision, in its own file: the first one stays cached (not
    # another thread count: a test before this one may have pinned the process to one CPU)
    one = pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(arts), dtype="bfloat16",
                   progress=False)
    assert not one.session.describe()["auto"]["cached"]
    assert len(list(arts.glob("auto_choice-*.json"))) == 2
    assert pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(arts),
                    progress=False).session.describe()["auto"]["cached"]
    choice.write_text("{not json")
    redo = pij.load(str(legacy_gguf), sparsity="auto", artifacts=str(arts), progress=False)
    assert not redo.session.describe()["auto"]["cached"]


def test_down_rows_in_the_sparse_layout_refuse_the_dense_call(legacy_gguf):
    """Neuron rows (the sparse kernel's layout) are no matvec: called as one, a one-line error
    names the layout. Layouts are arranged once, at load (from_params' ffn_layout, the build
    plan's): a model loaded for one mode and configured for another whose layouts it does not
    serve is refused with a one-line error, never converted back."""
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.errors import UserError
    from powerinfer_jax.models.qweights import (DENSE_LAYOUT, GROUPS, ROWS, FfnLayout,
                                                check_ffn_layout, serves)
    from powerinfer_jax.sparsity import modes

    q = load_checkpoint(legacy_gguf, keep_quantized=True)
    groups = FfnLayout(ROWS, ROWS, GROUPS)
    rows_layout = FfnLayout(ROWS, ROWS, ROWS, "Q8_0")
    sparse = from_params(q.config, q.params, kernels="ffi", ffn_layout=groups)  # Q4_1 groups
    rows = from_params(q.config, q.params, kernels="ffi", ffn_layout=rows_layout)
    a = np.ones((1, 1, q.config.d_ff), np.float32)
    with pytest.raises(UserError, match=r"DownT call: expected float rows or the file's "
                                        r"ffn_down layout \(matvec\), got .*down groups in Q4_1"):
        sparse.layers[0].ffn.down_t(a)
    with pytest.raises(UserError, match=r"got .*neuron rows in Q8_0"):
        rows.layers[0].ffn.down_t(a)
    assert sparse.layers[0].ffn.layout == groups and sparse.layers[0].ffn.down_t.qtype == "Q4_1"
    assert rows.layers[0].ffn.layout == rows_layout
    # rows serve a plan that asks for groups (no second rounding); groups do not serve rows
    assert serves(rows_layout, groups) and not serves(groups, rows_layout)
    check_ffn_layout(rows.layers[0].ffn, groups, "test")
    dense = from_params(q.config, q.params, kernels="ffi", ffn_layout=DENSE_LAYOUT)
    assert dense.layers[0].ffn.layout == DENSE_LAYOUT
    assert not serves(DENSE_LAYOUT, groups) and not serves(groups, DENSE_LAYOUT)
    with pytest.raises(UserError, match=r"sparsity mode 'threshold': the FFN's weight layout: "
                                        r"expected gate/up/down rows/rows/groups, got "
                                        r"'matvec/matvec/matvec' \(load the model for this mode"):
        modes.configure(dense, SparsityConfig(mode="threshold"),
                        thresholds=[0.0] * q.config.n_layers)
    assert dense.layers[0].ffn.selector is None  # refused before any FFN changed
    with pytest.raises(UserError, match="the FFN's weight layout"):
        check_ffn_layout(rows.layers[0].ffn, DENSE_LAYOUT, "dense")


def _mapped_file(address: int) -> str | None:
    """The file whose mapping in this process holds `address` (from /proc/self/maps), or None."""
    from powerinfer_jax.checkpoint.gguf_file import mapping_at

    m = mapping_at(address)
    return (m.path or None) if m is not None else None


def test_a_loaded_files_blocks_are_in_memory_once(legacy_gguf):
    """The blocks are the file's own pages: the checkpoint's blocks lie in the process's mapping of
    the file (no copy), and where they start 64-byte aligned the model's arrays alias them (XLA's
    CPU client keeps such host memory as it is), so the weights are in memory once. Rows that move
    (Q/K, RoPE order) are copied. The mapping is read-only: nothing can change the weights.
    Rows interleaved for ops.qlinear (quants.interleave) are a copy in that layout, and the
    file's pages they were built from leave the resident set (release_mapped_pages)."""
    from powerinfer_jax.checkpoint.base import HOST_ALIGN

    q = load_checkpoint(legacy_gguf, keep_quantized=True)
    m = from_params(q.config, q.params, kernels="ffi")  # dense: every matrix as a matvec
    aliased = copied = 0
    for name, module in [("layers.0.ffn.up.weight", m.layers[0].ffn.up),
                         ("layers.1.ffn.up.weight", m.layers[1].ffn.up),
                         ("layers.0.ffn.down_t.weight", m.layers[0].ffn.down_t),
                         ("layers.1.ffn.down_t.weight", m.layers[1].ffn.down_t),
                         ("layers.0.attn.v.weight", m.layers[0].attn.v),
                         ("tok_embed", None)]:
        blocks = q.params[name].blocks
        assert _mapped_file(blocks.ctypes.data) == str(legacy_gguf), name
        assert not blocks.flags.writeable, name
        weight = np.asarray(m.tok_embed[...] if module is None else module.weight[...])
        qtype = m.embed_kernel_qtype if module is None else module.qweight.kernel_qtype
        if quants.interleaved_base(qtype):
            np.testing.assert_array_equal(weight, quants.interleave(blocks, q.params[name].qtype))
            assert _mapped_file(weight.ctypes.data) != str(legacy_gguf), name
            copied += 1
            continue
        np.testing.assert_array_equal(weight, blocks)
        if blocks.ctypes.data % HOST_ALIGN == 0:
            assert np.shares_memory(weight, blocks), name
            aliased += 1
    assert aliased and copied, (aliased, copied)
    q_rows = q.params["layers.0.attn.q.weight"].blocks  # RoPE order: rows moved, so a copy
    assert _mapped_file(q_rows.ctypes.data) != str(legacy_gguf)
    with pytest.raises(ValueError, match="read-only"):
        q.params["layers.0.ffn.up.weight"].blocks[0, 0] = 1


def test_aligned_copies_only_when_asked_or_needed():
    from powerinfer_jax.checkpoint.base import HOST_ALIGN, aligned

    raw = np.arange(1000, dtype=np.uint8)
    for start in range(8):  # every misalignment of a view into `raw`
        a = raw[start:start + 640].reshape(10, 64)
        b = aligned(a)
        assert b.ctypes.data % HOST_ALIGN == 0 and b.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
        assert aligned(b) is b
        c = aligned(b, copy=True)
        assert c is not b and not np.shares_memory(b, c) and c.ctypes.data % HOST_ALIGN == 0
    f = aligned(np.ones((3, 5), np.float32)[:, 1:])  # not contiguous, another dtype
    assert f.dtype == np.float32 and f.shape == (3, 4) and f.flags.c_contiguous


def test_gate_up_layout_follows_the_plan(legacy_gguf):
    """Quantized gate/up load interleaved by 16 for a dense plan (the matvecs); the oracle's plan
    computes every neuron from that layout; a selector whose scores pick rows one by one needs
    the file's rows, byte for byte, loaded so. Installing a selector never converts: on the wrong
    layout it is a one-line error. The FFN's output stays the same up to float rounding."""
    from powerinfer_jax.errors import UserError
    from powerinfer_jax.models.qweights import GROUPS, MATVEC, ROWS, FfnLayout
    from powerinfer_jax.sparsity.selectors import GateMagnitude, Oracle

    q = load_checkpoint(legacy_gguf, keep_quantized=True)
    m = from_params(q.config, q.params, kernels="ffi")
    ffn = m.layers[0].ffn
    stored = q.params["layers.0.ffn.up.weight"]
    assert quants.can_interleave(stored.qtype, stored.blocks.shape[0])
    assert ffn.up.interleaved and ffn.gate.interleaved and ffn.up.qtype == stored.qtype
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, q.config.d_model)),
                    jnp.float32)
    dense = np.asarray(ffn(x))
    with pytest.raises(UserError, match="FFN layouts for selector Oracle: expected"):
        ffn.set_selector(Oracle(0.0))  # down still the dense matvec's
    ffn = from_params(q.config, q.params, kernels="ffi",
                      ffn_layout=FfnLayout(MATVEC, MATVEC, GROUPS)).layers[0].ffn
    ffn.set_selector(Oracle(0.0))  # the oracle at 0: every neuron
    assert ffn.up.interleaved
    oracle = np.asarray(ffn(x))
    with pytest.raises(UserError, match="FFN layouts for selector GateMagnitude"):
        ffn.set_selector(GateMagnitude(0.0))  # scores read rows one by one
    ffn = from_params(q.config, q.params, kernels="ffi",
                      ffn_layout=FfnLayout(ROWS, ROWS, GROUPS)).layers[0].ffn
    ffn.set_selector(GateMagnitude(0.0))
    assert not ffn.up.interleaved and not ffn.gate.interleaved
    np.testing.assert_array_equal(np.asarray(ffn.up.weight[...]), np.asarray(stored.blocks))
    scored = np.asarray(ffn(x))
    for y in (oracle, scored):
        assert_close(y, dense, "quantized_layouts")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_interleaved_copies_are_made_ahead_and_each_taken(tmp_path, monkeypatch, tied, sparse):
    """from_params starts every interleaved copy on the pool before it builds the modules
    (qweights.batched_load); the modules take exactly those copies (none made twice, none left
    unused: the tied embedding only when it is the LM head, ffn_down only for a dense model),
    byte for byte the layout quants.interleave spells out."""
    from powerinfer_jax.models import qweights

    # a sparse plan reads gate/up rows one by one and down in groups: only attention interleaved
    layout = qweights.FfnLayout("rows", "rows", "groups") if sparse else qweights.DENSE_LAYOUT
    path = tmp_path / "tiny.gguf"
    # 320 tokens: a multiple of 16, so a tied Q8_0 embedding takes the layout too
    write_tiny_gguf(path, tiny_llama_config(activation="relu", tie_embeddings=tied,
                                            vocab_size=320), LEGACY)
    q = load_checkpoint(path, keep_quantized=True)
    loads = []

    class Recorded(qweights._Load):
        def __init__(self):
            super().__init__()
            loads.append(self)

    monkeypatch.setattr(qweights, "_Load", Recorded)
    m = from_params(q.config, q.params, kernels="ffi", ffn_layout=layout)
    names = ("attn.q", "attn.k", "attn.v", "attn.o") + (() if sparse else ("ffn.gate", "ffn.up"))
    modules = {f"layers.{i}.{n}": getattr(getattr(m.layers[i], n.split(".")[0]),
                                          n.split(".")[1])
               for i in range(2) for n in names}
    interleaved = 0
    for name, module in modules.items():
        stored = q.params[name + ".weight"]
        if quants.can_interleave(stored.qtype, stored.blocks.shape[0]):
            assert module.interleaved and module.qtype == stored.qtype, name
            np.testing.assert_array_equal(np.asarray(module.weight[...]),
                                          quants.interleave(stored.blocks, stored.qtype))
            interleaved += 1
    if sparse:
        assert not any(m.layers[i].ffn.up.interleaved or m.layers[i].ffn.gate.interleaved
                       for i in range(2))
    assert (m.embed_kernel_qtype == "Q8_0x16") == tied
    down = m.layers[0].ffn.down_t
    assert down.interleaved == (not sparse) and down.qtype == "Q4_1"
    expected = interleaved + tied + (0 if sparse else 2)
    assert len(loads) == 1 and [loads[0].stats[k] for k in ("ahead", "claimed")] == [
        expected, expected], [load.stats for load in loads]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux madvise")
def test_each_file_views_pages_leave_as_soon_as_its_copy_is_made(tmp_path, monkeypatch):
    """interleave_ahead drops a file view's pages right after its copy, before the next copy
    starts (the load's peak is then the copies, not the copies and the whole file), and the
    copies are the interleaved rows of the file's bytes (faulted back in where read again)."""
    import mmap

    from test_checkpoint_gguf import _mapping_rss

    from powerinfer_jax.models import qweights
    from powerinfer_jax.ops import _ffi

    page, n = mmap.PAGESIZE, 4
    rows, row_bytes = 16, 18 * 64 * 4  # Q4_0: 16 rows of 256 blocks, several pages each
    data = random_blocks("Q4_0", rows * n, row_bytes // 18 * 32, np.random.default_rng(3))
    path = tmp_path / "rows.bin"
    data.tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = np.frombuffer(mm, np.uint8).reshape(rows * n, row_bytes)
    views = [whole[i * rows:(i + 1) * rows] for i in range(n)]
    assert int(whole.sum(dtype=np.int64)) > 0  # every page resident
    resident = []
    real = _ffi._pij_ext.interleave_many

    def recorded(jobs):
        resident.append(_mapping_rss(whole.ctypes.data))
        real(jobs)

    monkeypatch.setattr(_ffi._pij_ext, "interleave_many", recorded)
    load = qweights._Load()
    load.interleave_ahead((v, "Q4_0") for v in views)
    load.finish()
    assert len(resident) == n and all(b < a for a, b in zip(resident, resident[1:])), resident
    assert load.stats["released"] >= (n * rows * row_bytes // page - n) * page
    for v in views:
        copy, qtype = load.take(v)
        assert qtype == "Q4_0x16"
        np.testing.assert_array_equal(copy, quants.interleave(v, "Q4_0"))
    del whole, views, v, load, copy
    mm.close()


def test_an_error_while_interleaving_ahead_reaches_the_caller(legacy_gguf, monkeypatch):
    """A failure on the pool's side of the load is raised by from_params (after the pool has
    stopped writing), not lost in its thread or left waiting."""
    from powerinfer_jax.ops import _ffi

    def broken(jobs):
        raise RuntimeError(f"interleave_many failed on {len(jobs)} jobs")

    monkeypatch.setattr(_ffi._pij_ext, "interleave_many", broken)
    q = load_checkpoint(legacy_gguf, keep_quantized=True)
    with pytest.raises(RuntimeError, match=r"interleave_many failed on \d+ jobs"):
        from_params(q.config, q.params, kernels="ffi")
