"""FATReLU models (sparsify's fatrelu variant: config.json "fatrelu_threshold"): the threshold is
part of the model, so every path computes relu(gate) only where the gate exceeds its layer's
threshold: XLA's dense FFN against transformers' LlamaMLP with that activation, the custom
calls (float and quantized, oracle and scores criteria) against their jnp references, and the
sparsity modes against the dense model. Before, only the threshold mode applied it; dense,
oracle and predictor modes ran plain ReLU, a different model."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import powerinfer_jax as pij
from helpers_models import VOCAB, save_hf_llama, with_mode
from helpers_quant import random_blocks
from helpers_tolerances import assert_close
from powerinfer_jax import ops
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.transformer import from_params
from powerinfer_jax.ops import reference

TOKENS = np.random.default_rng(3).integers(0, VOCAB, size=(2, 9))
FLOORS = [0.08, 0.05]  # per layer: cut a good part of the tiny random model's positive gates


# ------------------------------------------------------------------------------ the custom calls
def _qffn(seed, t, f=64, qtype="Q4_0"):
    rng = np.random.default_rng(seed)
    d = 160
    w = dict(up=random_blocks(qtype, f, d, rng), down=random_blocks("Q8_0", f, d, rng),
             gate=random_blocks(qtype, f, d, rng), up_qtype=qtype, down_qtype="Q8_0",
             gate_qtype=qtype)
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    return x, w, rng


def _qcall(x, w, **kw):
    return ops.qsparse_ffn(x, w["up"], w["down"], **{k: v for k, v in w.items()
                                                      if k not in ("up", "down")}, **kw)


def _floor_between(gate, q=0.5):
    """A floor between two positive gate values near their q-quantile (float rounding cannot
    move a gate across it)."""
    v = np.sort(gate[gate > 0].ravel())
    k = int(q * (len(v) - 1))
    i = k + int(np.argmax(np.diff(v[k:k + 6])))
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("activation", ["relu", "drelu"])
@pytest.mark.parametrize("criterion", ["oracle", "scores"])
@pytest.mark.parametrize("t", [1, 3])
def test_quantized_call_applies_the_floor_as_its_reference(activation, criterion, t):
    x, w, rng = _qffn(10 + t, t)
    gate = np.asarray(reference.qlinear(x, w["gate"], "Q4_0", x.shape[-1]))
    floor = _floor_between(gate)
    scores = (jnp.asarray(rng.standard_normal((t, 64), dtype=np.float32)) if criterion == "scores"
              else None)
    kw = dict(scores=scores, threshold=0.0, criterion=criterion, activation=activation)
    y, n = _qcall(x, w, gate_floor=floor, **kw)
    y_ref, n_ref = _qcall(x, w, gate_floor=floor, impl="reference", **kw)
    assert_close(np.asarray(y), np.asarray(y_ref), "quantized")
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    y0 = np.asarray(_qcall(x, w, **kw)[0])  # plain ReLU: a different output
    assert np.abs(y0 - np.asarray(y)).max() > 1e-3 * np.abs(y0).max()
    if criterion == "oracle":  # active: exactly the neurons whose gate exceeds the floor
        up = np.asarray(reference.qlinear(x, w["up"], "Q4_0", x.shape[-1]))
        on = (gate > floor) & ((up > 0) if activation == "drelu" else (up != 0))
        np.testing.assert_array_equal(np.asarray(n), on.sum(-1))


@pytest.mark.parametrize("criterion", ["oracle", "scores"])
def test_gate_under_the_floor_reads_no_up_or_down_row(criterion):
    """Neurons whose gate is positive but at most the floor for every token are off: their up
    and down rows (poisoned with NaN scales) are never read, as plain ReLU's gate <= 0 rows."""
    t = 2
    x, w, _ = _qffn(33, t)
    gate = np.asarray(reference.qlinear(x, w["gate"], "Q4_0", x.shape[-1]))
    floor = _floor_between(gate, 0.7)
    off = np.all(gate <= floor, axis=0) & np.any(gate > 0, axis=0)
    assert off.sum() >= 4
    scores = np.ones((t, 64), np.float32) if criterion == "scores" else None
    kw = dict(scores=scores, threshold=0.0, criterion=criterion, activation="relu",
              gate_floor=floor)
    clean = _qcall(x, w, **kw)
    poisoned = dict(w)
    for name, rows_per in (("up", 64), ("down", 64)):
        rows = np.array(w[name]).reshape(rows_per, -1, 34 if name == "down" else 18)
        rows[off, :, 0], rows[off, :, 1] = 0x00, 0x7E  # fp16 scale = NaN
        poisoned[name] = rows.reshape(rows_per, -1)
    y, n = _qcall(x, poisoned, **kw)
    assert np.all(np.isfinite(np.asarray(y)))
    assert_close(np.asarray(y), np.asarray(clean[0]), "quantized")
    np.testing.assert_array_equal(np.asarray(n), np.asarray(clean[1]))


