"""What the cache holds, and a size cap on what can be made again (least recently used first).

The cache directory (cache.cache_dir) holds three sorts of entries (`KINDS`):

* **rebuilt when missing, evicted under the cap**: compiled steps and model snapshots
  (`executables/<identity>/`), jax's compiled code (`xla/`), interleaved copies and neuron
  bundle files of models whose own folder was not writable (`interleaved/`, `neurons/`). A run
  that finds one gone builds it again (seconds to minutes); a run holding one open keeps reading
  it (an unlinked file lives until it is closed).
* **rebuilt when missing, removed only when asked** (`prune --kind sparsify`): the sparsify
  teacher's samples and top-k caches (`sparsify/`), which a training run reads for hours.
* **never removed**: downloaded models and the models, sparsity artifacts and checkpoints a
  user made (`models/`), and anything this module does not know (`other`): the tool lists them
  (they take space) and leaves them to the user. Files a user wrote with --out live where the
  user put them, outside the cache, and are never looked at.

The cap (`limit_bytes`: $POWERINFER_JAX_CACHE_LIMIT, "20G", "500M", "none"; DEFAULT_LIMIT
otherwise) bounds the first sort. `enforce` runs after each write of such an entry and removes
the least recently used ones (never those the calling process is using, `keep`, nor one whose
lock another process holds) until their total fits. Last use is the newest mtime of the entry's
files, refreshed by `mark_used` where an entry is read (a run that loads its compiled steps
writes nothing else).
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import time
from pathlib import Path

from powerinfer_jax import cache, errors

LIMIT_ENV = "POWERINFER_JAX_CACHE_LIMIT"
DEFAULT_LIMIT = 10 << 30  # 10 GiB: a 7B model's interleaved copy and bundle file, and snapshots
EVICTED = ("executables", "xla", "interleaved", "neurons")  # under the cap, LRU
ON_REQUEST = ("sparsify",)  # removed only by `prune --kind`
KINDS = EVICTED + ON_REQUEST + ("models", "other")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


@dataclasses.dataclass
class Entry:
    """One thing in the cache: a directory, or a file with its sidecars (record, lock)."""

    kind: str
    path: Path  # the entry (its sidecars beside it are part of it)
    size: int  # bytes, sidecars included
    last_used: float  # seconds since the epoch
    files: list[Path]  # what removing it deletes (a directory: itself)

    @property
    def evicted(self) -> bool:
        return self.kind in EVICTED

    def describe(self, root: Path) -> dict:
        return {"kind": self.kind, "path": str(_relative(self.path, root)), "bytes": self.size,
                "last_used": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.last_used)),
                "removal": ("evicted under the cap" if self.evicted else
                            "prune --kind " + self.kind if self.kind in ON_REQUEST else
                            "kept (delete by hand)")}


def parse_size(text: str, what: str = LIMIT_ENV) -> int | None:
    """"10G", "10GB", "10GiB", "500M", "1.5T", "123" (bytes) -> bytes (powers of 1024); "none",
    "off" or "unlimited" -> None (no cap)."""
    if str(text).strip().lower() in ("none", "off", "unlimited"):
        return None
    m = _SIZE.match(str(text))
    if not m:
        errors.fail(what, "a size such as 20G, 500M or 1073741824 (bytes), or none", text)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def limit_bytes() -> int | None:
    """The cap on the evicted kinds: $POWERINFER_JAX_CACHE_LIMIT, else DEFAULT_LIMIT."""
    value = os.environ.get(LIMIT_ENV)
    return DEFAULT_LIMIT if value is None or not value.strip() else parse_size(value)


# ------------------------------------------------------------------------------------------------
# Scanning
# ------------------------------------------------------------------------------------------------

def _relative(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def _stat_tree(path: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of a file or a directory tree; (0, 0) if gone."""
    size, newest = 0, 0.0
    try:
        if not path.is_dir() or path.is_symlink():
            st = path.lstat()
            return st.st_size, st.st_mtime
        newest = path.stat().st_mtime
        for dirpath, _, names in os.walk(path):
            for name in names:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                size += st.st_size
                newest = max(newest, st.st_mtime)
    except OSError:
        pass
    return size, newest


def _sidecars(path: Path) -> list[Path]:
    """A cached file's record and lock (cache.py), where they exist."""
    return [p for p in (cache.record_path(path), cache.lock_path(path)) if p.exists()]


def _file_entry(kind: str, path: Path, *, use_atime: bool = False) -> Entry:
    files = [path, *_sidecars(path)]
    size, newest = 0, 0.0
    for f in files:
        try:
            st = f.lstat()
        except OSError:
            continue
        size += st.st_size
        newest = max(newest, st.st_mtime, st.st_atime if use_atime else 0.0)
    return Entry(kind, path, size, newest, files)


def _dir_entry(kind: str, path: Path) -> Entry:
    size, newest = _stat_tree(path)
    return Entry(kind, path, size, newest, [path])


def _children(d: Path) -> list[Path]:
    try:
        return sorted(d.iterdir())
    except OSError:
        return []


