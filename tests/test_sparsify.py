"""Sparsification by self-distillation (powerinfer_jax.sparsify) on tiny random models."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers_models import CORPUS, save_hf_llama, save_hf_opt, tiny_llama_config
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.config import SparsityConfig
from powerinfer_jax.sparsity.modes import configure
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.transformer import Transformer, from_params
from powerinfer_jax.sparsify import DistillConfig, build_artifacts, distill
from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.checkpoints import TrainCheckpoints
from powerinfer_jax.sparsify.export import canonical_params
from powerinfer_jax.sparsify.train import Distiller
from powerinfer_jax.sparsity.predictor import TrainConfig

REPO = Path(__file__).resolve().parents[1]
# D=48, F=37 (prime), unequal head sizes: shapes that catch transposed axes
CONFIG = dict(d_model=48, d_ff=37, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12)


def tiny_models(activation="silu", seed=0):
    """(config, params, teacher, student): a random model at initialization scale (N(0, 1/fan-in)
    matrices, so logits are O(1)), teacher and student as two copies."""
    config = tiny_llama_config(activation=activation, **CONFIG)
    params = canonical_params(Transformer(config, rngs=nnx.Rngs(seed), kernels="xla"))
    return (config, params, from_params(config, params, kernels="xla"),
            from_params(config, params, kernels="xla"))


def batches(config, batch=2, seq=16, seed=0):
    def source(step):
        return np.random.default_rng([seed, step]).integers(
            0, config.vocab_size, (batch, seq)).astype(np.int32)
    return source


def kl_on(distiller, tokens):
    s_logits, _ = fw.forward(distiller.student(), jnp.asarray(tokens), distiller.student_spec)
    t_logits, _ = fw.forward(nnx.merge(distiller.t_graphdef, distiller.t_state),
                             jnp.asarray(tokens), distiller.teacher_spec)
    return float(fw.kl_divergence(t_logits, s_logits))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    save_hf_llama(d)
    return d


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    train, valid = d / "train.txt", d / "valid.txt"
    train.write_text(" ".join(CORPUS * 12))
    valid.write_text(" ".join(CORPUS[::-1] * 6))
    return train, valid


def small(**changes):
    base = dict(tokens=2 * 16 * 4, batch=2, seq_len=16, samples=0, sample_fraction=0.0,
                refit_tokens=64, lr=3e-3, warmup_steps=0, target_sparsity=0.7)
    base.update(changes)
    return DistillConfig(**base)


# ----------------------------------------------------------------------------------- learning
@pytest.mark.slow
def test_relu_student_matches_relu_teacher_to_small_kl():
    config, params, teacher, student = tiny_models("relu")
    rng = np.random.default_rng(1)
    for layer in student.layers:  # start the student's FFN away from the teacher's
        for lin in (layer.ffn.gate, layer.ffn.up, layer.ffn.down_t):
            w = np.asarray(lin.weight[...])
            noise = 0.5 * w.std() * rng.standard_normal(w.shape)
            lin.weight.set_value(jnp.asarray(w + noise, jnp.float32))
    cfg = small(variant="relu", tokens=2 * 16 * 40, lr=1e-2, compute_dtype="float32",
                refit=False)
    d = Distiller(student, teacher, cfg)
    src = batches(config)
    before = kl_on(d, src(0))
    d.run(lambda step: src(step % 2), progress=False)  # two batches, seen 20 times each
    after = kl_on(d, src(0))
    assert before > 0.1 and after < 0.1 * before, (before, after)


@pytest.mark.slow
def test_activation_penalty_raises_relu_sparsity():
    config, _, teacher, _ = tiny_models("silu")
    tokens = jnp.asarray(batches(config, seed=9)(0))

    def sparsity(l1):
        _, _, _, student = tiny_models("silu")
        cfg = small(variant="relu", tokens=2 * 16 * 20, l1=l1, l1_warmup=0.2, refit=False,
                    compute_dtype="float32", lr=1e-2)
        d = Distiller(student, teacher, cfg)
        d.run(batches(config), progress=False)
        _, aux = fw.forward(d.student(), tokens, d.student_spec)
        return float(jnp.mean(aux["zero_frac"]))

    plain, penalized = sparsity(0.0), sparsity(5.0)
    assert penalized > plain + 0.08, (plain, penalized)


@pytest.mark.slow
def test_threshold_student_masks_at_target_and_ste_passes_gradient():
    config, _, teacher, student = tiny_models("silu")
    spec = fw.student_spec(config, "threshold", 0.75)
    tokens = jnp.asarray(batches(config, batch=2, seq=32)(0))
    _, aux = fw.forward(student, tokens, spec)
    # a batch quantile: ~75% of the activations are zeroed in every layer
    assert_close(aux["zero_frac"], 0.75, "batch_quantile")

    def loss(w):
        x = jnp.ones((1, 3, config.d_model))
        g = jnp.einsum("btd,fd->btf", x, w)
        return jnp.sum(fw.mask_activations(g * 1.0, spec))

    w = jnp.asarray(np.random.default_rng(0).standard_normal((config.d_ff, config.d_model)),
                    jnp.float32)
    grad = jax.grad(loss)(w)
    assert np.all(np.asarray(grad) != 0)  # straight-through: dropped neurons get gradient too


@pytest.mark.slow  # ~7 s
def test_fatrelu_student_masks_the_gate_at_target():
    """fatrelu: relu(g) * u kept only where relu(g) is above the layer's batch quantile; the
    kept activations are ReGLU's exactly, and the straight-through gradient reaches them all."""
    config, _, _, student = tiny_models("silu")
    spec = fw.student_spec(config, "fatrelu", 0.75)
    assert (spec.activation, spec.mask_on) == ("relu", "gate")
    tokens = jnp.asarray(batches(config, batch=2, seq=32)(0))
    _, aux = fw.forward(student, tokens, spec)
    assert_close(aux["zero_frac"], 0.75, "batch_quantile")
    layer = student.layers[0]
    x = layer.ffn_norm(layer.attention_residual(
        student.tok_embed[...][tokens].astype(jnp.float32) * config.embed_scale,
        jnp.broadcast_to(jnp.arange(32), (2, 32))))
    _, a, _, mag = fw.ffn_forward(layer.ffn, x, spec)
    g = np.asarray(fw._proj(x, layer.ffn.gate.weight[...]))
    u = np.asarray(fw._proj(x, layer.ffn.up.weight[...]))
    a, mag = np.asarray(a), np.asarray(mag)
    assert np.array_equal(mag, np.maximum(g, 0.0))  # the mask compares the gate alone
    kept = a != 0
    assert np.array_equal(a[kept], (g * u)[kept])
    assert mag[kept].min() > mag[~kept].max()  # one threshold per layer and batch