@pytest.mark.parametrize("criterion", ["oracle", "scores"])
def test_float_call_applies_the_floor_as_its_reference(criterion):
    rng = np.random.default_rng(5)
    f, d, t = 48, 32, 3
    up, gate, down = (jnp.asarray(rng.standard_normal((f, d), dtype=np.float32)) for _ in "abc")
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
    scores = (jnp.asarray(rng.standard_normal((t, f), dtype=np.float32)) if criterion == "scores"
              else None)
    g = np.asarray(x) @ np.asarray(gate).T
    floor = _floor_between(g)
    kw = dict(w_gate=gate, scores=scores, threshold=0.0, activation="relu", criterion=criterion,
              gate_floor=floor)
    y, n = ops.sparse_ffn(x, up, down, **kw)
    y_ref, n_ref = ops.sparse_ffn(x, up, down, impl="reference", **kw)
    assert_close(np.asarray(y), np.asarray(y_ref), "other_path")
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n_ref))
    # numpy, written out: FATReLU(g) * u for the selected neurons
    a = np.where(g > floor, g, 0.0) * (np.asarray(x) @ np.asarray(up).T)
    if criterion == "scores":
        a = np.where(np.asarray(scores) > 0, a, 0.0)
    assert_close(np.asarray(y), a @ np.asarray(down), "other_path")


@pytest.mark.parametrize("bad,match", [
    (dict(gate_floor=-0.1), "gate_floor: expected a finite float >= 0"),
    (dict(gate_floor=float("nan")), "gate_floor: expected a finite float >= 0"),
    (dict(gate_floor=0.1, activation="silu"), "gate_floor: expected 0 unless the FFN is gated "
                                              "with relu or drelu"),
])
def test_bad_floor_is_a_clear_error(bad, match):
    x, w, _ = _qffn(1, 1)
    kw = dict(activation="relu") | bad
    with pytest.raises(UserError, match=match):
        _qcall(x, w, **kw)
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.standard_normal((8, 16), dtype=np.float32))
    with pytest.raises(UserError, match=match):
        ops.sparse_ffn(jnp.ones((1, 16)), m, m, w_gate=m, criterion="oracle", **kw)


def test_handlers_validate_the_floor_too():
    from powerinfer_jax.ops import _ffi

    x, w, _ = _qffn(2, 1)
    with pytest.raises(Exception, match="gate_floor: expected 0 unless the FFN is gated"):
        np.asarray(_ffi.qsparse_ffn(x, w["up"], w["down"], up_qtype="Q4_0", down_qtype="Q8_0",
                                    gate=w["gate"], gate_qtype="Q4_0", b_up=None, b_down=None,
                                    scores=None, threshold=0.0, activation="silu",
                                    criterion="oracle", gate_floor=0.5)[0])
    m = jnp.ones((8, 16), jnp.float32)
    with pytest.raises(Exception, match="gate_floor: expected a finite number >= 0"):
        np.asarray(_ffi.sparse_ffn(jnp.ones((1, 16)), m, m, w_gate=m, b_up=None, b_down=None,
                                   scores=None, threshold=0.0, activation="relu",
                                   criterion="oracle", gate_floor=-1.0)[0])


# ------------------------------------------------------------------------------ the model
@pytest.fixture(scope="module")
def fatrelu_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fatrelu")
    save_hf_llama(d, hidden_act="relu", seed=4)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"fatrelu_threshold": FLOORS}))
    return d


