"""The engine's compiled steps kept across processes, loaded in the background at start-up.

jax's persistent compilation cache (`<cache>/xla`) skips XLA's compile, but finding an entry still
traces and lowers the step (SmolLM2's prefill and decode: ~1.7 s of a 3 s `generate` run, measured
on a 2-core EPYC). Here a compiled step is serialized as it is (`jax.experimental.
serialize_executable`) under `<cache>/executables/<identity>/<step>.exe` (the step's shape key and
cache length), and a later process loads it without tracing anything. Loading runs in XLA's threads without the GIL, so `Store.prefetch`
starts it while the model is still being built: the steps the last process with this identity
used (`used.json`) load beside the build, on another core.

Two keys keep a stale executable from running:
- the identity (`identity()`), known before the model is built: what the caller asked for (model
  file, configs, slots) and everything the compiled code depends on beyond the model's
  structure: this package's sources and compiled extension, jax and jaxlib, XLA_FLAGS, the CPU's
  instruction set, the threads;
- the structure (`structure_digest()`), checked once the model exists (or its snapshot is read):
  its module graph with every static attribute, its weights' shapes and dtypes, the cache's
  shape. A mismatch discards the loaded step and compiles it again (and replaces the file).
A file that does not load (truncated, from another version) is compiled again the same way. Only a
CPU-only process with one device and no placement uses the store (placed or sharded models hold
per-process handles and devices). `POWERINFER_JAX_XLA_CACHE=0` turns it off with jax's cache.
The cache's size cap (cache_limit.py) evicts whole identities, the least recently used first.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import pickle
import secrets
import threading
import time
from pathlib import Path

from powerinfer_jax import cache, cache_limit
from powerinfer_jax._machine import cpu_features
from powerinfer_jax.cache import cache_dir

FORMAT = 2  # bump when the file layout or the structure digest changes
_SUFFIX = ".exe"


def enabled() -> bool:
    return os.environ.get("POWERINFER_JAX_XLA_CACHE", "1") != "0"


def key_name(key: tuple) -> str:
    """('decode', 1, 128, 'greedy', 4) -> 'decode-1-128-greedy-4' (a file name)."""
    return "-".join(str(k) for k in key)


def _key_from_name(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("-"))


_DIGEST_MEMO = ".code-digests.json"  # in the store's root: file stats -> content digest
_DIGEST_MEMO_ENTRIES = 8  # checkouts (or venvs) sharing one cache, each with its own stats


def _code_files() -> tuple[Path, list[Path]]:
    """(the package's root, every source file of this package and its compiled extension)."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.rglob("*.py"))
    try:
        from powerinfer_jax.ops import _ffi  # lazy: optional C++ extension

        files.append(Path(_ffi._pij_ext.__file__))
    except (ImportError, AttributeError):
        pass
    return root, files


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """The contents of every source file of this package and of its compiled extension: an
    edited or rebuilt checkout never loads executables compiled from other code, while a
    re-install that rebuilt nothing (pip writes the same extension again, with a new mtime) or
    a fresh clone of the same commit loads them. Hashing ~4 MB at every start would cost
    ~10-20 ms, so the digest is memoized under the files' stats (name, size, mtime, inode):
    only a changed stat hashes the contents again."""
    root, files = _code_files()
    stats, named = [], []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        name = str(f.relative_to(root) if f.is_relative_to(root) else f)
        named.append((name, f))
        stats.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    key = hashlib.sha256(";".join(stats).encode()).hexdigest()
    memo_path = _root() / _DIGEST_MEMO
    memo = _read_memo(memo_path)
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    for name, f in named:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        h.update(f"{name}:{len(data)};".encode())
        h.update(data)
    digest = h.hexdigest()
    memo.pop(key, None)
    memo[key] = digest
    try:
        cache.write_text(memo_path, json.dumps(dict(list(memo.items())[-_DIGEST_MEMO_ENTRIES:])))
    except OSError:  # a read-only cache: hashed again next time
        pass
    return digest


def _read_memo(path: Path) -> dict:
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, str)}


