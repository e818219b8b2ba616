"""A GGUF's matrices interleaved by 16 (models/qweights.py: the matvec kernels' layout), kept in
a file beside the model, so that a later load reads them instead of making the copies again.

Why: a dense load arranges every matrix it reads whole (attention, the FFN, the LM head) into
fresh memory: on a 7B Q4_0 (3.9 GB) that was most of the 4.1 s build, first touches of 3.6 GB of
anonymous memory included, and the copies stay resident beside whatever of the file is. Read
from this file (`InterleavedFile.read`: a few threads, into anonymous memory, not the mapping:
the matvecs ran 24% slower over the mapping's 4 KiB pages), the load is a sequential read, and
the GGUF's pages of those matrices are never touched.

When: written after a build that found no usable file, for models whose interleaved bytes are at
least MIN_BYTES (smaller ones are kept whole by the model snapshot, runtime/snapshot.py, whose
start-up skips the build too); read whenever present. POWERINFER_JAX_INTERLEAVED_FILE=0 turns both
off (a read-only or small disk: the file is ~the size of the model).

Where: next to the model (`<model>.pij-interleaved`), or where that directory is not writable in
the cache directory (`interleaved/<fingerprint>-<model>.pij-interleaved`), as the neuron bundle
file (checkpoint/bundles.py) is placed.

Layout (little endian): magic b"PIJINTLV", format u32, header JSON bytes u32, the header JSON
(the model file's identity, per matrix its base format, block shape and offset from the data's
start, the first multiple of ALIGN after the header), then each matrix's interleaved blocks at a
multiple of ALIGN (a page: the model's arrays alias them).

A file is used only if its content record (powerinfer_jax.cache: size, mtime, sampled and full
sha256) checks out, its header parses and names this model file (size, mtime and
bundles.model_fingerprint: its header and sampled blocks) and this FORMAT, and every matrix lies
within it; otherwise one line says why and it is written again. Writes take the entry's lock and
go to a temporary name renamed into place, the record written under the same lock (readers take
it shared): two processes never interleave their bytes, and a reader never pairs a file with
another's record. As with the GGUF, a file truncated in place under a running model faults; one
replaced (renamed over it, as here) does not.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from powerinfer_jax import cache, cache_limit
from powerinfer_jax.checkpoint.base import aligned_empty
from powerinfer_jax.errors import UserError

FORMAT = 2  # bump when the layout or the interleaving changes (2: matrices in either layout)
INTERLEAVED, COLUMNS = "interleaved", "columns"  # the arrangements kept (models/qweights.py)
SUFFIX = ".pij-interleaved"
MAGIC = b"PIJINTLV"
ALIGN = 4096
ENV = "POWERINFER_JAX_INTERLEAVED_FILE"
# runtime/snapshot.MAX_BYTES (tests/test_checkpoint_interleaved_file.py checks they agree): below
# it the snapshot keeps the whole built model
MIN_BYTES = 512 << 20
_PREFIX = struct.Struct("<8sII")
_FREE_MARGIN = 1 << 30  # left free on the disk after the file
_READ_CHUNK = 64 << 20  # bytes per read job of `read`


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def model_key(path: Path) -> dict:
    """The model file's identity: size, mtime and fingerprint (header and sampled blocks)."""
    from powerinfer_jax.checkpoint.bundles import model_fingerprint  # lazy: start-up

    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "fingerprint": model_fingerprint(path)}


