"""A built model kept across processes, so that a warm start neither builds it nor imports the
model code: flax and the model's modules (~0.3 s) and the build (~0.2 s, mostly interleaving the
quantized rows) were a third of a 1.7 s `generate` on a shared 2-core VM.

The snapshot is one file in the executables store's directory (runtime/executables.py: keyed by
the model file's identity, the configs, this package's code, jax and the machine), next to the
steps compiled for that model: a header (the model's config, digest and what `--json` reports of
it, the tokenizer, and where each weight lies) and then every array the engine's steps take, in
their order, each 64-byte aligned, so XLA's CPU client uses the file's pages as they are (no copy;
as with a GGUF's own pages, a file truncated in place under a running model faults, where a
replaced one, renamed over it as this module writes, does not).
It is written once after a build that had none, atomically, with a record of its contents
(powerinfer_jax.cache: size, mtime, sampled and full sha256); a read that does not check out
(truncated, edited, another format or library version) is refused with a line on stderr and the
model is built again, which replaces it.

Only a model built without sparsity artifacts (dense; oracle without a target) is kept: the
artifacts can change under the key. A snapshot's engine builds the real model (`thaw`) when a
step must be compiled, and anything else that reads `Session.model` does the same.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import pickle
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer_jax import cache, cache_limit, errors
from powerinfer_jax.runtime import executables
from powerinfer_jax.tokenizer import Tokenizer, gguf_recipe

FORMAT = 1  # bump when the file layout changes
FILE = "model.snapshot"
_MAGIC = b"PIJSNAP\0"
_HEAD = struct.Struct("<8sQ")  # magic, header bytes
ALIGN = 64  # XLA's CPU client keeps a 64-byte aligned host array as it is (no copy)
# Larger models are not kept: a snapshot is a second copy of the weights on disk (a 7B Q4_0:
# 3.8 GB written and hashed after the build), a large share of the cache's cap
# (cache_limit.DEFAULT_LIMIT), and their start-up is the file's read, not the build.
MAX_BYTES = 512 << 20


@dataclasses.dataclass
class Snapshot:
    """What a session needs of its model when the steps are loaded, not traced."""

    config: object  # config.ModelConfig
    dtype: object  # the model's compute dtype (the KV cache's), a numpy dtype
    digest: str  # executables.model_digest of the model's graph and weights
    leaves: list  # the weights, as Engine takes them (device arrays)
    tokenizer: object  # tokenizer.Tokenizer
    report: dict  # what Session.describe and plan read of the model
    thaw: Callable[[], object] | None = None  # builds the model (set by runtime.session.build)

    def cache_sharding(self):
        return None  # a snapshot is taken of single-device models only


def _versions() -> dict:
    import jax
    import tokenizers

    return {"format": FORMAT, "numpy": np.__version__, "jax": jax.__version__,
            "tokenizers": tokenizers.__version__}


def save(directory: Path, model, tokenizer, report: dict) -> None:
    """Write `model`'s snapshot into `directory` (best effort: an unwritable cache only means the
    next process builds the model too); nothing for a model over MAX_BYTES."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    if sum(a.nbytes for a in leaves) > MAX_BYTES:
        return
    index, offset = [], 0
    for a in leaves:
        offset += -offset % ALIGN
        index.append((offset, tuple(a.shape), str(a.dtype)))
        offset += a.nbytes
    header = pickle.dumps({
        **_versions(), "config": model.config, "dtype": str(model.dtype),
        "digest": executables.model_digest(graphdef, leaves),
        "tokenizer": _tokenizer_recipe(report["source"], tokenizer), "report": report,
        "index": index})
    start = _HEAD.size + len(header)
    start += -start % ALIGN
    dest = Path(directory) / FILE
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        # under the lock: a reader never pairs this file with another writer's record
        with cache.lock(dest, what=f"model snapshot {dest}"):
            with cache.atomic_file(dest) as tmp, open(tmp, "wb") as f:
                def write(b):
                    f.write(b)
                    h.update(b)

                write(_HEAD.pack(_MAGIC, len(header)) + header)
                pos = _HEAD.size + len(header)
                for (at, _, _), a in zip(index, leaves):
                    write(b"\0" * (start + at - pos))
                    data = np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
                    write(memoryview(data))
                    pos = start + at + data.nbytes
            cache.write_record(dest, h.hexdigest())
    except (OSError, errors.UserError):  # an unwritable cache (the lock says so)
        return
    cache_limit.enforce(keep=[directory])  # the cache's cap (cache_limit.py)


def _tokenizer_recipe(source: str, tokenizer) -> tuple:
    """How a snapshot makes its tokenizer again: a GGUF's, from the plain values its metadata
    turns into (tokenizer.gguf_recipe: the vocabulary, merge pairs, special tokens), so only the
    tokenizers objects are made (SmolLM2's: ~0.04 s, where unpickling the built tokenizer, which
    parses its JSON, took 0.13 s); else the tokenizer itself."""
    path = Path(source)
    if path.is_file():
        # lazy: start-up (the GGUF reader, for the writer only)
        from powerinfer_jax.checkpoint.gguf import _open, read_metadata

        return ("gguf", gguf_recipe(read_metadata(_open(path))))
    return ("tokenizer", tokenizer)


def _tokenizer(recipe: tuple):
    kind, value = recipe
    if kind == "gguf":
        return Tokenizer.from_recipe(value)
    if kind != "tokenizer":
        raise ValueError(f"tokenizer: expected a gguf or tokenizer recipe, got {kind!r}")
    return value


def load(directory: Path) -> Snapshot | None:
    """The snapshot in `directory`, or None: none there, or one that does not check out (then a
    line on stderr says why, and the caller builds the model, which writes it again)."""
    dest = Path(directory) / FILE
    if not dest.is_file():
        return None
    with cache.lock(dest, shared=True):
        reason = cache.check_file(dest)
        if reason is None:
            try:
                return _read(dest)
            except Exception as e:  # a header that does not unpickle, or not as written
                reason = f"unreadable ({type(e).__name__}: {e})"
    cache.note(f"cached model snapshot {dest} is {reason}; building the model again "
               "(it is replaced)")
    return None


def _read(dest: Path) -> Snapshot:
    import jax

    with open(dest, "rb") as f:
        magic, n = _HEAD.unpack(f.read(_HEAD.size))
        if magic != _MAGIC:
            raise ValueError(f"expected the magic {_MAGIC!r}, got {magic!r}")
        # the collector paused over the tokenizer's ~50k merge pairs (tokenizer._merge_pairs)
        enabled = gc.isenabled()
        gc.disable()
        try:
            meta = pickle.loads(f.read(n))
        finally:
            if enabled:
                gc.enable()
    if {k: meta.get(k) for k in _versions()} != _versions():
        raise ValueError(f"written by another version: {[meta.get(k) for k in _versions()]}")
    start = _HEAD.size + n
    start += -start % ALIGN
    data = np.memmap(dest, np.uint8, "r")
    leaves = []
    for at, shape, dtype in meta["index"]:
        dt = np.dtype(jax.numpy.dtype(dtype))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if start + at + nbytes > data.size:
            raise ValueError(f"a weight ends at byte {start + at + nbytes}, past the file's end")
        host = data[start + at:start + at + nbytes].view(dt).reshape(shape)
        leaves.append(jax.device_put(host, may_alias=True))
    return Snapshot(config=meta["config"], dtype=jax.numpy.dtype(meta["dtype"]),
                    digest=meta["digest"], leaves=leaves,
                    tokenizer=_tokenizer(meta["tokenizer"]), report=meta["report"])