def _transformers_logits(d, floors):
    import torch
    from transformers import AutoModelForCausalLM

    class FatRelu(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.t = t

        def forward(self, g):
            return g * (g > self.t)

    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for layer, t in zip(m.model.layers, floors):
        layer.mlp.act_fn = FatRelu(t)
    with torch.no_grad():
        return m(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.mark.slow
def test_dense_model_is_fatrelu_as_transformers_computes_it(fatrelu_dir):
    """The loaded config carries the thresholds, and the dense forward equals transformers'
    Llama whose MLP activation is FATReLU at those thresholds, not its plain-ReLU one."""
    pytest.importorskip("transformers")
    ckpt = load_checkpoint(fatrelu_dir)
    assert ckpt.config.fatrelu_thresholds == tuple(FLOORS)
    ours = np.asarray(from_params(ckpt.config, ckpt.params)(jnp.asarray(TOKENS)))
    assert_close(ours, _transformers_logits(fatrelu_dir, FLOORS), "hf_logits")
    plain = _transformers_logits(fatrelu_dir, [0, 0])
    assert np.abs(ours - plain).max() > 1e-2


class _AllOn(nnx.Module):
    """A predictor that marks every neuron active."""

    def __init__(self, f):
        self.f = f

    def __call__(self, x_btd):
        return jnp.ones(x_btd.shape[:-1] + (self.f,), jnp.float32)

    def permute(self, perm):
        pass


def _modes_equal_dense(ckpt):
    """Dense's logits and each mode's, the model loaded for each mode (its layouts)."""
    from powerinfer_jax.sparsity import modes

    def loaded(cfg):
        return from_params(ckpt.config, ckpt.params, kernels="ffi",
                           ffn_layout=modes.ffn_layout(cfg, ckpt.config))

    f = ckpt.config.d_ff
    dense = np.asarray(loaded(pij.SparsityConfig())(jnp.asarray(TOKENS)))
    outs = {}
    for mode in ("oracle", "threshold"):
        cfg = pij.SparsityConfig(mode=mode)
        model = with_mode(loaded(cfg), cfg, thresholds=(0.0, 0.0))
        outs[mode] = np.asarray(model(jnp.asarray(TOKENS)))
    cfg = pij.SparsityConfig(mode="predictor")
    model = with_mode(loaded(cfg), cfg, predictors=[_AllOn(f), _AllOn(f)])
    outs["predictor"] = np.asarray(model(jnp.asarray(TOKENS)))
    return dense, outs


@pytest.mark.slow
def test_every_mode_runs_the_fatrelu_model(fatrelu_dir):
    """Oracle and threshold modes at 0 and a predictor that selects every neuron compute the
    same model as dense: the predicted neurons' gates are floored in the kernel too (before,
    predictor mode computed relu(gate) for them: plain ReLU)."""
    dense, outs = _modes_equal_dense(load_checkpoint(fatrelu_dir))
    for got in outs.values():
        assert_close(got, dense, "other_path")


@pytest.mark.slow
def test_quantized_gguf_keeps_the_thresholds_and_every_mode_applies_them(fatrelu_dir, tmp_path):
    """Our GGUF writer stores the thresholds (powerinfer_jax.fatrelu_thresholds) and the loader
    reads them back; on the file's Q4_1 blocks dense, oracle, threshold and all-on predictor
    modes agree, and the blocks' model stays close to the float one."""
    from helpers_models import gpt2_tokenizer_meta
    from powerinfer_jax.checkpoint.gguf import write_gguf

    ckpt = load_checkpoint(fatrelu_dir)
    # Q4_1: the sparse kernel rounds its down coefs per 32 neurons as the dense matvec rounds
    # its input, so the paths differ by float rounding only
    types = {f"layers.{i}.ffn.{n}.weight": "Q4_1" for i in range(2)
             for n in ("gate", "up", "down_t")}
    path = tmp_path / "fatrelu.Q4_1.gguf"
    write_gguf(path, ckpt.config, ckpt.params, gpt2_tokenizer_meta(), types)
    q = load_checkpoint(path, keep_quantized=True)
    # float32 in the file, as the kernels take them
    np.testing.assert_array_equal(np.float32(q.config.fatrelu_thresholds), np.float32(FLOORS))
    dense, outs = _modes_equal_dense(q)
    for got in outs.values():
        assert_close(got, dense, "quantized_model")
    f32 = np.asarray(from_params(ckpt.config, ckpt.params)(jnp.asarray(TOKENS)))
    assert np.abs(dense - f32).max() < 0.05 * np.abs(f32).max()


@pytest.mark.parametrize("value,act,match", [
    ([0.1], "relu", r"fatrelu_threshold: expected a finite number >= 0 or a list of 2"),
    (-0.5, "relu", r"fatrelu_threshold: expected a finite number >= 0"),
    ("big", "relu", r"fatrelu_threshold: expected a finite number >= 0"),
    (0.1, "silu", r"fatrelu_thresholds: expected \(\) unless the FFN is a gated relu/drelu"),
])
def test_bad_thresholds_in_config_json_are_clear_errors(tmp_path, value, act, match):
    save_hf_llama(tmp_path, hidden_act=act)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"fatrelu_threshold": value}))
    with pytest.raises(UserError, match=match):
        load_checkpoint(tmp_path)


def test_paths_without_a_floor_refuse_a_fatrelu_ffn():
    from powerinfer_jax.models.ffn import FFN

    ffn = FFN(d_model=8, d_ff=16, activation="relu", gated=True, bias=False, dtype=jnp.float32,
              rngs=nnx.Rngs(0), gate_floor=0.2)
    with pytest.raises(UserError, match=r"FFN gate_floor 0.2 \(a FATReLU model\) on the GPU"):
        ffn.require_no_gate_floor("the GPU hybrid")
    FFN(d_model=8, d_ff=16, activation="relu", gated=True, bias=False, dtype=jnp.float32,
        rngs=nnx.Rngs(0)).require_no_gate_floor("the GPU hybrid")  # no floor: fine
