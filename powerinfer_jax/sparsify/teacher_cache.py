"""The teacher's top-k log-probabilities per position, computed once per sequence and kept on disk.

A distillation run on 2 cores spends about a fifth of each step on the teacher's forward; every
pass over the corpus after the first, every resumed piece of a long run and every other run on the
same text (relu, drelu, another L1 schedule) repeats it. `TopKCache` keeps, for a pool of
sequences [n, T], the ids (uint16 when the vocabulary fits) and log-probabilities (float16) of
the teacher's k most likely next tokens at every position, in memory-mapped .npy files under
<cache>/sparsify/teacher-<key>/, filled on demand, a few sequences per teacher call, and marked
done per sequence only after its rows are flushed (a run killed mid-fill recomputes what was not
marked). k = 64 holds ~95% or more of SmolLM2's next-token mass on wiki text; the rest is one
outcome of the KL (forward.topk_kl). 128 bytes per token at k = 32, 256 at k = 64.

`CachedTargets` puts a BatchSource's batches together with their cached targets, so the step
sees {"tokens", "ids", "logp"}; which rows a step reads is still a pure function of the step.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer_jax.errors import fail

FILL_ROWS = 4  # sequences per teacher call when filling


def cache_key(teacher_id: str, pool_nt: np.ndarray, k: int, tag: str) -> str:
    """A key for one teacher (fingerprint id + how it is run: `tag`), pool and k."""
    h = hashlib.sha256(json.dumps(["topk-v1", teacher_id, int(k), tag,
                                   list(pool_nt.shape)]).encode())
    h.update(np.ascontiguousarray(pool_nt, np.int32).tobytes())
    return h.hexdigest()[:16]


class TopKCache:
    """Top-k teacher targets for the rows of `pool_nt` [n, T] int32 in `directory`.

    teacher_fn(tokens [b, T] int32) -> (ids [b, T, k], logp [b, T, k]) as numpy; called only for
    rows not yet on disk. `timer` (train.Timer) gets the teacher's time under "teacher"."""

    def __init__(self, directory: str | os.PathLike, pool_nt: np.ndarray, k: int,
                 teacher_fn: Callable, vocab_size: int, *, timer=None):
        self.directory = Path(directory)
        self.pool = np.asarray(pool_nt, np.int32)
        if self.pool.ndim != 2 or len(self.pool) == 0:
            fail("teacher cache pool", "a non-empty [n, seq_len] array", self.pool.shape)
        self.k, self.teacher_fn, self.timer = int(k), teacher_fn, timer
        n, t = self.pool.shape
        id_dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        self.directory.mkdir(parents=True, exist_ok=True)
        meta = {"rows": n, "seq_len": t, "k": self.k, "id_dtype": np.dtype(id_dtype).name}
        meta_path = self.directory / "meta.json"
        if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
            fail(f"teacher cache {self.directory}", f"files of {meta}",
                 json.loads(meta_path.read_text()), "delete the directory to rebuild it")
        self.ids = self._array("ids.npy", (n, t, self.k), id_dtype)
        self.logp = self._array("logp.npy", (n, t, self.k), np.float16)
        self.done = self._array("done.npy", (n,), np.bool_)
        meta_path.write_text(json.dumps(meta))

    def _array(self, name: str, shape, dtype) -> np.memmap:
        path = self.directory / name
        if path.is_file():
            arr = np.load(path, mmap_mode="r+")
            if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
                fail(f"teacher cache file {path}", f"{np.dtype(dtype).name} {tuple(shape)}",
                     f"{arr.dtype} {arr.shape}", "delete the directory to rebuild it")
            return arr
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))

    @property
    def filled(self) -> int:
        return int(np.count_nonzero(self.done))

    def fill(self, rows, progress: bool = False) -> None:
        """Compute and store the targets of `rows` that are not on disk yet, each teacher call
        topped up to FILL_ROWS with the next rows not yet done (a run needs them all in time;
        a padded call would compute rows only to drop them)."""
        todo = sorted({int(r) for r in rows if not self.done[int(r)]})
        if todo and len(todo) % FILL_ROWS:
            more = [int(r) for r in np.flatnonzero(~np.asarray(self.done)) if int(r) not in todo]
            todo += more[:FILL_ROWS - len(todo) % FILL_ROWS]
        groups = [todo[i:i + FILL_ROWS] for i in range(0, len(todo), FILL_ROWS)]
        if progress and groups:
            from tqdm import tqdm

            groups = tqdm(groups, desc="teacher top-k", unit="batch")
        for g in groups:
            t0 = time.perf_counter()
            tokens = self.pool[g + [g[-1]] * (FILL_ROWS - len(g))]  # one shape: one compile
            ids, logp = self.teacher_fn(tokens)
            self.ids[g] = np.asarray(ids)[:len(g)].astype(self.ids.dtype)
            self.logp[g] = np.asarray(logp)[:len(g)].astype(np.float16)
            self.ids.flush()
            self.logp.flush()
            self.done[g] = True
            self.done.flush()
            if self.timer is not None:
                self.timer.add("teacher", time.perf_counter() - t0)

    def get(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """(ids [b, T, k], logp [b, T, k] float16) of `rows`, filled first where missing."""
        rows = [int(r) for r in rows]
        self.fill(rows)
        return np.asarray(self.ids[rows]), np.asarray(self.logp[rows])


class CachedTargets:
    """Batches of a data.BatchSource with their cached teacher targets: step -> {"tokens",
    "ids", "logp"}. corpus_cache/sample_cache cover the source's corpus chunks and samples."""

    def __init__(self, source, corpus_cache: TopKCache, sample_cache: TopKCache | None):
        self.source, self.corpus_cache, self.sample_cache = source, corpus_cache, sample_cache

    def __call__(self, step: int) -> dict:
        c_rows, s_rows = self.source.indices(step)
        ids, logp = self.corpus_cache.get(c_rows)
        if s_rows:
            s_ids, s_logp = self.sample_cache.get(s_rows)
            ids, logp = np.concatenate([ids, s_ids]), np.concatenate([logp, s_logp])
        return {"tokens": self.source(step), "ids": ids, "logp": logp}
