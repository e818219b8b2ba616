"""The cache's size cap and its command (cache_limit.py, `python -m powerinfer_jax.cache`),
on tiny fake entries in a temporary cache: it stays under its cap however many entries are
written, evicts the least recently used first, never what this process uses, one another
process holds, a downloaded or user-made model, nor anything it does not know."""
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from powerinfer_jax import cache, cache_cli, cache_limit
from powerinfer_jax.errors import UserError

REPO = Path(__file__).resolve().parents[1]
KB = 1024


@pytest.fixture
def root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("POWERINFER_JAX_CACHE", str(root))
    monkeypatch.delenv(cache_limit.LIMIT_ENV, raising=False)
    return root


def _write(path: Path, size: int, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    t = 1_700_000_000 - age_s
    os.utime(path, (t, t))
    return path


def _identity(root: Path, name: str, size: int, age_s: float) -> Path:
    """An executables identity: a step and a snapshot with its record and lock."""
    d = root / "executables" / name
    _write(d / "decode-1-128-greedy-4-128.exe", size // 2, age_s)
    _write(d / "model.snapshot", size - size // 2, age_s)
    _write(d / ".model.snapshot.lock", 0, age_s)
    os.utime(d, (1_700_000_000 - age_s,) * 2)
    return d


def _user_things(root: Path) -> list[Path]:
    """What is never evicted: a download, a model the user made, an unknown folder."""
    return [_write(root / "models" / "smollm2-135m" / "model.gguf", 50 * KB, 10 ** 6),
            _write(root / "models" / "smollm2-135m-sparse-relu-0.9" / "model.gguf", 50 * KB,
                   10 ** 6),
            _write(root / "peers" / "llama" / "bin" / "llama-bench", 50 * KB, 10 ** 6)]


def _evicted_bytes(root: Path) -> int:
    return sum(e.size for e in cache_limit.scan(root) if e.evicted)


@pytest.mark.parametrize("text,value", [("10G", 10 << 30), ("10GiB", 10 << 30), ("500m", 500 << 20),
                                        ("1.5k", 1536), ("123", 123), ("none", None)])
def test_sizes(text, value):
    assert cache_limit.parse_size(text) == value


def test_a_malformed_cap_is_one_line(root, monkeypatch):
    monkeypatch.setenv(cache_limit.LIMIT_ENV, "ten gigs")
    with pytest.raises(UserError, match=r"^POWERINFER_JAX_CACHE_LIMIT: expected a size such as "
                       r"20G, 500M or 1073741824 \(bytes\), or none, got 'ten gigs'$"):
        cache_limit.check_limit()
    assert cache_limit.enforce() == []  # a write never fails over it


def test_the_cache_stays_under_its_cap_after_many_distinct_entries(root, monkeypatch):
    """60 identities of 10 KiB, each followed by enforce (as Store.save and snapshot.save do),
    under a 100 KiB cap: after every write the evicted kinds hold at most the cap, the newest
    entries are the ones left, and the user's things are all still there."""
    monkeypatch.setenv(cache_limit.LIMIT_ENV, "100K")
    mine = _user_things(root)
    for i in range(60):
        d = _identity(root, f"{i:032x}", 10 * KB, age_s=1000 - i)
        _write(root / "xla" / f"jit_step-{i:064x}-cache", KB, age_s=1000 - i)
        cache_limit.enforce(keep=[d])
        assert _evicted_bytes(root) <= 100 * KB
        assert d.is_dir()  # the entry just written stays
    left = sorted(p.name for p in (root / "executables").iterdir())
    assert left == [f"{i:032x}" for i in range(60 - len(left), 60)]  # the most recent ones
    assert len(left) == 9  # 9 x 10 KiB and the newest xla files fit in 100 KiB, 10 do not
    assert all(p.is_file() for p in mine)


def test_least_recently_used_goes_first_and_use_is_noted(root, monkeypatch):
    old = _identity(root, "a" * 32, 10 * KB, age_s=300)
    mid = _identity(root, "b" * 32, 10 * KB, age_s=200)
    new = _identity(root, "c" * 32, 10 * KB, age_s=100)
    cache_limit.mark_used(old)  # loaded by a run just now: the most recent
    removed = cache_limit.prune(20 * KB, root=root)
    assert [e.path for e in removed] == [mid]
    assert old.is_dir() and new.is_dir()


def test_an_entry_another_process_holds_is_left_alone(root):
    held = _identity(root, "a" * 32, 10 * KB, age_s=300)
    other = _identity(root, "b" * 32, 10 * KB, age_s=200)
    fd = os.open(held / ".model.snapshot.lock", os.O_RDWR)  # as cache.lock holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        removed = cache_limit.prune(0, root=root)
    finally:
        os.close(fd)
    assert [e.path for e in removed] == [other] and held.is_dir()


def test_cached_files_go_with_their_record_and_lock(root):
    f = _write(root / "interleaved" / ("0" * 16 + "-m.gguf.pij-interleaved"), 10 * KB, 100)
    rec = _write(cache.record_path(f), 100, 100)
    lock = _write(cache.lock_path(f), 0, 100)
    temp = _write(f.with_name(f".{f.name}.123.abcd.tmp"), 10, 100)  # a write in progress
    (entry,) = cache_limit.scan(root)
    assert entry.kind == "interleaved" and entry.size == 10 * KB + 100
    assert cache_limit.prune(0, root=root) == [entry]
    assert not f.exists() and not rec.exists() and not lock.exists() and temp.exists()


def test_sparsify_caches_go_only_when_asked(root):
    s = _write(root / "sparsify" / "samples-0123456789abcdef.npy", 10 * KB, 100)
    assert cache_limit.prune(0, root=root) == [] and s.exists()
    assert [e.path for e in cache_limit.prune(0, kinds=("sparsify",), root=root)] == [s]


def test_the_command_lists_sizes_and_prunes(root, capsys):
    mine = _user_things(root)
    a = _identity(root, "a" * 32, 10 * KB, age_s=300)
    b = _identity(root, "b" * 32, 10 * KB, age_s=200)
    cache_cli.main(["size", "--json"])
    size = json.loads(capsys.readouterr().out)
    assert size["bytes"]["executables"] == 20 * KB and size["bytes"]["models"] == 100 * KB
    assert size["bytes"]["other"] == 50 * KB and size["limit_bytes"] == cache_limit.DEFAULT_LIMIT
    cache_cli.main(["list", "--json"])
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert {r["path"]: r["removal"] for r in rows} == {
        "models/smollm2-135m": "kept (delete by hand)",
        "models/smollm2-135m-sparse-relu-0.9": "kept (delete by hand)",
        "peers": "kept (delete by hand)",
        f"executables/{'a' * 32}": "evicted under the cap",
        f"executables/{'b' * 32}": "evicted under the cap"}
    cache_cli.main(["prune", "--max-size", "15K", "--dry-run", "--json"])
    dry = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in dry["removed"]] == [f"executables/{'a' * 32}"] and a.is_dir()
    cache_cli.main(["prune", "--max-size", "0"])
    assert "removed 2 entries, 20.0 KiB" in capsys.readouterr().out
    assert not a.exists() and not b.exists() and all(p.is_file() for p in mine)
    with pytest.raises(UserError, match=r"^--max-size: expected a size such as 20G"):
        cache_cli.main(["prune", "--max-size", "lots"])


def test_python_m_powerinfer_jax_cache_runs(root):
    _identity(root, "a" * 32, 10 * KB, age_s=300)
    env = {**os.environ, "POWERINFER_JAX_CACHE": str(root)}
    out = subprocess.run([sys.executable, "-m", "powerinfer_jax.cache", "size", "--json"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["bytes"]["executables"] == 10 * KB
    bad = subprocess.run([sys.executable, "-m", "powerinfer_jax.cache", "prune", "--max-size",
                          "x"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --max-size: expected a size")
    assert "Traceback" not in bad.stderr and "RuntimeWarning" not in bad.stderr
