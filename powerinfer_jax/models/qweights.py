"""Weights kept in a GGUF block format inside the model (issue 14: the user's file, computed on
as it is stored).

A quantized matrix keeps its nnx.Param as the file's blocks, uint8 [rows, row_bytes], and its
format and width as static module attributes (`qtype`, `d_in`); ops.qlinear and ops.qsparse_ffn
compute on the blocks with 8-bit activations, as llama.cpp does. The token embedding is looked up
by dequantizing only the gathered rows. checkpoint.base.QuantTensor is what the loader hands over.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
_BLOCK = 32


def _f16(b, start: int):
    """The little-endian f16 at byte `start` of every block [..., nb, bytes] -> float32 [..., nb]."""
    bits = b[..., start].astype(jnp.uint16) | (b[..., start + 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(F32)


def _nibbles(q):
    """uint8 [..., 16] -> float32 [..., 32]: the 16 low nibbles, then the 16 high ones."""
    return jnp.concatenate([q & 0x0F, q >> 4], axis=-1).astype(F32)


def _q8_0(b):
    return _f16(b, 0)[..., None] * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(F32)


def _q4_0(b):
    return _f16(b, 0)[..., None] * (_nibbles(b[..., 2:]) - 8.0)


def _q4_1(b):
    return _f16(b, 0)[..., None] * _nibbles(b[..., 4:]) + _f16(b, 2)[..., None]


# format -> (bytes per 32-value block, jnp dequantizer of [..., n_blocks, bytes])
_JNP = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}


def dequantize_rows(blocks, qtype: str, dim: int):
    """uint8 [..., row_bytes] rows in `qtype` -> float32 [..., dim]: in jnp for the common
    embedding formats, else through the gguf package's dequantizer on the host (any format)."""
    if qtype in _JNP:
        nbytes, fn = _JNP[qtype]
        b = blocks.reshape(blocks.shape[:-1] + (blocks.shape[-1] // nbytes, nbytes))
        return fn(b).reshape(blocks.shape[:-1] + (-1,))[..., :dim]
    from powerinfer_jax.ops.reference import dequantize_blocks

    flat = blocks.reshape(-1, blocks.shape[-1])
    return dequantize_blocks(flat, qtype, dim).reshape(blocks.shape[:-1] + (dim,))


def host_blocks(blocks) -> jax.Array:
    """Blocks (uint8 [rows, row_bytes]) as the model's array. XLA's CPU client keeps a 64-byte
    aligned host array as it is instead of copying it, so a loaded file's bytes are in memory
    once, not twice (SmolLM2's Q4_1: ~0.05 s less load and ~98 MB less resident). The numpy
    array is made read-only: the model's weights now live in it."""
    from powerinfer_jax.checkpoint.base import aligned

    host = aligned(np.asarray(blocks, np.uint8))
    host.flags.writeable = False
    return jax.device_put(host, may_alias=True)


class _Load:
    """One model's load (`batched_load`): the file views whose pages leave the resident set at
    the end, and the interleaved copies made ahead on the pool while Python builds the model."""

    def __init__(self):
        self.pending: list = []
        self._ahead: dict[int, tuple] = {}  # id(file blocks) -> (file blocks, copy, its qtype)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stats = {"ahead": 0, "claimed": 0}

    def interleave_ahead(self, tensors) -> None:
        """Start interleaving (blocks, qtype) pairs on the pool in one call that holds no GIL
        (`_pij_ext.interleave_many`); `interleaved` hands each copy out when asked for it.
        Without quantized tensors it imports nothing: a float model builds without the compiled
        extension (the GPU burst, sparsify/burst.py)."""
        self.finish()  # one batch on the pool at a time
        jobs = []
        for blocks, qtype in tensors:
            job = _interleave_job(blocks, qtype) if id(blocks) not in self._ahead else None
            if job is not None:
                self._ahead[id(blocks)] = (blocks, job[2], job[3])
                jobs.append(job[:3])
        if not jobs:
            return
        from powerinfer_jax.ops import _ffi

        self.stats["ahead"] += len(jobs)

        def run():
            try:
                _ffi._pij_ext.interleave_many(jobs)
            except BaseException as e:  # re-raised where a copy is taken
                self._error = e

        self._thread = threading.Thread(target=run, name="pij-interleave", daemon=True)
        self._thread.start()

    def take(self, blocks):
        """(copy, qtype) made ahead for `blocks` (waiting for the pool), or None."""
        entry = self._ahead.get(id(blocks))
        if entry is None or entry[0] is not blocks:
            return None
        del self._ahead[id(blocks)]
        self.finish()
        self.stats["claimed"] += 1
        self.pending.append(blocks)  # the file's rows were read once to build the copy
        return entry[1], entry[2]

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_LOAD: contextvars.ContextVar[_Load | None] = contextvars.ContextVar("batched_load", default=None)


@contextlib.contextmanager
def batched_load():
    """One model's load: yields the `_Load` whose `interleave_ahead` starts the copies early;
    within it `interleaved` takes those copies and keeps the file rows it read, dropping their
    pages from the resident set once at the end (one read of the process's mappings for a whole
    model; the arrays stay alive until then, so their mappings do too)."""
    from powerinfer_jax.checkpoint.gguf_file import release_mapped_pages

    load = _Load()
    token = _LOAD.set(load)
    try:
        yield load
        load.finish()
    finally:
        _LOAD.reset(token)
        if load._thread is not None:  # an error left the pool writing: wait for it
            load._thread.join()
        release_mapped_pages(*load.pending)


def release_later(array) -> None:
    """Drop a file view's pages from the resident set (gguf_file.release_mapped_pages): now, or
    at the end of the enclosing `batched_load`."""
    from powerinfer_jax.checkpoint.gguf_file import release_mapped_pages

    load = _LOAD.get()
    if load is None:
        release_mapped_pages(array)
    else:
        load.pending.append(array)


def interleaved(blocks, qtype: str):
    """(blocks, qtype) with the rows interleaved by 16 where the format and row count allow
    (checkpoint.quants.interleave: ops.qlinear's fastest layout, the same bytes rearranged; the
    type becomes e.g. "Q4_0x16"), else as given. Within `batched_load`, a copy started by
    `interleave_ahead` is taken, not made again."""
    load = _LOAD.get()
    ready = load.take(blocks) if load is not None else None
    if ready is not None:
        return ready
    job = _interleave_job(blocks, qtype)
    if job is None:
        return blocks, qtype
    from powerinfer_jax.ops import _ffi

    _ffi._pij_ext.interleave_into(*job[:3])
    release_later(blocks)  # the file's rows were read once to build the copy
    return job[2], job[3]


def _interleave_job(blocks, qtype: str):
    """(file rows, type id, empty copy, the copy's qtype) for `_pij_ext.interleave_into`, or None
    where the format or row count has no interleaved layout."""
    from powerinfer_jax.checkpoint import quants
    from powerinfer_jax.checkpoint.base import aligned_empty

    b = np.asarray(blocks)
    if not quants.can_interleave(qtype, b.shape[0]):
        return None
    out = aligned_empty(b.shape, np.uint8)  # host_blocks keeps it as it is
    return (np.ascontiguousarray(b, np.uint8), quants.type_id(qtype), out,
            qtype + quants.INTERLEAVED_SUFFIX)


def gather_rows(table, ids, qtype: str):
    """Rows `ids` of a block table uint8 [O, row_bytes] -> uint8 [..., row_bytes] in the file's
    layout (a table interleaved by 16 gives each id's group, then its lane's bytes)."""
    from powerinfer_jax.checkpoint import quants

    base = quants.interleaved_base(qtype)
    if base is None:
        return table[ids]
    nbytes = quants.block_size(base)[1]
    o, row_bytes = table.shape
    g = quants.INTERLEAVE
    groups = table.reshape(o // g, row_bytes // nbytes, g * nbytes)[ids // g]  # [..., nb, rec]
    lanes = jnp.asarray(quants.interleave_index(base))[ids % g]  # [..., bytes]
    lanes = jnp.broadcast_to(lanes[..., None, :], groups.shape[:-1] + (nbytes,))
    return jnp.take_along_axis(groups, lanes, axis=-1).reshape(ids.shape + (row_bytes,))