def _is_sidecar_or_temp(name: str) -> bool:
    """cache.py's `.<name>.lock` / `.<name>.record.json` and temporary files: part of an entry
    (or a write in progress), never an entry of their own."""
    return name.startswith(".")


def scan(root: Path | None = None) -> list[Entry]:
    """Every entry of the cache at `root` (default: cache.cache_dir()), classified (KINDS)."""
    root = Path(root) if root is not None else cache.cache_dir()
    entries: list[Entry] = []
    for top in _children(root):
        name = top.name
        if name.startswith("."):
            continue  # the cache's own bookkeeping (locks of top-level entries)
        if name == "executables" and top.is_dir():
            entries += [_dir_entry("executables", d) for d in _children(top)
                        if d.is_dir() and not d.is_symlink() and not d.name.startswith(".")]
        elif name == "xla" and top.is_dir():
            entries += [_file_entry("xla", f, use_atime=True) for f in _children(top)
                        if f.is_file() and not f.is_symlink()]
        elif name in ("interleaved", "neurons") and top.is_dir():
            entries += [_file_entry(name, f) for f in _children(top)
                        if f.is_file() and not f.is_symlink()
                        and not _is_sidecar_or_temp(f.name)]
        elif name == "sparsify" and top.is_dir():
            entries += [(_dir_entry if p.is_dir() else _file_entry)("sparsify", p)
                        for p in _children(top) if not _is_sidecar_or_temp(p.name)]
        elif name == "models" and top.is_dir():
            entries += [(_dir_entry if p.is_dir() else _file_entry)("models", p)
                        for p in _children(top) if not _is_sidecar_or_temp(p.name)]
        else:
            entries.append((_dir_entry if top.is_dir() and not top.is_symlink()
                            else _file_entry)("other", top))
    return entries


# ------------------------------------------------------------------------------------------------
# Use and eviction
# ------------------------------------------------------------------------------------------------

def mark_used(path: Path) -> None:
    """Note that the cache entry at `path` (a directory, or a cached file) was just used, for
    the LRU order: a directory's own mtime, a file's record's or lock's (never the file's: its
    record keys on the file's mtime). Nothing for a path outside the cache (a user's folder).
    Best effort."""
    path = Path(path)
    try:
        if not path.resolve().is_relative_to(cache.cache_dir().resolve()):
            return
        if path.is_dir():
            os.utime(path)
            return
        for side in (cache.record_path(path), cache.lock_path(path)):
            if side.exists():
                os.utime(side)
                return
    except OSError:
        pass


def enforce_after_write(path: Path) -> None:
    """`enforce`, keeping `path`, where `path` (just written) is in the cache directory."""
    try:
        inside = Path(path).resolve().is_relative_to(cache.cache_dir().resolve())
    except OSError:
        return
    if inside:
        enforce(keep=[path])


def _try_lock_all(entry: Entry) -> list[int] | None:
    """Exclusive locks on every lock file of `entry` (cache.lock's), or None when another
    process holds one (the entry is being written or read: left alone)."""
    locks = [f for f in entry.files if f.name.endswith(".lock")]
    if entry.path.is_dir():
        locks += [p for p in _children(entry.path) if p.name.endswith(".lock")]
    fds = []
    for lock in locks:
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            for held in fds:
                os.close(held)
            return None
        fds.append(fd)
    return fds


def remove(entry: Entry) -> bool:
    """Delete `entry` (its files, or its directory); False when another process holds it."""
    fds = _try_lock_all(entry)
    if fds is None:
        return False
    try:
        for f in entry.files:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                try:
                    f.unlink()
                except FileNotFoundError:
                    pass
    finally:
        for fd in fds:
            os.close(fd)
    return True


def prune(max_bytes: int, *, kinds=EVICTED, keep=(), root: Path | None = None,
          dry_run: bool = False) -> list[Entry]:
    """Remove the least recently used entries of `kinds` until those left hold at most
    `max_bytes` (entries under `keep`, and ones another process holds, stay); returns those
    removed (with dry_run: those that would be)."""
    keep = [Path(k).resolve() for k in keep]
    entries = [e for e in scan(root) if e.kind in kinds]
    total = sum(e.size for e in entries)
    removed = []
    for e in sorted(entries, key=lambda e: e.last_used):
        if total <= max_bytes:
            break
        path = e.path.resolve()
        if any(path == k or k.is_relative_to(path) or path.is_relative_to(k) for k in keep):
            continue
        if dry_run or remove(e):
            total -= e.size
            removed.append(e)
    return removed


def enforce(keep=()) -> list[Entry]:
    """Hold the evicted kinds to the cap after a write (best effort: a scan or a removal that
    fails leaves the cache as it is); `keep`: the entries this process is using."""
    try:
        cap = limit_bytes()
    except errors.UserError:
        return []  # said in one line where the run started (check_limit)
    if cap is None:
        return []
    try:
        return prune(cap, keep=keep)
    except OSError:
        return []


def check_limit() -> None:
    """Refuse a malformed $POWERINFER_JAX_CACHE_LIMIT in one line (a run calls this early)."""
    limit_bytes()
