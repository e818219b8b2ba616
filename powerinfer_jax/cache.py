"""Cache entries that cannot go bad: locked builds, atomic writes, verified reuse.

Every file or directory the project caches (the registry's GGUF, sparsity artifacts, the default
corpus, the placement cache) goes through this module:

* **Lock.** `lock(dest)` takes an exclusive `fcntl.flock` on the sibling `.<name>.lock`, so two
  processes building the same entry serialize: the second waits, then finds the first's result
  and reuses it. The lock is reentrant within a process (a builder that saves under the lock it
  already holds does not deadlock) and released by the kernel if the process dies.
* **Atomic writes.** `atomic_file(dest)` / `atomic_dir(dest)` yield a unique temporary path in the
  same directory and rename it onto `dest` only when the block finishes without an exception: a
  reader sees the old entry or the complete new one, never a half-written one, and an interrupted
  build leaves no debris where the entry belongs. A writer killed outright (kill -9, power off)
  leaves its temporary behind; the next write of the same entry deletes it (`sweep_debris`).
* **Verified reuse.** `write_record(dest)` stores, at write time, the size, mtime, sha256 of the
  file's header and a sample of its blocks, and its full sha256 (`.<name>.record.json`; for a
  directory `record.json` inside it, one record per file). `check_file` / `check_dir` compare
  cheaply (size + mtime + sample hash) and hash the whole file only when the mtime changed. A
  mismatch is returned as a one-line reason, and the caller treats the entry as stale: rebuild
  or re-fetch with a message, never a crash and never silent reuse of bad bytes.

Limit (stated, not hidden): a file rewritten in place with its size *and* mtime restored is only
caught where the sample reads (the header and 64 blocks spread over the file; files up to
FULL_HASH_LIMIT are sampled whole).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import sys
import threading
from pathlib import Path
from typing import Iterator

from powerinfer_jax import errors

RECORD_VERSION = 1
DIR_RECORD = "record.json"
FULL_HASH_LIMIT = 1 << 20  # files up to 1 MiB are "sampled" whole
HEADER_BYTES = 256 << 10  # a GGUF's header (metadata, tokenizer) is what breaks it first
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 4 << 10
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """$POWERINFER_JAX_CACHE, else $XDG_CACHE_HOME/powerinfer_jax, else ~/.cache/powerinfer_jax."""
    if os.environ.get("POWERINFER_JAX_CACHE"):
        return Path(os.environ["POWERINFER_JAX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "powerinfer_jax"
    return Path.home() / ".cache" / "powerinfer_jax"


def note(msg: str) -> None:
    """One line on stderr about what the cache is doing (waiting, rebuilding, re-fetching)."""
    print(f"powerinfer_jax: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Locks
# ------------------------------------------------------------------------------------------------

_held: dict[str, int] = {}  # lock file -> depth, for reentrancy within this process
_held_guard = threading.Lock()
_thread_locks: dict[str, threading.RLock] = {}  # flock does not exclude threads of one process


def lock_path(dest: Path) -> Path:
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.lock")


@contextlib.contextmanager
def lock(dest: Path, what: str | None = None, *, shared: bool = False) -> Iterator[None]:
    """Hold the lock of cache entry `dest` (file or directory, existing or not): exclusive for
    writers, `shared` for readers of an entry that is more than one file (so they never read
    half of an old and half of a new one). Within a process the lock is reentrant; a nested
    request keeps the mode of the outer one (take the exclusive lock first, not second)."""
    path = lock_path(dest)
    key = str(path.parent.resolve() / path.name)
    with _held_guard:
        rlock = _thread_locks.setdefault(key, threading.RLock())
    with rlock:
        with _held_guard:
            depth = _held.get(key, 0)
            _held[key] = depth + 1
        try:
            if depth:
                yield
                return
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # flock needs no write access: a reader opens another user's lock read-only
                flags = os.O_RDONLY if shared and path.exists() else os.O_RDWR | os.O_CREAT
                fd = os.open(path, flags, 0o644)
            except OSError as e:
                if shared:  # a read-only cache: nobody can be writing it, read without the lock
                    yield
                    return
                raise errors.UserError(
                    f"cache lock {path}: expected a writable cache directory, got "
                    f"{type(e).__name__}: {e} (set POWERINFER_JAX_CACHE to a writable "
                    "directory)") from None
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except BlockingIOError:
                    note(f"waiting for another process using {what or Path(dest).name} "
                         f"(lock {path})")
                    fcntl.flock(fd, mode)  # EINTR is retried; Ctrl-C still interrupts
                yield
            finally:
                os.close(fd)  # releases the flock
        finally:
            with _held_guard:
                _held[key] -= 1
                if not _held[key]:
                    del _held[key]


# ------------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------------

def _temp_name(dest: Path, suffix: str) -> Path:
    return dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")


def sweep_debris(dest: Path) -> int:
    """Delete what a killed writer of `dest` left: its temporary file or directory
    (`.<name>.<pid>.<8 hex>.tmp` / `.old`) whose process no longer runs. Only those exact
    names, never anything else; a live writer's temporary stays (the cache is assumed local to
    this machine, as its flock locks are). Returns how many were deleted."""
    dest = Path(dest)
    prefix = f".{dest.name}."
    swept = 0
    try:
        names = [n for n in os.listdir(dest.parent) if n.startswith(prefix)]
    except OSError:
        return 0
    for name in names:
        pid, _, rest = name[len(prefix):].partition(".")
        token, _, suffix = rest.partition(".")
        if not (pid.isdigit() and len(token) == 8 and suffix in ("tmp", "old")
                and all(c in "0123456789abcdef" for c in token)) or _alive(int(pid)):
            continue
        path = dest.parent / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            swept += 1
        except OSError:
            pass
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


@contextlib.contextmanager
def atomic_file(dest: Path) -> Iterator[Path]:
    """Yield a fresh temporary path next to `dest`; on success it is renamed onto `dest`. The
    file gets the usual permissions (0666 less the umask), not mkstemp's private 0600, so a
    cache shared between users stays readable."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep_debris(dest)
    while True:
        tmp = _temp_name(dest, ".tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(dest: Path, text: str) -> None:
    with atomic_file(dest) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a fresh empty directory next to `dest`; on success it replaces `dest` (an existing
    `dest` is moved aside first and deleted after). Hold `lock(dest)` around it: the swap is two
    renames, atomic for readers that verify what they read, not for two concurrent writers."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep_debris(dest)
    tmp = _make_dir(dest, ".tmp")
    old = None
    try:
        yield tmp
        if dest.exists() or dest.is_symlink():
            old = _make_dir(dest, ".old")
            os.replace(dest, old / "entry")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _make_dir(dest: Path, suffix: str) -> Path:
    while True:
        path = _temp_name(dest, suffix)
        try:
            path.mkdir(0o777)  # less the umask, as any directory (mkdtemp's would be 0700)
            return path
        except FileExistsError:
            continue


# ------------------------------------------------------------------------------------------------
# Records and verification
# ------------------------------------------------------------------------------------------------

def record_path(dest: Path) -> Path:
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.record.json")


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    if size <= FULL_HASH_LIMIT:
        return [(0, size)]
    spans = [(0, HEADER_BYTES)]
    step = (size - HEADER_BYTES) // SAMPLE_BLOCKS
    spans += [(HEADER_BYTES + k * step, SAMPLE_BLOCK_BYTES) for k in range(SAMPLE_BLOCKS)]
    spans.append((size - SAMPLE_BLOCK_BYTES, SAMPLE_BLOCK_BYTES))
    return spans


def sample_sha256(path: Path, size: int) -> str:
    """sha256 of the header and SAMPLE_BLOCKS blocks spread over the file (all of a small one)."""
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        for offset, length in _sample_offsets(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path, sha256: str | None = None) -> dict:
    """The record of `path` now (pass `sha256` when it was computed while writing)."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": sample_sha256(path, st.st_size),
            "sha256": sha256 or full_sha256(path)}


def write_record(dest: Path, sha256: str | None = None) -> dict:
    """Record file `dest` (beside it) as it is now."""
    rec = {"version": RECORD_VERSION, **file_record(dest, sha256)}
    write_text(record_path(dest), json.dumps(rec))
    return rec


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _valid_record(rec) -> bool:
    return (isinstance(rec, dict) and isinstance(rec.get("size"), int)
            and isinstance(rec.get("mtime_ns"), int)
            and all(isinstance(rec.get(k), str) and len(rec[k]) == 64
                    for k in ("sample_sha256", "sha256")))


def _compare(path: Path, rec: dict) -> tuple[str | None, bool]:
    """(reason the file no longer matches `rec` or None, whether the record's mtime is stale)."""
    try:
        st = os.stat(path)
    except OSError:
        return "missing", False
    if st.st_size != rec["size"]:
        return f"of size {st.st_size}, recorded {rec['size']} (truncated or replaced)", False
    if st.st_mtime_ns == rec["mtime_ns"]:
        if sample_sha256(path, st.st_size) != rec["sample_sha256"]:
            return "changed since it was written (sample hash mismatch)", False
        return None, False
    if full_sha256(path) != rec["sha256"]:
        return "changed since it was written (sha256 mismatch)", False
    return None, True  # touched but identical


def check_file(dest: Path, *, sha256: str | None = None) -> str | None:
    """None when `dest` is the file recorded at write time (and has sha256 `sha256` if given);
    else why not ("missing", "changed since ...", ...). Without a record (an entry from before
    records existed) the file is accepted only against `sha256`, and then recorded."""
    dest = Path(dest)
    if not dest.is_file():
        return "missing"
    rec = _read_json(record_path(dest))
    if not _valid_record(rec) or rec.get("version") != RECORD_VERSION:
        if sha256 is None:
            return "without a record of its contents (written by an older version or by hand)"
        actual = full_sha256(dest)
        if actual != sha256:
            return f"of sha256 {actual[:16]}..., expected {sha256[:16]}... (corrupt)"
        _try_write_record(dest, actual)
        return None
    if sha256 is not None and rec["sha256"] != sha256:
        return f"recorded with sha256 {rec['sha256'][:16]}..., expected {sha256[:16]}..."
    reason, refresh = _compare(dest, rec)
    if refresh:
        _try_write_record(dest, rec["sha256"])
    return reason


def _try_write_record(dest: Path, sha256: str) -> None:
    """Record a verified file; in a read-only cache it just stays unrecorded (checked again)."""
    try:
        write_record(dest, sha256)
    except OSError:
        pass


def write_dir_record(directory: Path) -> dict:
    """Record every file under `directory` (inside it, as DIR_RECORD)."""
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != DIR_RECORD:
            files[p.relative_to(directory).as_posix()] = file_record(p)
    rec = {"version": RECORD_VERSION, "files": files}
    write_text(directory / DIR_RECORD, json.dumps(rec, indent=0))
    return rec


def has_dir_record(directory: Path) -> bool:
    return (Path(directory) / DIR_RECORD).is_file()


def check_dir(directory: Path) -> str | None:
    """None when every file recorded in `directory`'s DIR_RECORD is unchanged; else why not."""
    directory = Path(directory)
    rec = _read_json(directory / DIR_RECORD)
    if not (isinstance(rec, dict) and rec.get("version") == RECORD_VERSION
            and isinstance(rec.get("files"), dict)):
        return f"{directory / DIR_RECORD} is missing or unreadable"
    for name, frec in rec["files"].items():
        if not isinstance(name, str) or not _valid_record(frec) or ".." in Path(name).parts:
            return f"{directory / DIR_RECORD} has a malformed entry {name!r}"
        reason, _ = _compare(directory / name, frec)
        if reason is not None:
            return f"{directory / name} is {reason}"
    return None


if __name__ == "__main__":  # python -m powerinfer_jax.cache {list,size,prune}: cache_cli.py
    from powerinfer_jax import cache_cli  # lazy: the command, run only as __main__

    cache_cli.run()
