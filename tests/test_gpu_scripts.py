"""The GPU comparison's scripts, checked without a GPU (benchmarks/gpu/).

synthetic.py: the streamed GGUF holds what the gguf package reads back (names, shapes, types,
metadata, every tensor's bits), our loader loads it as the same model, and llama.cpp loads and
runs it when a build is at hand ($PIJ_LLAMA_CPP_BIN or .peers/llama.cpp-cuda); profiles load from
each format and map onto other shapes keeping their distribution. llama_cpp_ngl.py: GGUF byte
accounting against the file, the -ngl / -ot layouts against hand-computed budgets, the
llama-bench command and its JSON. The shell scripts parse.
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu import llama_cpp_ngl as lcn, synthetic
from helpers_models import tiny_llama_config
from helpers_rows import assert_llama_bench_row, assert_our_decode_row
from helpers_tolerances import assert_close

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "benchmarks" / "gpu"

CFG = tiny_llama_config(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
                        max_seq_len=128)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.bf16.gguf"
    info = synthetic.write_gguf(path, CFG, dtype="bf16", seed=3)
    return path, info


def test_gguf_reads_back_with_the_gguf_package(tiny_gguf):
    from gguf import GGUFReader

    path, info = tiny_gguf
    r = GGUFReader(str(path))
    plan = synthetic.tensor_plan(CFG, "bf16")
    assert [t.name for t in r.tensors] == [name for name, _, _ in plan]
    for t, (name, shape, gtype) in zip(r.tensors, plan):
        assert t.tensor_type.name == gtype and tuple(int(x) for x in t.shape[::-1]) == shape
        want = synthetic.tensor_values(name, shape, gtype, seed=3)
        got = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8).view(want.dtype)
        np.testing.assert_array_equal(got.reshape(shape), want)
        assert int(t.n_bytes) == info["tensor_bytes"][name]

    def field(key):
        f = r.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    assert field("llama.block_count") == 3 and field("llama.feed_forward_length") == 96
    assert field("llama.attention.head_count_kv") == 2
    assert len(r.fields["tokenizer.ggml.tokens"].data) == CFG.vocab_size


def test_bf16_values_are_plain_numbers():
    bits = synthetic.tensor_values("blk.0.ffn_up.weight", (64, 300), "BF16", seed=0)
    x = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.isfinite(x)) and np.all(np.abs(x) >= 2.0 ** -7) and np.all(np.abs(x) < 2 ** -5)
    assert 0.4 < (x > 0).mean() < 0.6
    f16 = synthetic.tensor_values("blk.0.ffn_up.weight", (64, 300), "F16", seed=0).view(np.float16)
    assert np.all(np.isfinite(f16)) and np.all(np.abs(f16) >= 2.0 ** -7)


def test_our_loader_reads_the_same_model(tiny_gguf):
    from powerinfer_jax.checkpoint.base import rope_unpermute
    from powerinfer_jax.checkpoint.gguf import load_gguf

    path, _ = tiny_gguf
    ck = load_gguf(path)
    c = ck.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (
        3, 64, 96, 4, 2, 16, CFG.vocab_size)

    def value(name, shape):
        bits = synthetic.tensor_values(name, shape, "BF16", seed=3)
        return (bits.astype(np.uint32) << 16).view(np.float32)

    np.testing.assert_array_equal(ck.params["layers.1.ffn.down_t.weight"],
                                  value("blk.1.ffn_down.weight", (64, 96)).T)
    np.testing.assert_array_equal(ck.params["layers.2.attn.q.weight"],
                                  rope_unpermute(value("blk.2.attn_q.weight", (64, 64)), 4))
    ids = ck.tokenizer.encode("\u2581w7", add_bos=False)
    assert ids and all(0 <= i < c.vocab_size for i in ids), ids
    assert "w7" in ck.tokenizer.decode(ids), (ids, ck.tokenizer.decode(ids))


def _llama_cpp_bin() -> Path | None:
    for d in (os.environ.get("PIJ_LLAMA_CPP_BIN"), REPO / ".peers" / "llama.cpp-cuda"):
        if d and any((Path(d) / b).is_file() for b in ("llama-bench", "llama-batched-bench")):
            return Path(d)
    return None


@pytest.mark.skipif(_llama_cpp_bin() is None,
                    reason="no llama.cpp build ($PIJ_LLAMA_CPP_BIN or .peers/llama.cpp-cuda)")
def test_llama_cpp_runs_the_file(tiny_gguf):
    """llama.cpp (on this machine's CPU) loads the file and decodes with it."""
    path, _ = tiny_gguf
    d = _llama_cpp_bin()
    env = lcn.library_env(d)
    if (d / "llama-bench").is_file():
        lay = lcn.Layout("ngl", 0, (), 0)
        cmd = lcn.llama_bench_cmd(d, path, lay, threads=1, prompt_tokens=4, new_tokens=4,
                                  repeats=1)
        res = lcn.run_llama_bench(cmd, env, timeout=120)
        assert_llama_bench_row(res, repeats=1, new_tokens=4)
    else:
        r = subprocess.run([str(d / "llama-batched-bench"), "-m", str(path), "-npp", "8",
                            "-ntg", "4", "-npl", "1", "-t", "1", "-c", "64"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out = r.stdout + r.stderr  # the table goes to llama.cpp's log (stderr)
        assert "|     8 |      4 |    1 |" in out, out[-1000:]


# ------------------------------------------------------------------------ profiles
def test_profiles_load_from_every_format(tmp_path):
    freq, label = synthetic.load_profile("0.80")
    assert freq.shape == (30, 1536) and label.endswith(":target_0.80")
    same, _ = synthetic.load_profile(f"{synthetic.BUNDLED_PROFILE}:target_0.80")
    np.testing.assert_array_equal(freq, same)
    counts = np.random.default_rng(0).integers(0, 50, size=(4, 24))
    np.savez(tmp_path / "profile.npz", counts=counts, n_tokens=50, thresholds=np.zeros(4))
    got, _ = synthetic.load_profile(str(tmp_path / "profile.npz"))
    assert_close(got, counts / 50, "float_equal")
    np.savez(tmp_path / "f.npz", frequency=counts / 100)
    assert_close(synthetic.load_profile(str(tmp_path / "f.npz"))[0], counts / 100, "float_equal")
    for bad, msg in ((str(tmp_path / "f.npz") + ":nope", "expected a key in"),
                     ("0.33", "expected a key in"), (str(tmp_path / "none.npz"), "expected")):
        with pytest.raises(SystemExit, match=msg):
            synthetic.load_profile(bad)
    np.savez(tmp_path / "big.npz", frequency=counts)
    with pytest.raises(SystemExit, match=r"frequencies in \[0, 1\]"):
        synthetic.load_profile(str(tmp_path / "big.npz"))


def test_frequencies_map_a_profile_onto_other_shapes():
    src, _ = synthetic.load_profile("0.50")
    seven = synthetic.SHAPES["llama2-7b"]
    out = synthetic.frequencies(src, seven)
    assert out.shape == (32, 11008)
    np.testing.assert_array_equal(synthetic.frequencies(src, synthetic.SHAPES["smollm2-135m"]),
                                  src)
    for l, s in ((0, 0), (31, 29)):  # first and last layers keep their source's distribution
        q = np.linspace(0.05, 0.95, 10)
        assert_close(np.quantile(out[l], q), np.quantile(src[s], q), "quantiles")
    assert not np.all(np.diff(out[5]) <= 0)  # neurons in a random order, not sorted
    np.testing.assert_array_equal(out, synthetic.frequencies(src, seven))  # seeded


# ------------------------------------------------------------------------ llama_cpp_ngl
def test_gguf_bytes_match_the_file(tiny_gguf):
    path, info = tiny_gguf
    s = lcn.gguf_bytes(path)
    tb = info["tensor_bytes"]
    assert s.n_layers == 3 and s.token_embd == tb["token_embd.weight"]
    assert s.output == tb["output_norm.weight"] + tb["output.weight"]
    for l in range(3):
        assert s.layer[l] == sum(v for k, v in tb.items() if k.startswith(f"blk.{l}."))
        assert s.ffn[l] == 3 * 96 * 64 * 2
    assert s.kv_per_token_layer == 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, f16
    assert sum(s.layer) + s.output + s.token_embd == sum(tb.values())


def test_layouts_fill_the_budget_like_place_layers():
    s = lcn.GgufBytes(n_layers=4, layer=(100,) * 4, ffn=(60,) * 4, output=30, token_embd=50,
                      kv_per_token_layer=1)
    # ngl: output (30), then whole layers of 100 + 10 KV (n_ctx 10), from the last one
    cases = {0: 0, 29: 0, 30: 1, 139: 1, 140: 2, 250: 3, 470: 5, 10 ** 6: 5}
    for budget, k in cases.items():
        lay = lcn.llama_cpp_layout(s, budget, 10, "ngl")
        assert lay.ngl == k and lay.gpu_bytes == (0 if k == 0 else 30 + 110 * (k - 1))
        assert lay.gpu_bytes <= budget and lay.args() == ["-ngl", str(k)]
    # ot: output + every layer's non-FFN part and KV (30 + 4 * 50) first, then whole FFNs
    assert lcn.llama_cpp_layout(s, 229, 10, "ot") is None
    for budget, j in ((230, 0), (289, 0), (290, 1), (410, 3), (470, 4)):
        lay = lcn.llama_cpp_layout(s, budget, 10, "ot")
        assert lay.ngl == 5 and lay.cpu_ffn_layers == tuple(range(j, 4))
        assert lay.gpu_bytes == 230 + 60 * j <= budget
    lay = lcn.llama_cpp_layout(s, 290, 10, "ot")
    assert lay.args() == ["-ngl", "5", "-ot", r"blk\.(1|2|3)\.ffn_(gate|up|down)\.weight=CPU"]
    assert lcn.llama_cpp_layout(s, 470, 10, "ot").args() == ["-ngl", "5"]
    # ncmoe (MoE): every layer and KV on the GPU (30 + 4 * 110 = 470), then the routed experts
    # (80 of each layer's 100) of the first N layers left on the host, N the fewest that fit
    with pytest.raises(ValueError, match="mixture-of-experts"):
        lcn.llama_cpp_layout(s, 470, 10, "ncmoe")
    m = dataclasses.replace(s, exps=(80,) * 4)
    for budget, n in ((470, 0), (469, 1), (390, 1), (389, 2), (150, 4)):
        lay = lcn.llama_cpp_layout(m, budget, 10, "ncmoe")
        assert lay.n_cpu_moe == n and lay.gpu_bytes == 470 - 80 * n <= budget
        assert lay.args() == ["-ngl", "5", "--n-cpu-moe", str(n)]
    assert lcn.llama_cpp_layout(m, 149, 10, "ncmoe") is None


def test_gguf_bytes_of_a_moe_file(tmp_path):
    """gguf_bytes reads any architecture's keys and sums each layer's routed experts."""
    import gguf

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    for l in range(2):
        w.add_tensor(f"blk.{l}.attn_q.weight", np.zeros((8, 8), np.float32))
        for k in ("gate", "up", "down"):
            w.add_tensor(f"blk.{l}.ffn_{k}_exps.weight", np.zeros((4, 8, 8), np.float32))
    w.add_tensor("output.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    b = lcn.gguf_bytes(path)
    assert b.n_layers == 2 and b.exps == (3 * 4 * 64 * 4,) * 2
    assert b.layer == (64 * 4 + 3 * 4 * 64 * 4,) * 2 and b.output == 320 and b.token_embd == 320
    assert b.kv_per_token_layer == 2 * 1 * 4 * lcn.KV_ITEM_BYTES


def test_our_budget_is_hybrid_decodes():
    """The budget's byte count is placement.model_bytes of the real model, without making it."""
    import jax.numpy as jnp
    from flax import nnx

    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.sparsity import placement as pl

    budget, sizes = lcn.our_budget(CFG, "bfloat16", 0.25, kv_len=64)
    real = pl.model_bytes(Transformer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), kv_len=64)
    assert sizes == real and budget == real.dense + int(0.25 * real.ffn)


def test_llama_bench_command_and_output():
    lay = lcn.Layout("ot", 33, (30, 31), 123)
    cmd = lcn.llama_bench_cmd("/x", "m.gguf", lay, threads=12, prompt_tokens=8, new_tokens=32,
                              repeats=3)
    assert cmd == ["/x/llama-bench", "-m", "m.gguf", "-ngl", "33", "-ot",
                   r"blk\.(30|31)\.ffn_(gate|up|down)\.weight=CPU", "-t", "12", "-p", "0",
                   "-n", "32", "-d", "8", "-r", "3", "-o", "jsonl"]
    line = json.dumps({"build_commit": "0c1e570", "n_gpu_layers": 33, "n_prompt": 0, "n_gen": 32,
                       "n_depth": 8, "avg_ts": 41.5, "stddev_ts": 0.5,
                       "samples_ts": [41.0, 41.5, 42.0]})
    row = lcn.parse_llama_bench("some log line\n" + line + "\n")
    assert row["avg_ts"] == 41.5
    with pytest.raises(RuntimeError, match="n_gen > 0"):
        lcn.parse_llama_bench("no json here")


@pytest.mark.slow
def test_dry_run_prints_budgets_and_commands(tmp_path):
    """The whole planning path on the real shapes' arithmetic, against a small stand-in file:
    --dry-run refuses a file of the wrong depth, and plans one of the right depth."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.llama_cpp_ngl", "--llama-bin", "/x",
                        "--gguf", str(tmp_path / "missing.gguf"), "--dry-run"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "expected an existing --gguf" in r.stderr
    path = tmp_path / "deep.gguf"
    synthetic.write_gguf(path, CFG.replace(n_layers=32, vocab_size=300), dtype="bf16")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.llama_cpp_ngl", "--llama-bin", "/x",
                        "--gguf", str(path), "--budgets", "0.1", "1.0", "--dry-run"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    plans = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert [p["budget_ffn_fraction"] for p in plans] == [0.1, 1.0]
    # the stand-in is tiny next to Llama-2-7B's budget: everything fits
    assert plans[1]["ngl"]["ngl"] == 33 and plans[1]["ot"]["cpu_ffn_layers"] == 0
    assert sum(l.startswith("/x/llama-bench") for l in r.stdout.splitlines()) == 4


def test_shell_scripts_parse():
    for script in GPU.glob("*.sh"):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


# ------------------------------------------------------------------------ sparse_7b_check.sh
def _cpu_llama_bench() -> Path | None:
    from powerinfer_jax.cache import cache_dir

    for d in (os.environ.get("PIJ_LLAMA_CPP_BIN"),
              cache_dir() / "peers" / "llamacpp-cpu-native" / "bin"):
        if d and (Path(d) / "llama-bench").is_file():
            return Path(d)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_cpu_llama_bench() is None,
                    reason="no CPU llama-bench ($PIJ_LLAMA_CPP_BIN or the peers' native build)")
def test_sparse_7b_check_dry_run(tmp_path):
    """The GPU check's whole pipeline on this CPU at a tiny shape: the carry folder is prepared
    (llama.cpp source subset, tokenizer-only GGUF, calibration text), the subset unpacks and
    configures, the synthetic model is generated from the carried files, and both engines are
    timed into JSONL rows; the CUDA steps say they were skipped and why. ~2-4 min on 2 cores."""
    from benchmarks.gpu import sparse_7b_prepare as prep
    import tarfile

    carry = tmp_path / "carry"
    try:
        prep.llama_cpp_tree()
    except SystemExit as e:
        pytest.skip(f"no llama.cpp tree: {e}")
    prep.main(["--out", str(carry), "--no-wheels", "--calib-bytes", "60000"])
    with tarfile.open(carry / "llama.cpp-src.tar.xz") as tar:
        names = set(tar.getnames())
    assert {"llama.cpp/CMakeLists.txt", "llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt",
            "llama.cpp/tools/llama-bench/llama-bench.cpp", "llama.cpp/LLAMA_CPP_COMMIT"} <= names
    assert not any(n.startswith("llama.cpp/tools/ui/") for n in names)
    assert (carry / "llama.cpp-src.tar.xz").stat().st_size < 24 * 2 ** 20
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "PIJ_CARRY": str(carry), "PIJ_WORK": str(work),
           "PIJ_LLAMA_CPP_BIN": str(_cpu_llama_bench()), "PIJ_THREADS": "1",
           "PIJ_CALIB_TOKENS": "256", "PIJ_ROUNDS": "1", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(GPU / "sparse_7b_check.sh"), "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    for name in ("build", "tests", "sanitizer"):
        assert steps[name]["status"] == "skipped" and "dry run" in steps[name]["note"]
    for name in ("llama", "generate", "bench"):
        assert steps[name]["status"] == "ok", steps[name]
    rows = [json.loads(l) for l in (out / "sparse_7b.jsonl").read_text().splitlines()]
    assert {r["system"] for r in rows} == {"llama.cpp", "powerinfer_jax"}
    for row in rows:
        assert "error" not in row, row
        if row["system"] == "llama.cpp":
            assert_llama_bench_row(row, repeats=row["config"]["repeats"],
                                   new_tokens=row["config"]["new_tokens"])
        else:
            assert_our_decode_row(row, repeats=row["config"]["repeats"],
                                  new_tokens=row["config"]["new_tokens"])
        assert row["dry_run"] is True and row["device"] == "cpu" and "synthetic" in row
        assert row["threads"] == 1 and row["budget_ffn_fraction"] == 0.25
        assert row["commit"] == (carry / "COMMIT").read_text().strip()
        assert row["model"]["sparsity"] == 0.9 and row["model"]["config"]["d_model"] == 128
    ours = next(r for r in rows if r["system"] == "powerinfer_jax")
    assert 0 < ours["hot_fraction"] < 1  # the budget placed some neurons hot, not all
    llama = next(r for r in rows if r["system"] == "llama.cpp")
    assert llama["ngl"] >= 1 and llama["bytes_device"] <= llama["budget_bytes"]
    # what comes back from the device tool: at most 8 files, every log in one archive
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "sparse_7b.jsonl",
                                                     "steps.jsonl", "summary.txt"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/generate.log", "logs/llama.log", "logs/bench.log"} <= set(tar.getnames())


def test_prepare_packs_a_portable_llama_build(tmp_path):
    """sparse_7b_prepare's --llama-bin: a build with every CPU level is packed stripped as
    llama-bin/, its cuBLAS folder (this machine's) dropped for the GPU image's; a build native
    to this CPU, or a folder that is no build, is refused with one line and nothing packed."""
    import shutil
    import tarfile

    from benchmarks.gpu import sparse_7b_prepare as prep

    exe = Path(shutil.which("true")).resolve()  # an ELF file that strip accepts
    build = tmp_path / "llama.cpp-cuda"
    build.mkdir()
    shutil.copy(exe, build / "llama-bench")
    shutil.copy(exe, build / "libggml-cuda.so")
    info = ["llama.cpp 0c1e57098bba43ac29e6e3b677cdceebdd22334f", "cuda_arch 90",
            "cpu all-variants", "cublas_lib /here/only"]
    (build / "BUILD_INFO").write_text("\n".join(info) + "\n")
    dest = tmp_path / "llama-bin.tar.xz"
    r = prep.write_llama_bin(build, dest)
    assert r["files"] == 3 and r["bytes_xz"] == dest.stat().st_size
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == ["llama-bin/BUILD_INFO", "llama-bin/libggml-cuda.so",
                                          "llama-bin/llama-bench"]
        packed = tar.extractfile("llama-bin/BUILD_INFO").read().decode().splitlines()
        assert tar.getmember("llama-bin/llama-bench").mode & 0o111  # still executable
    assert "cpu all-variants" in packed and "cublas_lib none" in packed
    assert "cublas_lib /here/only" not in packed
    dest.unlink()
    (build / "BUILD_INFO").write_text("cpu native\n")
    with pytest.raises(SystemExit, match="every CPU level.*cpu native"):
        prep.write_llama_bin(build, dest)
    (build / "BUILD_INFO").unlink()
    with pytest.raises(SystemExit, match="BUILD_INFO"):
        prep.write_llama_bin(build, dest)
    assert not dest.exists()


@pytest.mark.slow
@pytest.mark.skipif(_cpu_llama_bench() is None,
                    reason="no CPU llama-bench ($PIJ_LLAMA_CPP_BIN or the peers' native build)")
def test_moe_check_dry_run(tmp_path):
    """The --moe check's pipeline on this CPU at a tiny shape: the synthetic MoE (F16) is
    generated from the carried tokenizer and text, its cold experts run from the host store (as
    on an accelerator), and our hot experts are timed against llama-bench
    -ngl all --n-cpu-moe N at the same budget, N > 0 (some experts left on the host), into
    moe.jsonl rows that say SYNTHETIC; no CUDA step runs and each says why. ~1 min."""
    from benchmarks.gpu import sparse_7b_prepare as prep

    carry = tmp_path / "carry"
    prep.main(["--out", str(carry), "--no-wheels", "--no-llama-cpp", "--no-llama-bin",
               "--calib-bytes", "60000"])
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PIJ_CARRY": str(carry), "PIJ_WORK": str(tmp_path / "w"),
           "PIJ_LLAMA_BIN": str(_cpu_llama_bench()), "PIJ_THREADS": "1", "PIJ_ROUNDS": "1",
           "PIJ_MOE_CALIB_TOKENS": "512", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(GPU / "sparse_7b_check.sh"), "--moe", "--dry-run"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = {s["step"]: s for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    for name in ("build", "tests", "sanitizer", "llama"):
        assert steps[name]["status"] == "skipped", steps[name]
    for name in ("generate", "bench"):
        assert steps[name]["status"] == "ok", steps[name]
    rows = [json.loads(l) for l in (out / "moe.jsonl").read_text().splitlines()]
    assert {r["system"] for r in rows} == {"llama.cpp", "powerinfer_jax"}
    for row in rows:
        assert "error" not in row, row
        if row["system"] == "llama.cpp":
            assert_llama_bench_row(row, repeats=row["config"]["repeats"],
                                   new_tokens=row["config"]["new_tokens"])
        else:
            assert_our_decode_row(row, repeats=row["config"]["repeats"],
                                  new_tokens=row["config"]["new_tokens"])
        assert row["experiment"] == "gpu_moe_check" and row["dry_run"] is True
        assert "routers" in row["synthetic"] and row["model"]["config"]["n_experts"] == 32
    llama = next(r for r in rows if r["system"] == "llama.cpp")
    assert llama["n_cpu_moe"] >= 1 and "--n-cpu-moe" in llama["command"]
    assert llama["bytes_device"] <= llama["budget_bytes"]
    ours = next(r for r in rows if r["system"] == "powerinfer_jax")
    assert 0 < ours["hot_fraction"] < 1 and ours["served_fraction"] > ours["hot_fraction"]
    # the F16 file's cold experts ran from the host store, the accelerator's path
    assert ours["model"]["qtype"] == "F16" and ours["host_store_layers"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "moe.jsonl", "steps.jsonl",
                                                     "summary.txt"]


def test_moe_bench_refuses_bad_input_in_one_line(tmp_path):
    """moe_bench: a budget outside (0, 1], a folder that is no generator output, and one whose
    GGUF is gone are named in one line before anything runs."""
    from benchmarks.gpu import moe_bench

    base = ["--llama-bin", str(tmp_path), "--device", "cpu", "--threads", "1",
            "--out", str(tmp_path / "rows.jsonl")]
    with pytest.raises(SystemExit, match=r"--budget: expected a fraction in \(0, 1\], got 1.5"):
        moe_bench.main(["--model-dir", str(tmp_path), "--budget", "1.5", *base])
    with pytest.raises(SystemExit, match="expected .*synthetic.json .*synthetic.moe"):
        moe_bench.main(["--model-dir", str(tmp_path), *base])
    (tmp_path / "synthetic.json").write_text(json.dumps({"file": str(tmp_path / "gone.gguf")}))
    with pytest.raises(SystemExit, match="expected the GGUF file of .*gone.gguf"):
        moe_bench.main(["--model-dir", str(tmp_path), *base])
    assert not (tmp_path / "rows.jsonl").exists()
