"""The GPU burst (benchmarks/gpu/burst*.py: the run, its files, their import) on tiny random
models: what it writes stays within the limits of the runner it was made for and reads back as
the student it trained, the model burst_import makes scores what the burst said it would, and its
scanned forward (burst_scan.py) equals the library's unrolled one."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.gpu import burst_files as bf
from benchmarks.gpu import burst_scan as scan
from helpers_models import CORPUS, save_hf_llama, tiny_llama_config
from helpers_tolerances import assert_close
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.transformer import Transformer, from_params
from powerinfer_jax.sparsify import DistillConfig
from powerinfer_jax.sparsify import forward as fw
from powerinfer_jax.sparsify.export import canonical_params
from powerinfer_jax.sparsify.train import Distiller

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


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_params(n_layers=2, f=37, d=64, seed=0, scale=0.0):
    rng = np.random.default_rng(seed)
    p = {f"layers.{i}.ffn.{m}.weight": rng.standard_normal((f, d)).astype(np.float32)
         for i in range(n_layers) for m in ("gate", "up", "down_t")}
    p.update({f"layers.{i}.ffn_norm.scale": np.ones(d, np.float32) for i in range(n_layers)})
    if scale:
        p = {k: v + scale * rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()}
    return p


# ------------------------------------------------------------------------------- the files
def test_delta_files_read_back_within_their_block_error(tmp_path, monkeypatch):
    teacher = fake_params()
    student = fake_params(scale=0.01)
    monkeypatch.setattr(bf, "SHARD_BYTES", 4000)  # several shards
    norms = {"layers.1.ffn_norm.scale": student["layers.1.ffn_norm.scale"]}
    log = bf.write(tmp_path, student, teacher, 2, {"run": "x"}, norms)
    assert len(log["shards"]) > 2 and {t["qtype"] for t in log["tensors"]} == {"Q5_0", "Q8_0",
                                                                               "F32"}
    got, read_log = bf.read(tmp_path, teacher, 2)
    assert read_log["run"] == "x"
    for m, qtype in bf.DELTA_QTYPES.items():
        name = f"layers.0.ffn.{m}.weight"
        delta = student[name] - teacher[name]
        err = np.abs(got[name] - student[name]).max() / np.abs(delta).max()
        assert err < {"Q5_0": 1 / 30, "Q8_0": 1 / 250}[qtype] * 1.1, (m, err)
        assert err > 0  # blocks, not the floats
    np.testing.assert_array_equal(got["layers.1.ffn_norm.scale"],
                                  student["layers.1.ffn_norm.scale"])
    np.testing.assert_array_equal(got["layers.0.ffn_norm.scale"],
                                  teacher["layers.0.ffn_norm.scale"])  # not trained: teacher's
    # a changed shard is refused with its name
    shard = tmp_path / log["shards"][1]["name"]
    raw = bytearray(shard.read_bytes())
    raw[7] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=shard.name):
        bf.read(tmp_path, teacher, 2)


def test_smollm2_sized_output_fits_the_device_limits(tmp_path):
    """SmolLM2's FFN (30 x 1536 x 576 per matrix) as the burst writes it: <= 8 files, each
    <= 16 MiB, <= 64 MiB in all, with a log and burst.log beside it."""
    l, f, d = 30, 1536, 576
    total = sum(l * f * (d // 32) * {"Q5_0": 22, "Q8_0": 34}[q] for q in bf.DELTA_QTYPES.values())
    shards = -(-total // bf.SHARD_BYTES)
    assert shards == 4 and total + (1 << 20) <= bf.MAX_TOTAL_BYTES
    assert shards + 3 <= bf.MAX_FILES  # + burst.json, burst.log, burst_error.json
    assert bf.SHARD_BYTES <= bf.MAX_FILE_BYTES


def test_limits_name_the_rule_broken(tmp_path):
    (tmp_path / "ok.bin").write_bytes(b"x")
    assert bf.check_limits(tmp_path) == {"files": 1, "bytes": 1}
    (tmp_path / "bad name.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="A-Za-z0-9"):
        bf.check_limits(tmp_path)
    (tmp_path / "bad name.bin").unlink()
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"x")
    with pytest.raises(UserError, match="folders deep"):
        bf.check_limits(tmp_path)
    shutil.rmtree(tmp_path / "a")
    for i in range(8):
        (tmp_path / f"f{i}").write_bytes(b"x")
    with pytest.raises(UserError, match="at most 8 files"):
        bf.check_limits(tmp_path)


# ---------------------------------------------------------------- the burst, end to end (tiny)
@pytest.fixture(scope="module")
def burst_out(tiny_dir, tmp_path_factory):
    from benchmarks.gpu import burst

    d = tmp_path_factory.mktemp("burst")
    tok = load_checkpoint(tiny_dir).tokenizer
    data = d / "data"
    data.mkdir()
    for name, text in (("train", " ".join(CORPUS * 12)), ("valid", " ".join(CORPUS[::-1] * 8))):
        np.save(data / f"{name}_ids.npy", np.asarray(tok.encode(text, add_bos=False), np.uint16))
    out = d / "out"
    burst.main(["--teacher", str(tiny_dir), "--data", str(data), "--out", str(out),
                "--budget", "6", "--batch", "2", "--seq-len", "16", "--samples", "2",
                "--sample-batch", "2", "--eval-chunks", "2", "--eval-points", "1",
                "--refit-tokens", "64", "--warmup-steps", "2", "--lr", "3e-3",
                "--fatrelu-kl-rise", "0.5", "--train", "ffn+norms"])
    return out, data


@pytest.mark.slow  # the burst end to end (compile, train, samples, evaluate): ~2 min on 2 cores
def test_burst_writes_what_import_burst_rebuilds(burst_out, tiny_dir, cache, tmp_path):
    from powerinfer_jax.runtime import perplexity as evaluate
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.session import build
    from benchmarks.gpu.burst_import import import_burst

    out, data = burst_out
    log = json.loads((out / bf.LOG).read_text())
    assert bf.check_limits(out)["files"] <= bf.MAX_FILES
    assert log["steps"] >= 1 and log["tokens_trained"] == log["steps"] * 32
    assert log["timing"]["compile"] > 0 and log["curve"] and log["final"] is True
    assert log["stopped"] in ("deadline", None)
    assert {"dense", "start", "end_relu", "rebuilt_relu"} <= set(log["eval"])
    assert any(t["name"].endswith("norm.scale") for t in log["tensors"])  # ffn+norms
    model_dir = tmp_path / "model"
    train_text = tmp_path / "train.txt"
    train_text.write_text(" ".join(CORPUS * 12))
    got, _ = import_burst(out, model_arg=str(tiny_dir), out=model_dir, corpus=[train_text],
                          predictors=False, progress=False)
    ckpt = load_checkpoint(got)
    assert ckpt.config.activation == "relu"
    cfg = json.loads((got / "config.json").read_text())
    assert cfg["hidden_act"] == "relu" and cfg.get("fatrelu_threshold") == log["fatrelu_threshold"]
    # the burst's own score of the rebuilt student == the runtime's score of the imported model
    # (the model as stored: FATReLU at its threshold, which the runtime applies in dense mode)
    valid = np.load(data / "valid_ids.npy").astype(np.int64)
    rebuilt = log["eval"]["rebuilt_fatrelu" if log["fatrelu_threshold"] else "rebuilt_relu"]
    s = build(str(got), RuntimeConfig(dtype="float32", weights="dtype"), SparsityConfig(),
              progress=False)
    res = evaluate.perplexity(s.model, valid, ctx=rebuilt["ctx"], max_chunks=rebuilt["chunks"])
    assert res["ppl"] == pytest.approx(rebuilt["ppl"], rel=2e-3)


@pytest.mark.slow  # its fixture runs a burst (~11 s)
def test_import_burst_refuses_another_teacher(burst_out, tmp_path, cache):
    from benchmarks.gpu.burst_import import import_burst

    out, _ = burst_out
    other = tmp_path / "other"
    save_hf_llama(other, seed=5)
    with pytest.raises(UserError, match="the teacher the burst trained from"):
        import_burst(out, model_arg=str(other), out=tmp_path / "m", progress=False)
    with pytest.raises(UserError, match="burst.json"):
        import_burst(tmp_path, model_arg=str(other), out=tmp_path / "m", progress=False)


# --------------------------------------------------------------------------- scanned forward
@pytest.mark.slow
def test_scanned_forward_matches_the_unrolled_one():
    config, params = tiny("silu")
    model = from_params(config, params, kernels="xla")
    x = jnp.asarray(tokens(config, seed=7))
    spec = fw.FFNSpec("relu")
    gate = jnp.float32(0.02)
    defs, p, f = scan.split(model, "ffn+norms")
    got, aux = scan.forward(defs, p, f, x, spec, gate_threshold=gate, collect_hidden=True)
    want, want_aux = fw.forward(model, x, spec, gate_threshold=gate, collect_hidden=True)
    assert_close(got, want, "regrouped")
    for k in ("zero_frac", "l1", "l1_gate", "hidden"):
        assert_close(aux[k], want_aux[k], "training_aux", err_msg=k)
    # the gradient of a loss, for every trained matrix and norm: one step of +grad each way
    def loss(logits):
        return jnp.mean(logits ** 2)

    def add(a, b):
        return a + b

    g_scan = jax.grad(lambda p: loss(scan.forward(defs, p, f, x, spec)[0]))(p)
    d = Distiller(from_params(config, params, kernels="xla"),
                  from_params(config, params, kernels="xla"),
                  DistillConfig(variant="relu", train="ffn+norms", tokens=32, batch=2, seq_len=16,
                                refit=False, samples=0, sample_fraction=0.0))
    g_ref = jax.grad(lambda p: loss(fw.forward(nnx.merge(d.graphdef, p, d.frozen), x,
                                               spec)[0]))(d.params)
    ref = canonical_params(nnx.merge(d.graphdef, jax.tree.map(add, d.params, g_ref), d.frozen))
    scan.update(model, defs, jax.tree.map(add, p, g_scan))
    got_params = canonical_params(model)
    names = ["final_norm.scale"] + [f"layers.{i}.{n}" for i in range(config.n_layers) for n in (
        "ffn.gate.weight", "ffn.up.weight", "ffn.down_t.weight", "ffn_norm.scale",
        "attn_norm.scale")]
    for name in names:
        assert_close(got_params[name] - params[name], ref[name] - params[name], "weight_updates",
                     err_msg=name)
    assert np.abs(ref["layers.0.ffn.gate.weight"] - params["layers.0.ffn.gate.weight"]).max() > 0
    np.testing.assert_array_equal(got_params["layers.0.attn.q.weight"],
                                  params["layers.0.attn.q.weight"])  # frozen
    with pytest.raises(ValueError, match="scope"):
        scan.split(model, "all")


# ------------------------------------------------------------------ the device-side script
@pytest.mark.slow
def test_train_burst_script_stages_joins_checks_and_runs(tmp_path):
    """benchmarks/gpu/train_burst.sh as the two runner calls run it, on a tiny GGUF split in two
    parts: call 1 stages part 1, call 2 joins, checks the sha256 and runs the burst; a changed
    part is refused before anything trains."""
    import hashlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.gpu import synthetic
    from helpers_models import tiny_llama_config

    repo = Path(__file__).resolve().parents[1]

    cfg = tiny_llama_config(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                            d_ff=96, max_seq_len=128)
    gguf = tmp_path / "teacher.gguf"
    synthetic.write_gguf(gguf, cfg, dtype="f32", seed=1)
    raw = gguf.read_bytes()
    work = tmp_path / "checkout"
    p1, p2 = work / ".burst" / "p1", work / ".burst" / "p2"
    p1.mkdir(parents=True)
    p2.mkdir()
    (p1 / "teacher.gguf.part1").write_bytes(raw[:len(raw) // 2])
    (p1 / "teacher.gguf.part1.sha256").write_text(
        hashlib.sha256(raw[:len(raw) // 2]).hexdigest() + "\n")
    (p2 / "teacher.gguf.part2").write_bytes(raw[len(raw) // 2:])
    (p2 / "manifest.json").write_text(json.dumps({"sha256": hashlib.sha256(raw).hexdigest()}))
    rng = np.random.default_rng(0)
    np.save(p2 / "train_ids.npy", rng.integers(3, cfg.vocab_size, 2000).astype(np.uint16))
    np.save(p2 / "valid_ids.npy", rng.integers(3, cfg.vocab_size, 300).astype(np.uint16))
    env = {**os.environ, "PYTHONPATH": str(repo), "PIJ_BURST_STAGE": str(tmp_path / "stage"),
           "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    script = str(repo / "benchmarks" / "gpu" / "train_burst.sh")

    def call(*args):
        return subprocess.run(["bash", script, *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=900)

    r = call("stage")
    assert r.returncode == 0 and "sha256 ok" in r.stdout, r.stdout + r.stderr
    r = call("run", "--budget", "3", "--batch", "2", "--seq-len", "16", "--samples", "2",
             "--sample-batch", "2", "--eval-chunks", "1", "--refit-tokens", "64",
             "--warmup-steps", "2")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    log = json.loads((tmp_path / "out" / bf.LOG).read_text())
    assert log["steps"] >= 1 and (tmp_path / "out" / "burst.log").is_file()
    assert bf.check_limits(tmp_path / "out")["files"] <= bf.MAX_FILES
    changed = bytearray((p2 / "teacher.gguf.part2").read_bytes())
    changed[-1] ^= 1
    (p2 / "teacher.gguf.part2").write_bytes(bytes(changed))
    r = call("run")
    assert r.returncode != 0 and "sha256" in r.stdout and "starting the burst" not in r.stdout