class InterleavedFile:
    """One model's interleaved copies: those in its file (`get`, `read`), and those a build made
    without it (`add`), written by `save`."""

    def __init__(self, model_path, *, note=cache.note):
        self.model = Path(model_path).resolve()
        self.key = model_key(self.model)
        self.note = note
        name = self.model.name + SUFFIX
        self.places = [self.model.parent / name,
                       cache.cache_dir() / "interleaved" / f"{self.key['fingerprint'][:16]}-{name}"]
        self.path: Path | None = None  # the file found
        self._tensors: dict = {}  # name -> header entry
        self._data = None  # np.memmap of self.path
        self._made: dict = {}  # name -> (blocks, base qtype)
        for path in self.places:
            if path.is_file() and self._open(path):
                break

    def _open(self, path: Path) -> bool:
        with cache.lock(path, shared=True):
            reason = cache.check_file(path)
            if reason is None:
                try:
                    self._data, self._tensors = _read(path, self.key)
                    self.path = path
                    cache_limit.mark_used(path)
                    return True
                except (OSError, ValueError, KeyError, TypeError) as e:
                    reason = f"unreadable ({type(e).__name__}: {e})"
        self.note(f"interleaved copy {path} is {reason}; writing it again")
        return False

    def get(self, name: str, t, layout: str = INTERLEAVED):
        """The arranged blocks of `t` (checkpoint.base.QuantTensor, canonical param `name`) in
        `layout` (INTERLEAVED, or COLUMNS: models/qweights.py) as the file holds them (a
        read-only view of its mapping), or None (not there, or of another layout, format or
        shape). `read` brings many into memory at once."""
        entry = self._tensors.get((name, layout))
        if entry is None or entry["qtype"] != t.qtype:
            return None
        rows, cols = t.stored_shape
        from powerinfer_jax.checkpoint import quants  # lazy: start-up

        shape = (rows, quants.columns_row_bytes(t.qtype, rows, cols) if layout == COLUMNS
                 else quants.row_bytes(t.qtype, cols))
        if tuple(entry["shape"]) != shape:
            return None
        at, n = entry["offset"], shape[0] * shape[1]
        return self._data[at:at + n].reshape(shape)

    def read(self, tensors: dict, threads: int | None = None, layout: str = INTERLEAVED) -> dict:
        """{name: the interleaved blocks of tensor t} for those of `tensors` ({name: t}) the file
        holds, read into the process's own (anonymous) memory by `threads` threads.

        Why a read and not the mapping itself: the mapped file's pages are 4 KiB pages, and the
        matvecs streaming them every token ran 24% slower than over anonymous memory, which
        numpy backs with huge pages (the SYNTHETIC 7B Q4_0 dense, 2 threads, 3 interleaved
        rounds: 5.4 vs 7.1 tok/s). Two threads read its 3.76 GB from the page cache in ~0.6 s,
        and the file's pages are not mapped, so they are not in the resident set either."""
        views = {name: v for name, t in tensors.items()
                 if (v := self.get(name, t, layout)) is not None}
        if not views:
            return {}
        out = {name: aligned_empty(v.shape, np.uint8) for name, v in views.items()}
        jobs = []  # (destination, file offset), 64 MiB at most each
        for name, v in views.items():
            flat = out[name].reshape(-1)
            at = self._tensors[(name, layout)]["offset"]
            for lo in range(0, flat.size, _READ_CHUNK):
                jobs.append((flat[lo:lo + _READ_CHUNK], at + lo))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            def job(j):
                dest, at = j
                view, done = memoryview(dest), 0
                while done < dest.size:  # preadv may return short
                    got = os.preadv(fd, [view[done:]], at + done)
                    if got <= 0:
                        raise OSError(errno.EIO, f"{self.path}: read ended at byte {at + done}")
                    done += got

            workers = threads or max(1, min(4, len(os.sched_getaffinity(0))))
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(job, jobs))
        finally:
            os.close(fd)
        return out

    def add(self, name: str, blocks, qtype: str, layout: str = INTERLEAVED) -> None:
        """Keep a copy the build made (blocks of base format `qtype` in `layout`) for `save`."""
        self._made[(name, layout)] = (blocks, qtype)

    def made_bytes(self) -> int:
        return sum(np.asarray(b).nbytes for b, _ in self._made.values())

    def save(self, min_bytes: int | None = None) -> Path | None:
        """Write the copies `add` kept, with those mapped from a file (a build in another mode
        arranged other matrices), when they are at least `min_bytes` (default MIN_BYTES): next
        to the model, else in the cache directory (a line says why a place was skipped).
        Returns where it was written, or None."""
        if not self._made or self.made_bytes() < (MIN_BYTES if min_bytes is None else min_bytes):
            return None
        kept = {key: (self._data[e["offset"]:e["offset"] + e["shape"][0] * e["shape"][1]]
                      .reshape(e["shape"]), e["qtype"]) for key, e in self._tensors.items()}
        self._made = {**kept, **self._made}
        for i, path in enumerate(self.places):
            try:
                with cache.lock(path, "the interleaved copy"):
                    if cache.check_file(path) is None:  # another process wrote it meanwhile
                        try:
                            if set(_read(path, self.key)[1]) >= set(self._made):
                                return path
                        except (OSError, ValueError, KeyError, TypeError):
                            pass
                    self._write(path)
                cache_limit.enforce_after_write(path)  # the cache's cap (cache_limit.py)
                return path
            except (OSError, UserError) as e:  # UserError: cache.lock's unwritable directory
                reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
                then = ("; trying the cache directory" if i + 1 < len(self.places)
                        else "; each load interleaves the model again")
                self.note(f"cannot write the interleaved copy in {path.parent}: {reason}{then}")
        return None

    def _write(self, dest: Path) -> None:
        index, offset = {}, 0
        for (name, layout), (blocks, qtype) in self._made.items():
            b = np.asarray(blocks)
            index[(name, layout)] = {"name": name, "layout": layout, "qtype": qtype,
                                     "shape": list(b.shape), "offset": offset}
            offset = _round_up(offset + b.nbytes, ALIGN)
        header = {"format": FORMAT, "model": self.key, "tensors": list(index.values())}
        text = json.dumps(header).encode()
        start = _round_up(_PREFIX.size + len(text), ALIGN)  # offsets count from here
        total = start + offset
        dest.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(dest.parent).free
        if free < total + _FREE_MARGIN:
            raise OSError(errno.ENOSPC, f"{total} bytes needed, {free} free")
        h = hashlib.sha256()
        with cache.atomic_file(dest) as tmp, open(tmp, "wb") as f:
            def write(b):
                f.write(b)
                h.update(b)

            write(_PREFIX.pack(MAGIC, FORMAT, len(text)) + text)
            pos = _PREFIX.size + len(text)
            for key, (blocks, _) in self._made.items():
                at = start + index[key]["offset"]
                write(b"\0" * (at - pos))
                data = np.ascontiguousarray(blocks).reshape(-1)
                write(memoryview(data))
                pos = at + data.nbytes
            write(b"\0" * (total - pos))
            f.flush()
            os.fsync(f.fileno())
        cache.write_record(dest, h.hexdigest())
        self.note(f"wrote the interleaved copy {dest} ({total / 2**30:.2f} GiB, once: later "
                  f"loads read it; {ENV}=0 turns it off)")