def environment() -> dict:
    """What compiled code depends on besides the model: code, libraries, flags, CPU, threads."""
    import jax
    import jaxlib

    return {"format": FORMAT, "code": _code_digest(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "cpu": cpu_features(), "threads": len(os.sched_getaffinity(0)),
            "devices": [d.platform for d in jax.devices()]}


def identity(request: dict) -> str:
    """Digest of the caller's request (model file, configs, slots...) and the environment."""
    text = json.dumps({"request": request, "environment": environment()}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_digest(graphdef, leaves) -> str:
    """Digest of a model as jit sees it: its module graph with the static attributes, and the
    weights' shapes and dtypes (a model snapshot keeps it: runtime/snapshot.py)."""
    h = hashlib.sha256()
    h.update(repr(getattr(graphdef, "nodes", graphdef)).encode())
    h.update(repr(getattr(graphdef, "attributes", "")).encode())
    for a in leaves:
        h.update(f"{a.shape}{a.dtype};".encode())
    return h.hexdigest()


def structure_digest(model: str, extra) -> str:
    """Digest of what a step is compiled for: the model's (`model_digest`) and `extra` (the
    engine's cache shape)."""
    return hashlib.sha256(f"{model};{extra!r}".encode()).hexdigest()


def fresh_name(kind: str) -> str:
    """A step name no cache has seen. A step for the store must be compiled, not found: an
    executable jax loaded from its persistent cache (or got from its in-memory cache after such a
    load) serializes without its kernels' code (jaxlib 0.10: loading that blob fails at the first
    call with "Function ..._fusion not found"). jax keys both caches on the module, whose name
    is the function's, so a fresh name compiles fresh."""
    return f"{kind}_{secrets.token_hex(8)}"


@contextlib.contextmanager
def compiling_for_store():
    """A compile whose executable goes to the store: jax does not keep it in its persistent cache
    (under a fresh name it would never be found again), and the HLO's source locations hold the
    user's frame, not the whole Python traceback (metadata only: SmolLM2's decode step 1.24 ->
    1.01 MB, loaded in 0.12 s instead of 0.15; the same code and tokens)."""
    import jax

    global _saved_config
    with _config_lock:  # threads compiling at once (the server's warm-up beside its engine)
        if _compiling[0] == 0:
            _saved_config = (jax.config.jax_persistent_cache_min_compile_time_secs,
                             jax.config.jax_include_full_tracebacks_in_locations)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
            jax.config.update("jax_include_full_tracebacks_in_locations", False)
        _compiling[0] += 1
    try:
        yield
    finally:
        with _config_lock:
            _compiling[0] -= 1
            if _compiling[0] == 0:
                jax.config.update("jax_persistent_cache_min_compile_time_secs", _saved_config[0])
                jax.config.update("jax_include_full_tracebacks_in_locations", _saved_config[1])


_config_lock = threading.Lock()
_compiling = [0]  # compiles inside compiling_for_store now: the last one out restores
_saved_config: tuple = ()


def _root() -> Path:
    return cache_dir() / "executables"


class Store:
    """The serialized executables of one identity (see the module docstring)."""

    def __init__(self, ident: str, root: Path | None = None):
        self.identity = ident
        self.dir = (root or _root()) / ident
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._used: list[tuple] = []
        self.background_s = 0.0  # time the background loads took (beside the main thread)
        cache_limit.mark_used(self.dir)  # most recently used: the last the cap evicts

    # ------------------------------------------------------------------ reading
    def recent_keys(self) -> list[tuple]:
        """The steps the last process with this identity used, in the order it first used them."""
        try:
            names = json.loads((self.dir / "used.json").read_text())
            return [_key_from_name(n) for n in names if isinstance(n, str)]
        except (OSError, ValueError):
            return []

    def prefetch(self, keys=None) -> None:
        """Start loading `keys` (default: the recent ones) in a background thread, in order."""
        keys = [k for k in (self.recent_keys() if keys is None else keys)
                if k not in self._pending and (self.dir / (key_name(k) + _SUFFIX)).is_file()]
        if not keys:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pij-exe")
        for k in keys:
            self._pending[k] = self._pool.submit(self._timed_read, k)

    def _timed_read(self, key):
        t0 = time.perf_counter()
        try:
            return self._read(key)
        finally:
            self.background_s += time.perf_counter() - t0

    def _read(self, key):
        """(structure digest, executable) from the file of `key`, or None."""
        from jax.experimental import serialize_executable

        try:
            with open(self.dir / (key_name(key) + _SUFFIX), "rb") as f:
                fmt, structure, blob, in_tree, out_tree = pickle.load(f)
            if fmt != FORMAT:
                return None
            return structure, serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception:  # a truncated or foreign file: compiled again and replaced
            return None

    def has(self, key: tuple) -> bool:
        """Whether a file for `key` is stored (it may still fail to load, then it compiles)."""
        return key in self._pending or (self.dir / (key_name(key) + _SUFFIX)).is_file()

    def is_loading(self, key: tuple) -> bool:
        """Whether `key` was prefetched and not taken yet."""
        return key in self._pending

    def take(self, key: tuple, structure: str):
        """The executable of `key` for a model of `structure`, or None (then compile it)."""
        fut = self._pending.pop(key, None)
        got = fut.result() if fut is not None else self._read(key)
        if got is None or got[0] != structure:
            return None
        self._note_used(key)
        return got[1]

    # ------------------------------------------------------------------ writing
    def save(self, key: tuple, compiled, structure: str) -> None:
        """Serialize a freshly compiled step (best effort: a step jax cannot serialize, or an
        unwritable cache, only means the next process compiles it too)."""
        from jax.experimental import serialize_executable

        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            if b"\x7fELF" not in blob:  # no kernels' code in it (see fresh_name): never stored
                return
            data = pickle.dumps((FORMAT, structure, blob, in_tree, out_tree))
            self.dir.mkdir(parents=True, exist_ok=True)
            with cache.atomic_file(self.dir / (key_name(key) + _SUFFIX)) as tmp:
                tmp.write_bytes(data)
        except Exception:
            return
        self._note_used(key)
        cache_limit.enforce(keep=[self.dir])  # the cache's cap (cache_limit.py)

    def _note_used(self, key: tuple) -> None:
        """Remember the steps this process uses, for the next one's prefetch."""
        if key in self._used:
            return
        self._used.append(key)
        try:
            cache.write_text(self.dir / "used.json",
                             json.dumps([key_name(k) for k in self._used]))
        except OSError:
            pass
