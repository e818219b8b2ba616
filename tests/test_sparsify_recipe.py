"""The ProSparse recipe, the cached teacher and long runs in pieces (powerinfer_jax.sparsify) on tiny
random models: schedules, FATReLU == the runtime's threshold mode, top-k KL, the top-k cache, teacher
samples made through the runtime's batched Engine, and runs stopped by a time budget that resume to the weights
of an uninterrupted run."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_models import save_hf_llama, tiny_llama_config
from helpers_tolerances import TOL, assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.transformer import Transformer, from_params
from powerinfer_jax.sparsify import DistillConfig, distill
from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.checkpoints import TrainCheckpoints
from powerinfer_jax.sparsify.recipe import recipe
from powerinfer_jax.sparsify.export import canonical_params
from powerinfer_jax.sparsify.fatrelu import pick_threshold, scan_grid
from powerinfer_jax.sparsify.schedule import l1_coefficient
from powerinfer_jax.sparsify.teacher_cache import TopKCache
from powerinfer_jax.sparsify.train import Distiller
from powerinfer_jax.sparsity.modes import configure

CONFIG = dict(d_model=48, d_ff=37, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12)


def tiny(activation="silu", seed=0):
    config = tiny_llama_config(activation=activation, **CONFIG)
    params = canonical_params(Transformer(config, rngs=nnx.Rngs(seed), kernels="xla"))
    return config, params


def tokens(config, batch=2, seq=16, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    save_hf_llama(d)
    return d


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from helpers_models import CORPUS

    d = tmp_path_factory.mktemp("texts")
    train, valid = d / "train.txt", d / "valid.txt"
    train.write_text(" ".join(CORPUS * 12))
    valid.write_text(" ".join(CORPUS[::-1] * 6))
    return train, valid


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------- schedule
def test_prosparse_stages_rise_along_a_sine_and_hold():
    cfg = DistillConfig(variant="relu", tokens=100 * 4 * 256,
                        l1_stages=((0.1, 0.0), (0.3, 0.02), (0.6, 0.05)))
    c = [l1_coefficient(cfg, s) for s in range(100)]
    assert c[:10] == [0.0] * 10  # the warm-up stage
    assert c[10] == 0.0 and c[30] == pytest.approx(0.02) and c[60] == pytest.approx(0.05)
    assert c[20] == pytest.approx(0.02 * np.sin(np.pi / 4))  # halfway up the first ramp
    assert c[45] == pytest.approx(0.02 + 0.03 * np.sin(np.pi / 4))
    assert c[60:] == [pytest.approx(0.05)] * 40  # held after the last stage
    assert all(b >= a for a, b in zip(c, c[1:]))
    # without stages: the linear ramp of --l1/--l1-warmup, as before
    lin = DistillConfig(tokens=10 * 4 * 256, l1=0.1, l1_warmup=0.5)
    assert [l1_coefficient(lin, s) for s in (0, 4, 9)] == pytest.approx([0.02, 0.1, 0.1])


def test_l1_controller_steers_toward_the_target_and_resumes_exactly():
    from powerinfer_jax.sparsify.schedule import L1Controller

    cfg = DistillConfig(variant="relu", tokens=200 * 4 * 256, l1_target_sparsity=0.8,
                        l1_stages=((0.1, 0.0), (0.5, 0.05)))
    low = L1Controller(cfg)
    for s in range(100):
        low.observe(s, 0.6)  # never sparse enough: the multiplier rises once the stage starts
    assert low.start == pytest.approx(0.6) and low.multiplier > 1.5
    assert low.coefficient(150) == pytest.approx(0.05 * low.multiplier)  # past the stages
    high = L1Controller(cfg)
    for s in range(100):
        high.observe(s, 0.5 if s < 10 else 0.95)  # sparser than the path: it falls
    assert high.multiplier < 0.7
    seq = np.random.default_rng(0).uniform(0.5, 0.9, 150)
    whole = L1Controller(cfg)
    for s, v in enumerate(seq):
        whole.observe(s, v)
    first = L1Controller(cfg)
    for s, v in enumerate(seq[:73]):
        first.observe(s, v)
    second = L1Controller(cfg, json.loads(json.dumps(first.state())))  # through a checkpoint
    for s, v in enumerate(seq[73:], 73):
        second.observe(s, v)
    assert second.state() == whole.state()
    off = L1Controller(DistillConfig(variant="relu", tokens=4 * 256 * 10, l1=0.1))
    for s in range(10):
        off.observe(s, 0.1)
    assert off.multiplier == 1.0 and off.coefficient(9) == pytest.approx(0.1)
    with pytest.raises(UserError, match="--l1-target-sparsity"):
        DistillConfig(variant="relu", l1_target_sparsity=0.8)  # nothing to steer


def test_recipe_presets_and_bad_values():
    cfg = recipe("prosparse", variant="relu", l1_on="act")
    assert cfg.l1_stages and cfg.fatrelu_kl_rise > 0 and cfg.l1_on == "act"  # flags win
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()  # records compare as JSON
    assert DistillConfig(**{**cfg.to_dict()}) == cfg  # lists from a record rebuild the config
    for bad in (dict(l1_stages=((0.5, 0.1), (0.4, 0.2))), dict(l1_stages=((1.5, 0.1),)),
                dict(l1_stages="x"), dict(l1_on="up"), dict(teacher="remote"),
                dict(fatrelu_kl_rise=-1), dict(variant="threshold", fatrelu_kl_rise=0.1),
                dict(teacher="cached", hidden_mse=0.1), dict(topk=0)):
        with pytest.raises(UserError):
            DistillConfig(**{"variant": "relu", **bad})
    with pytest.raises(UserError, match="--recipe"):
        recipe("nonsense")


# ----------------------------------------------------------------------------------- FATReLU
def test_default_output_names_keep_every_digit_of_the_target(monkeypatch, tmp_path):
    """Two decimals as always (existing runs resume where they are); a target with more digits
    keeps them, so 0.865 and 0.86 never share a directory (and a checkpoint)."""
    from powerinfer_jax.sparsify import default_out

    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path))
    names = {t: default_out("smollm2-135m", DistillConfig(variant="fatrelu", target_sparsity=t)).name
             for t in (0.85, 0.9, 0.86, 0.865)}
    assert names == {0.85: "smollm2-135m-sparse-fatrelu-0.85",
                     0.9: "smollm2-135m-sparse-fatrelu-0.90",
                     0.86: "smollm2-135m-sparse-fatrelu-0.86",
                     0.865: "smollm2-135m-sparse-fatrelu-0.865"}


@pytest.mark.slow
def test_fatrelu_is_the_runtimes_threshold_mode():
    """A relu model with FATReLU at t computes what the engine's threshold mode computes with
    every layer's gate threshold at t: same logits, same share of skipped neurons."""
    from powerinfer_jax.runtime import perplexity as evaluate

    config, params = tiny("relu")
    x = tokens(config, batch=1, seq=24, seed=3)
    t = 0.05
    model = from_params(config, params, kernels="xla")
    logits, aux = fw.forward(model, jnp.asarray(x), fw.FFNSpec("relu"),
                             gate_threshold=jnp.float32(t))
    plain, plain_aux = fw.forward(model, jnp.asarray(x), fw.FFNSpec("relu"))
    assert float(jnp.mean(aux["zero_frac"])) > float(jnp.mean(plain_aux["zero_frac"])) + 0.01
    for impl in ("reference", "ffi"):
        engine = from_params(config, params, kernels="xla")
        configure(engine, SparsityConfig(mode="threshold", impl=impl),
                  thresholds=[t] * config.n_layers)
        assert_close(engine(jnp.asarray(x)), logits, "trained_logits")
        ref = evaluate.perplexity(engine, x.reshape(-1), ctx=24, max_chunks=1)
        assert ref["ffn_sparsity"] == pytest.approx(float(jnp.mean(aux["zero_frac"])), abs=1e-4)
    assert np.abs(np.asarray(plain) - np.asarray(logits)).max() > 5 * TOL["trained_logits"].atol