def _read(path: Path, key: dict) -> tuple[np.memmap, dict]:
    """(the file mapped read-only, its matrices' entries), or ValueError saying what is wrong."""
    with open(path, "rb") as f:
        magic, fmt, n = _PREFIX.unpack(f.read(_PREFIX.size))
        if magic != MAGIC:
            raise ValueError(f"expected the magic {MAGIC!r}, got {magic!r}")
        if fmt != FORMAT:
            raise ValueError(f"expected format {FORMAT}, got {fmt}")
        header = json.loads(f.read(n))
    start = _round_up(_PREFIX.size + n, ALIGN)
    if header.get("model") != key:
        raise ValueError("written for another model file (its size, mtime or contents differ)")
    data = np.memmap(path, np.uint8, "r")
    tensors = {}
    for e in header["tensors"]:
        name, layout = e["name"], e["layout"]
        if layout not in (INTERLEAVED, COLUMNS):
            raise ValueError(f"{name}: expected the layout {INTERLEAVED} or {COLUMNS}, got {layout}")
        rows, row_bytes = e["shape"]
        at = start + e["offset"]
        if at % ALIGN or at + rows * row_bytes > data.size:
            raise ValueError(f"{name} at byte {at} ({rows * row_bytes} bytes) does not lie "
                             f"within the file's {data.size} bytes")
        tensors[(name, layout)] = {**e, "offset": at}
    return data, tensors