def test_fatrelu_curve_eval_matches_the_models_threshold_mode():
    """What the fatrelu student is scored as (per-layer gate thresholds) is what the runtime's
    threshold mode runs on the exported ReLU model."""
    from powerinfer_jax.runtime import perplexity as evaluate
    from powerinfer_jax.sparsify.evaluation import calibrate, perplexity

    config, params, _, student = tiny_models("relu")
    spec = fw.student_spec(config, "fatrelu", 0.8)
    chunks = batches(config, batch=3, seq=24, seed=5)(0)
    thr = calibrate(student, spec, 0.8, chunks[:2])
    assert np.all(thr > 0) and thr.shape == (config.n_layers,)
    ours = perplexity(student, spec, chunks, thr)
    model = from_params(config, params, kernels="xla")
    configure(model, SparsityConfig(mode="threshold", impl="reference"), thresholds=thr)
    ref = evaluate.perplexity(model, chunks.reshape(-1), ctx=24, max_chunks=3)
    assert ours["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)
    assert ours["ffn_sparsity"] == pytest.approx(ref["ffn_sparsity"], abs=1e-4)
    assert ours["ffn_sparsity"] > 0.6


# ------------------------------------------------------------------------------ refit, eval
@pytest.mark.slow
def test_refit_reduces_the_sparse_layer_error():
    from powerinfer_jax.sparsify.refit import refit_down_rows

    config, _, teacher, student = tiny_models("silu")
    tokens = batches(config, batch=8, seq=16, seed=3)(0)
    spec = fw.student_spec(config, "threshold", 0.7)

    def kl():
        t_logits, _ = fw.forward(teacher, jnp.asarray(tokens), fw.teacher_spec(config))
        s_logits, _ = fw.forward(student, jnp.asarray(tokens), spec)
        return float(fw.kl_divergence(t_logits, s_logits))

    before = kl()
    rep = refit_down_rows(student, teacher, tokens, spec, fw.teacher_spec(config),
                          progress=False)
    assert all(a < 0.9 * b for a, b in zip(rep["after"], rep["before"])), rep
    assert kl() < 0.9 * before


def test_refit_solves_the_ridge_least_squares():
    from powerinfer_jax.sparsify.refit import solve_ridge

    rng = np.random.default_rng(0)
    a, w_true = rng.standard_normal((200, 37)), rng.standard_normal((37, 11))
    w = solve_ridge(a, a @ w_true, np.zeros((37, 11)), ridge=1e-9)
    assert_close(w, w_true, "ridge")
    a[:, 5] = 0.0  # a neuron the data never activates keeps its old row
    w0 = rng.standard_normal((37, 11))
    w = solve_ridge(a, a @ w_true, w0, ridge=1e-6)
    assert_close(w[5], w0[5], "ridge_untouched")


def test_curve_eval_matches_the_models_oracle_mode():
    """The in-process curve evaluation scores what evaluate's oracle mode scores."""
    from powerinfer_jax.runtime import perplexity as evaluate
    from powerinfer_jax.sparsify.evaluation import perplexity

    config, params, _, student = tiny_models("silu")
    chunks = batches(config, batch=3, seq=24, seed=5)(0)
    thr = np.full(config.n_layers, 0.05, np.float32)
    ours = perplexity(student, fw.student_spec(config, "threshold", 0.5), chunks, thr)
    model = from_params(config, params, kernels="xla")
    configure(model, SparsityConfig(mode="oracle", impl="reference"), thresholds=thr)
    ref = evaluate.perplexity(model, chunks.reshape(-1), ctx=24, max_chunks=3)
    assert ours["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)
    assert ours["ffn_sparsity"] == pytest.approx(ref["ffn_sparsity"], abs=1e-4)


# ------------------------------------------------------------------------------ resume
@pytest.mark.slow
def test_interrupted_run_resumes_without_losing_steps(tmp_path):
    config, params, teacher, student = tiny_models("silu")
    cfg = small(tokens=2 * 16 * 5, refit=False)
    record = {"fingerprint": {"id": "tiny"}, "config": cfg.to_dict()}
    src = batches(config)

    whole = Distiller(student, teacher, cfg)
    whole.run(src, progress=False)

    ck = TrainCheckpoints(tmp_path / "ck")
    first = Distiller(from_params(config, params, kernels="xla"), teacher, cfg)

    def interrupt(step, metrics):
        if step == 2:  # as `kill` would: the loop stops after this step, saved
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt):
        first.run(src, checkpoints=ck, record=record, save_every=100, progress=False,
                  on_step=interrupt)
    assert ck.latest_step() == 3  # steps 0, 1, 2 finished and saved
    ck.close()
    ck = TrainCheckpoints(tmp_path / "ck")
    second = Distiller(from_params(config, params, kernels="xla"), teacher, cfg)
    second.params, second.opt_state = ck.restore(3, second.params, second.opt_state, record)
    second.run(src, start_step=3, checkpoints=ck, record=record, progress=False)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_cli_resume_continues_a_stopped_run_to_the_same_model(tiny_dir, texts, cache, tmp_path):
    """`python -m powerinfer_jax.sparsify ... --resume` (its main, in this process): a run stopped
    after 2 of 4 steps, exported as it was, then resumed, ends with the weights of an
    uninterrupted run, bit for bit (the CPU's XLA is deterministic; the batches, the L1
    controller and the optimizer state are all restored from the checkpoint and its record)."""
    from powerinfer_jax.sparsify.cli import main

    train, _ = texts
    cfg = small()
    whole = distill(str(tiny_dir), cfg, out=tmp_path / "whole", corpus=[train], progress=False,
                    calibrate=False)
    part = tmp_path / "part"
    argv = ["--model", str(tiny_dir), "--out", str(part), "--corpus", str(train),
            "--no-progress", "--no-calibrate", "--tokens", str(cfg.tokens), "--batch", "2",
            "--seq-len", "16", "--samples", "0", "--sample-fraction", "0", "--refit-tokens",
            "64", "--lr", "3e-3", "--warmup-steps", "0", "--target-sparsity", "0.7"]
    main(argv + ["--stop-after", "2"])
    assert not (part / "config.json").exists()
    # a budgeted run can export what it has so far, and still resume later
    main(argv + ["--stop-after", "0", "--resume", "--export-partial"])
    assert json.loads((part / "sparsify.json").read_text())["steps"] == 2
    with pytest.raises(UserError, match="--resume"):
        main(argv)
    main(argv + ["--resume"])
    assert json.loads((part / "sparsify.json").read_text())["steps"] == cfg.steps == 4
    a = load_checkpoint(tmp_path / "whole").params
    b = load_checkpoint(part).params
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert not (tmp_path / "part.train").exists()  # a finished run drops its checkpoints
    again = distill(str(tiny_dir), cfg, out=tmp_path / "whole", corpus=[train], progress=False,
                    calibrate=False)
    assert again["cached"] and not whole["cached"]  # same model and config: reused


# ------------------------------------------------------------------------ the exported model
@pytest.mark.slow  # distill, artifacts, transformers, generate and the final rows: ~1-2 min on 2 cores
def test_distilled_directory_loads_everywhere(tiny_dir, texts, cache, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from powerinfer_jax.sparsity.artifacts import load_artifacts, model_fingerprint

    train, valid = texts
    cfg = small(variant="relu", samples=2, sample_fraction=0.5)
    out = tmp_path / "relu"
    curve = tmp_path / "curve.jsonl"
    distill(str(tiny_dir), cfg, out=out, corpus=[train], progress=False, eval_text=valid,
            curve=curve, eval_every=2, eval_chunks=1, calibrate=False)
    build_artifacts(out, cfg.target_sparsity, corpus=[train], progress=False,
                    train=TrainConfig(rank=8, steps=20))  # what calibrate=True runs, smaller
    ckpt = load_checkpoint(out)
    assert ckpt.config.activation == "relu"
    assert json.loads((out / "config.json").read_text())["hidden_act"] == "relu"
    model = from_params(ckpt.config, ckpt.params, kernels="xla")
    tokens = np.asarray([ckpt.tokenizer.encode("the quick brown fox jumps over")], np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert_close(ours, theirs, "trained_logits")
    original = load_checkpoint(tiny_dir)
    assert ckpt.tokenizer.encode("hello world") == original.tokenizer.encode("hello world")
    assert ckpt.tokenizer.chat_template == original.tokenizer.chat_template
    # the sparsity artifacts were built by the project's pipeline for this model
    fp = model_fingerprint(str(out), ckpt.source, ckpt.config)
    arts = load_artifacts(out / "sparsity" / "target_0.70", fingerprint=fp, need_predictor=True)
    assert arts.meta["profile"]["activation"] == "relu"
    rows = [json.loads(line) for line in curve.read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [("baseline", 0), ("start", 0),
                                                        ("train", 2), ("end", 4)]
    assert {"ffn_sparsity", "ppl_x_dense", "tokens", "variant", "machine", "commit",
            "wall_s", "threads", "config"} <= set(rows[0])
    proc = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", "--model", str(out),
                           "--prompt", "the dog", "--max-new-tokens", "2", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]) == 2
    # the final rows: the relu model's own zeros skipped exactly (threshold mode) score as dense
    from experiments import sparsify_curve as sc

    monkeypatch.setattr(sc, "FINAL_CTX", 32)
    monkeypatch.setattr(sc, "FINAL_CHUNKS", 2)
    monkeypatch.setitem(sc.DATA, "train", train)
    monkeypatch.setitem(sc.DATA, "valid", valid)
    final = sc.final_rows(out, threads=2, modes=("dense", "threshold"))
    assert [r["mode"] for r in final] == ["dense", "threshold"]
    assert final[1]["ffn_sparsity"] > 0.3
    assert final[1]["ppl"] == pytest.approx(final[0]["ppl"], rel=1e-4)


@pytest.mark.slow
def test_fatrelu_run_exports_its_layer_thresholds(tiny_dir, texts, cache, tmp_path):
    """A fatrelu run's model is ReLU with one gate threshold per layer in config.json, which
    its sparsity artifacts take as threshold mode's thresholds."""
    train, _ = texts
    out = tmp_path / "fatrelu"
    distill(str(tiny_dir), small(variant="fatrelu"), out=out, corpus=[train], progress=False,
            calibrate=False)
    config = json.loads((out / "config.json").read_text())
    gates = config["fatrelu_threshold"]
    assert config["hidden_act"] == "relu"
    assert len(gates) == load_checkpoint(out).config.n_layers and min(gates) > 0
    built = build_artifacts(out, 0.7, corpus=[train], progress=False, predictors=False)
    assert built[0].thresholds_gate == pytest.approx(tuple(gates))
    # the runtime's own build (load(...).calibrate, python -m powerinfer_jax.calibrate) takes
    # them from the loaded model's config too, and profiles FATReLU's active set, not ReLU's
    # zeros (plain: the same weights without the thresholds)
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity import artifacts as A

    ckpt = load_checkpoint(out)
    model = from_params(ckpt.config, ckpt.params)
    kw = dict(fingerprint=A.model_fingerprint(str(out), ckpt.source, ckpt.config),
              target_sparsity=0.7, corpus_files=[train], train=None, progress=False)
    fat = A.build_artifacts(model, ckpt.tokenizer, root=tmp_path / "a", **kw)
    plain_model = from_params(ckpt.config.replace(fatrelu_thresholds=()), ckpt.params)
    plain = A.build_artifacts(plain_model, ckpt.tokenizer, root=tmp_path / "b", **kw)
    assert fat.thresholds_gate == pytest.approx(tuple(gates))
    assert fat.thresholds_gate != pytest.approx(plain.thresholds_gate)
    fat_sp, plain_sp = (np.mean(a.meta["profile"]["sparsity"]) for a in (fat, plain))
    assert fat_sp > plain_sp  # the thresholds turn more neurons off than ReLU alone


def test_fatrelu_active_set_is_the_gate_above_each_layers_threshold(tiny_dir):
    """A FATReLU model's profile and predictor targets (artifacts.build_for_target's masks) are
    the neurons whose activated gate is above the layer's threshold, computed here with numpy."""
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsity import profile as prof

    ckpt = load_checkpoint(tiny_dir)
    model = from_params(ckpt.config, ckpt.params)
    c = ckpt.config
    x = np.random.default_rng(0).standard_normal((c.n_layers, 40, c.d_model)).astype(np.float32)
    gate_t = np.array([0.05 * (l + 1) for l in range(c.n_layers)])
    masks = prof.active_masks(model, x, np.zeros(c.n_layers), progress=False,
                              gate_thresholds=gate_t)
    plain = prof.active_masks(model, x, np.zeros(c.n_layers), progress=False)
    act = {"relu": lambda v: np.maximum(v, 0), "silu": lambda v: v / (1 + np.exp(-v))}[
        c.activation]
    for layer in range(c.n_layers):
        ffn = model.layers[layer].ffn
        g = act(x[layer].astype(np.float64) @ np.asarray(ffn.gate.weight[...], np.float64).T)
        a = g * (x[layer].astype(np.float64) @ np.asarray(ffn.up.weight[...], np.float64).T)
        want = (np.abs(a) > 0) & (np.abs(g) > gate_t[layer])
        assert (masks[layer] == want).mean() > 0.995  # float32 vs float64 at the boundary only
        assert masks[layer].sum() < plain[layer].sum()  # the threshold turned neurons off
    with pytest.raises(ValueError, match=r"gate_thresholds: expected one per layer \(2\)"):
        prof.active_masks(model, x, np.zeros(c.n_layers), progress=False, gate_thresholds=[0.1])


# -------------------------------------------------------------------------------- bad input
def test_config_rejects_bad_values():
    with pytest.raises(UserError, match="--target-sparsity"):
        DistillConfig(target_sparsity=1.0)
    with pytest.raises(UserError, match="--target-sparsity"):
        DistillConfig(target_sparsity=0.0)
    with pytest.raises(UserError, match="--tokens.*at least one step"):
        DistillConfig(tokens=100, batch=4, seq_len=256)
    with pytest.raises(UserError, match="--variant"):
        DistillConfig(variant="gelu")
    with pytest.raises(UserError, match="--mask-by: expected layer for the fatrelu variant"):
        DistillConfig(variant="fatrelu", mask_by="token")
    with pytest.raises(UserError, match="--fatrelu-kl-rise"):
        DistillConfig(variant="fatrelu", fatrelu_kl_rise=0.05)


def test_cli_reports_bad_target_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "powerinfer_jax.sparsify",
                           "--target-sparsity", "1.5"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --target-sparsity: expected a float in (0, 1)")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_unsupported_architecture(tmp_path, texts):
    d = tmp_path / "opt"
    save_hf_opt(d)
    with pytest.raises(UserError, match="architecture.*gated"):
        distill(str(d), small(), out=tmp_path / "o", corpus=[texts[0]], progress=False)


def test_corpus_errors(tiny_dir, tmp_path, cache):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="non-empty"):
        distill(str(tiny_dir), small(), out=tmp_path / "o", corpus=[empty], progress=False)
    valid = tmp_path / "wiki.valid.txt"
    valid.write_text("some validation text " * 50)
    with pytest.raises(ValueError, match="validation file"):
        distill(str(tiny_dir), small(), out=tmp_path / "o", corpus=[valid], progress=False)
    short = tmp_path / "short.txt"
    short.write_text("the fox")
    with pytest.raises(UserError, match="--corpus"):
        distill(str(tiny_dir), small(), out=tmp_path / "o", corpus=[short], progress=False)


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_model(tiny_dir, texts, cache, tmp_path):
    other = tmp_path / "other"
    save_hf_llama(other, seed=5)
    cfg = small()
    kw = dict(out=tmp_path / "o", corpus=[texts[0]], progress=False, calibrate=False)
    distill(str(tiny_dir), cfg, stop_after=1, **kw)
    with pytest.raises(UserError, match="another model"):
        distill(str(other), cfg, resume=True, **kw)
    with pytest.raises(UserError, match="same run config"):
        distill(str(tiny_dir), cfg.replace(lr=1e-4), resume=True, **kw)


def test_curve_plot_from_rows(tmp_path):
    from experiments.sparsify_curve import plot_curve

    cfg = small().to_dict()
    rows = [{"stage": s, "tokens": t, "ppl_x_dense": p, "ffn_sparsity": 0.85, "config": cfg,
             "commit": "abc"} for s, t, p in (("baseline", 0, 1.7), ("start", 0, 1.6),
                                             ("train", 1024, 1.4), ("end", 2048, 1.3))]
    rows.append({"stage": "final", "mode": "oracle", "tokens": 2048, "ppl_x_dense": 1.31,
                 "ffn_sparsity": 0.86, "config": cfg})
    plot_curve(rows, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_fatrelu_thresholds_of_another_size_are_refused_in_one_line(tmp_path):
    """A config.json whose per-layer FATReLU thresholds do not match the model's layers (a
    damaged or foreign file) is named, never applied to the wrong layers (the one parser,
    checkpoint.base.fatrelu_thresholds, that every reader of the key goes through)."""
    from powerinfer_jax.checkpoint.base import fatrelu_thresholds

    (tmp_path / "config.json").write_text(json.dumps({"fatrelu_threshold": [0.1, 0.2]}))
    gate = json.loads((tmp_path / "config.json").read_text())["fatrelu_threshold"]
    parse = lambda v, n: fatrelu_thresholds(v, n, "fatrelu_threshold")  # noqa: E731
    assert parse(gate, 2) == (0.1, 0.2) and parse(0.3, 2) == (0.3, 0.3)
    with pytest.raises(ValueError, match=r"fatrelu_threshold: expected a finite number >= 0 or "
                                         r"a list of 3 \(one per layer\), got \[0.1, 0.2\]"):
        parse(gate, 3)