def test_fatrelu_grid_search_finds_the_last_point_within_budget():
    grid = tuple(np.linspace(0, 1, 25))
    kl = lambda t: (0.5 + t ** 2, t)  # noqa: E731 (monotone in t)
    curve = scan_grid(kl, 0.2, grid)
    want = max(g for g in grid if 0.5 + g ** 2 <= 0.6)
    assert pick_threshold(curve, 0.2) == pytest.approx(want)
    assert len(curve) <= 8  # a bisection, not the whole grid
    assert pick_threshold(scan_grid(kl, None, grid), 0.2) == pytest.approx(want)
    assert pick_threshold(scan_grid(lambda t: (1.0 + t, t), 0.0, grid), 0.0) == 0.0


# -------------------------------------------------------------------------------- top-k KL
def test_topk_kl_bounds_the_full_kl():
    rng = np.random.default_rng(0)
    t = jnp.asarray(rng.standard_normal((2, 5, 40)) * 3, jnp.float32)
    s = jnp.asarray(rng.standard_normal((2, 5, 40)) * 3, jnp.float32)
    full = float(fw.kl_divergence(t, s))
    ids, logp = fw.teacher_topk(t, 40)
    assert float(fw.topk_kl(ids, logp, s)) == pytest.approx(full, rel=1e-4)  # k = V: exact
    ids, logp = fw.teacher_topk(t, 8)
    part = float(fw.topk_kl(ids, logp, s))
    assert 0 < part <= full + 1e-6
    assert float(fw.topk_kl(ids, logp, t)) == pytest.approx(0.0, abs=1e-5)
    # float16 storage (the cache's) moves it little
    assert float(fw.topk_kl(ids, logp.astype(jnp.float16), s)) == pytest.approx(part, rel=2e-3)


@pytest.mark.slow
def test_topk_cache_fills_once_and_reopens(tmp_path):
    config, params = tiny("silu")
    teacher = from_params(config, params, kernels="xla")
    pool = tokens(config, batch=6, seq=16, seed=4)
    calls = []

    def teacher_fn(x):
        calls.append(len(x))
        return fw.teacher_topk(fw.forward(teacher, jnp.asarray(x), fw.FFNSpec("silu"))[0], 8)

    c = TopKCache(tmp_path / "c", pool, 8, teacher_fn, config.vocab_size)
    ids, logp = c.get([4, 1])
    want_ids, want_logp = teacher_fn(pool[[4, 1]])
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    assert_close(logp, want_logp, "teacher_cache")
    assert c.filled == 4 and calls == [4, 2]  # topped up with rows 0 and 2: one full call
    again = TopKCache(tmp_path / "c", pool, 8, teacher_fn, config.vocab_size)
    again.get([1, 4, 0])
    assert calls == [4, 2] and again.filled == 4  # on disk: not computed again
    again.get([5])
    assert calls == [4, 2, 4] and again.filled == 6  # the last rows, padded to one shape
    with pytest.raises(UserError, match="teacher cache"):
        TopKCache(tmp_path / "c", pool, 16, teacher_fn, config.vocab_size)


# ------------------------------------------------------------------------- samples by Engine
def test_engine_samples_are_whole_turns_and_reproducible(tiny_dir):
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.sparsify.samples import generate_samples_engine, prompt_texts

    s = build(str(tiny_dir), RuntimeConfig(max_seq_len=24), max_batch=4, progress=False)
    tok = s.tokenizer
    a = generate_samples_engine(s.engine, tok, n=5, seq_len=24, seed=1, progress=False)
    b = generate_samples_engine(s.engine, tok, n=5, seq_len=24, seed=1, progress=False)
    c = generate_samples_engine(s.engine, tok, n=5, seq_len=24, seed=2, progress=False)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (5, 24) and a.dtype == np.int32
    starts = {tuple(tok.encode(t)[:4]) for t in prompt_texts(tok)}
    assert all(tuple(row[:4]) in starts for row in a)  # every row starts at a turn's prompt


# ------------------------------------------------------------------- a run in budgeted pieces
def small(**changes):
    base = dict(variant="relu", tokens=2 * 16 * 6, batch=2, seq_len=16, samples=0,
                sample_fraction=0.0, refit_tokens=64, lr=3e-3, warmup_steps=0,
                target_sparsity=0.7, l1_on="gate", l1_stages=((0.3, 0.0), (0.8, 0.05)),
                fatrelu_kl_rise=0.5, fatrelu_at=0.5, l1_target_sparsity=0.9)
    base.update(changes)
    return DistillConfig(**base)


@pytest.mark.slow  # ~7 s a teacher
@pytest.mark.parametrize("teacher", ["online", "cached"])
def test_pieces_by_time_budget_resume_to_the_uninterrupted_run(tiny_dir, texts, cache,
                                                               tmp_path, teacher, monkeypatch):
    """ProSparse stages and FATReLU from the middle of the run: a run stopped by its time budget
    and continued (checkpoint, FATReLU threshold and all) ends with the weights of the run that
    went through at once; the threshold is in config.json and in the threshold mode's
    artifacts."""
    from powerinfer_jax.sparsify.schedule import L1Controller

    monkeypatch.setattr(L1Controller, "EVERY", 3)  # windows that straddle the pieces' ends
    train, valid = texts
    cfg = small(teacher=teacher, topk=16)
    kw = dict(corpus=[train], progress=False, calibrate=False, save_every=2)
    whole = distill(str(tiny_dir), cfg, out=tmp_path / "whole", **kw)
    out = tmp_path / "part"
    res = distill(str(tiny_dir), cfg, out=out, stop_after=2, **kw)
    assert res["stopped_at"] == 2
    res = distill(str(tiny_dir), cfg, out=out, resume=True, time_budget=1e-9, **kw)
    # no step fits the budget: the call's first step runs anyway and is saved, then it stops
    assert res["stopped_at"] == 3 and res["stopped"] == "deadline"
    res = distill(str(tiny_dir), cfg, out=out, resume=True, stop_after=1, eval_text=valid,
                  eval_every=1, eval_chunks=1, **kw)
    assert res["stopped_at"] == 4 and "fatrelu" in res["record"]  # set at step 3 of 6
    distill(str(tiny_dir), cfg, out=out, resume=True, **kw)
    a, b = load_checkpoint(tmp_path / "whole").params, load_checkpoint(out).params
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    gate = whole["record"]["fatrelu_threshold"]
    rec = json.loads((out / "sparsify.json").read_text())
    assert rec["fatrelu_threshold"] == gate and rec["fatrelu"]["step"] == 3
    assert json.loads((out / "config.json").read_text()).get("fatrelu_threshold") == gate
    assert rec["l1_controller"] == whole["record"]["l1_controller"]
    assert rec["l1_controller"]["multiplier"] != 1.0  # it steered
    assert {"step", "load", "data"} <= set(rec["timing"])
    if teacher == "cached":  # the first run filled the top-k cache; the second reused it
        assert whole["record"]["timing"]["teacher"] > 0 and "teacher" not in rec["timing"]
    rows = [json.loads(line) for line in (out.parent / "part.curve.jsonl").read_text()
            .splitlines()]
    assert [r["stage"] for r in rows][-1] == "pause" and rows[-1]["step"] == 4
    assert rows[-1]["gate_threshold"] == gate  # the curve scores the model as it trains


def test_fatrelu_threshold_reaches_the_artifacts(tiny_dir, texts, cache, tmp_path):
    from powerinfer_jax.sparsify import build_artifacts
    from powerinfer_jax.sparsity.artifacts import load_artifacts, model_fingerprint

    train, _ = texts
    out = tmp_path / "m"
    res = distill(str(tiny_dir), small(fatrelu_kl_rise=2.0, fatrelu_at=1.0), out=out,
                  corpus=[train], progress=False, calibrate=False)
    gate = res["record"]["fatrelu_threshold"]
    assert gate and gate > 0 and res["record"]["fatrelu"]["step"] == 6
    build_artifacts(out, 0.7, corpus=[train], progress=False, predictors=False)
    ckpt = load_checkpoint(out)
    arts = load_artifacts(out / "sparsity" / "target_0.70",
                          fingerprint=model_fingerprint(str(out), ckpt.source, ckpt.config),
                          need_predictor=False)
    assert arts.thresholds_gate == (gate,) * ckpt.config.n_layers
    assert arts.thresholds_contribution == (0.0,) * ckpt.config.n_layers  # oracle: plain ReLU


@pytest.mark.slow  # ~4 s
def test_filled_teacher_cache_serves_the_whole_run(tiny_dir, texts, cache, tmp_path):
    from powerinfer_jax.sparsify.run import fill_teacher_cache

    train, _ = texts
    cfg = small(teacher="cached", topk=16, samples=3, sample_fraction=0.5)
    res = fill_teacher_cache(str(tiny_dir), cfg, corpus=[train], progress=False)
    assert res["rows_filled"] > 3 and res["seconds"] > 0 and len(res["directories"]) == 2
    again = fill_teacher_cache(str(tiny_dir), cfg, corpus=[train], progress=False)
    assert again["rows_filled"] == 0
    run = distill(str(tiny_dir), cfg, out=tmp_path / "m", corpus=[train], progress=False,
                  calibrate=False)
    assert "teacher" not in run["record"]["timing"]  # every target came from the cache


def test_artifact_directories_keep_every_digit_of_the_target(tmp_path):
    """Sparsity artifacts at 0.865 and at 0.86 never share a directory (both calibrate the same
    model at different targets); two-decimal targets keep their names (existing caches)."""
    from powerinfer_jax.sparsity import artifacts

    names = {t: artifacts.target_dir(tmp_path, t).name for t in (0.5, 0.86, 0.865, 0.9)}
    assert names == {0.5: "target_0.50", 0.86: "target_0.86", 0.865: "target_0.865",
                     0.9: "target_0.90"}
