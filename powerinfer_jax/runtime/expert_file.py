"""Expert files: a quantized mixture-of-experts model's routed experts laid out for reading
whole experts from disk.

For `--ram-budget` on an MoE model (runtime/expert_offload.py) the experts that are not resident
are read when a token routes to them, from a file where each expert's gate, up and down matrices
are one contiguous extent, so one expert is one O_DIRECT extent (read in a few pieces in flight).
The matrices are in the in-memory kernel's layouts (models/moe.py `arrange_stacked`: rows
interleaved by 16 where the format allows, a ReLU expert's down as down groups), so an expert
read from the file is the very bytes the in-memory model computes on, and the tokens are the
same. The GGUF's own extents (three per expert, in the file's row order) would need that
rearrangement on every read. Written once next to the model (or, when that directory is not
writable, in the cache directory), never into the model file.

Layout (little endian):
  [0, 48)         magic b"PIJEXPRT", version u32, header JSON length u32, sha256 of the JSON
  [48, ...)       the header JSON (`ExpertSpec`: the model's fingerprint, shapes, formats,
                  offsets)
  data_offset     (4096) L * E slots of slot_bytes (a multiple of 512, O_DIRECT's unit): at
                  (l * E + e) * slot_bytes expert e of layer l, its gate at + gate_offset, up at
                  + up_offset, down at + down_offset (each on a 64-byte line), zero padded

A file is used only if its header is intact (magic, version, checksum), names this model (the
fingerprint: checkpoint/bundles.py's, of the model file's size, header and sampled blocks) and
these shapes and formats, and is as long as its layout; otherwise it is rebuilt with a message.
Builds run under an exclusive lock (a second process waits, then reuses the first's file) and go
to a temporary name renamed into place at the end, so a reader never sees half a file.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from powerinfer_jax import cache
from powerinfer_jax.checkpoint.base import QuantTensor
from powerinfer_jax.checkpoint.bundles import model_fingerprint
from powerinfer_jax.errors import UserError, fail
from powerinfer_jax.models.moe import arrange_stacked, stacked_format

MAGIC = b"PIJEXPRT"
VERSION = 2  # 2: formats per layer (a Q4_K_M file's down projections are Q4_K or Q6_K)
ALIGN = 4096
SLOT_ALIGN = 512  # O_DIRECT's unit (cpu_backend/bundle_reader.h kDirectAlign): one extent a slot
MATRIX_ALIGN = 64  # a cache line: each matrix of a slot starts on one, as numpy's arrays do
SUFFIX = ".pij-experts"
MATRICES = ("gate", "up", "down_t")
_PREFIX = struct.Struct("<8sII32s")
_FREE_MARGIN = 64 << 20  # bytes left free on the disk after the file


class ExpertFileError(Exception):
    """Why an existing expert file cannot be used (it is then rebuilt)."""


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """What an expert file holds (its header). formats: per layer (gate qtype, up qtype, down
    qtype, down layout), the arranged formats ("Q4_0x16": rows interleaved by 16; a file may
    mix them by layer, as llama.cpp's Q4_K_M does), down layout "rows" (D rows of F weights) or
    "groups" (ReLU experts). Every layer's slots have the same offsets (the largest layer's)."""

    model_fingerprint: str
    n_layers: int
    n_experts: int
    d_model: int
    d_ff: int
    activation: str
    formats: tuple[tuple[str, str, str, str], ...]
    gate_offset: int
    up_offset: int
    down_offset: int
    slot_bytes: int
    data_offset: int
    file_bytes: int

    def same_model(self, other: "ExpertSpec") -> bool:
        """Whether a file with header `self` serves a model whose plan is `other`."""
        return dataclasses.replace(self, file_bytes=other.file_bytes) == other

    def __post_init__(self):  # from JSON: lists
        object.__setattr__(self, "formats", tuple(tuple(f) for f in self.formats))

    def layer_formats(self, layer: int) -> dict:
        """Layer `layer`'s formats as ops._ffi.expert_ffn takes them (the header's down layout
        as the down type's arrangement: "Q4_0g32" for groups)."""
        from powerinfer_jax.models.qweights import kernel_type  # lazy: start-up

        gate, up, down, layout = self.formats[layer]
        return dict(gate_qtype=gate, up_qtype=up, down_qtype=kernel_type(down, layout, False))

    @property
    def expert_bytes(self) -> int:
        """One expert's matrices (without the slot's padding), the largest layer's."""
        return max(sum(_matrix_bytes(self, m, l) for m in MATRICES)
                   for l in range(self.n_layers))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def expert_names(layer: int) -> dict[str, str]:
    """The canonical names of layer `layer`'s stacked expert matrices."""
    return {m: f"layers.{layer}.ffn.experts.{m}.weight" for m in MATRICES}


def external_names(config) -> frozenset[str]:
    """Every stacked expert matrix the store holds (from_params leaves them out of the model)."""
    return frozenset(n for l in range(config.n_layers) for n in expert_names(l).values())


def _layouts(activation: str) -> dict[str, str]:
    """Each matrix's layout as models/moe.py `Experts` keeps it (ReLU experts sparse inside)."""
    relu = activation == "relu"
    return {"gate": "matvec", "up": "rows" if relu else "matvec",
            "down_t": "groups" if relu else "matvec"}


def _matrix_bytes(spec: ExpertSpec, m: str, layer: int) -> int:
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    d, f = spec.d_model, spec.d_ff
    qtype = spec.formats[layer][MATRICES.index(m)]
    base = quants.interleaved_base(qtype) or qtype
    if m == "down_t":
        return d * quants.row_bytes(base, f)  # rows or groups: the same bytes
    return f * quants.row_bytes(base, d)


def check_quantized(ckpt) -> None:
    """A UserError unless every stacked expert matrix is a GGUF block-format tensor (the store's
    kernel computes on blocks: ops.moe_ffn's)."""
    c = ckpt.config
    for l in range(c.n_layers):
        for name in expert_names(l).values():
            t = ckpt.params.get(name)
            if not isinstance(t, QuantTensor):
                kind = type(t).__name__ if t is None else str(np.asarray(t).dtype)
                fail("--ram-budget model", "a GGUF with block-quantized experts (Q4_0, Q4_1, "
                     "Q5_0, Q5_1, Q8_0, K-quants)", f"{name} as {kind}",
                     "quantize the model (llama-quantize) or run without --ram-budget")
    if c.activation not in ("silu", "relu"):
        fail("--ram-budget model's experts", "silu or relu experts (ops.moe_ffn's)",
             c.activation, "run it without --ram-budget")


def plan(ckpt, fingerprint: str) -> ExpertSpec:
    """The expert file for this checkpoint: formats, offsets (before any writing)."""
    check_quantized(ckpt)
    c = ckpt.config
    formats = []
    for l in range(c.n_layers):
        fmt = {}
        for m, name in expert_names(l).items():
            t = ckpt.params[name]
            fmt[m] = stacked_format(t.qtype, _layouts(c.activation)[m], t.stored_shape,
                                    t.transposed)
        formats.append((fmt["gate"][0], fmt["up"][0], fmt["down_t"][0],
                        "groups" if fmt["down_t"][1] == "groups" else "rows"))
    spec = ExpertSpec(model_fingerprint=fingerprint, n_layers=c.n_layers, n_experts=c.n_experts,
                      d_model=c.d_model, d_ff=c.d_ff, activation=c.activation,
                      formats=tuple(formats), gate_offset=0, up_offset=0, down_offset=0,
                      slot_bytes=0, data_offset=ALIGN, file_bytes=0)
    gate, up, down = (max(_matrix_bytes(spec, m, l) for l in range(c.n_layers))
                      for m in MATRICES)
    up_at = _round_up(gate, MATRIX_ALIGN)
    down_at = up_at + _round_up(up, MATRIX_ALIGN)
    slot = _round_up(down_at + down, SLOT_ALIGN)
    return dataclasses.replace(spec, up_offset=up_at, down_offset=down_at, slot_bytes=slot,
                               file_bytes=ALIGN + c.n_layers * c.n_experts * slot)


# ------------------------------------------------------------------------------------ header
def _header_bytes(spec: ExpertSpec) -> bytes:
    text = json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()
    raw = _PREFIX.pack(MAGIC, VERSION, len(text), hashlib.sha256(text).digest()) + text
    if len(raw) > spec.data_offset:
        fail("expert file header", f"at most {spec.data_offset} bytes", len(raw))
    return raw


def read_header(path) -> ExpertSpec:
    """The spec of an existing expert file, or ExpertFileError saying what is wrong."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise ExpertFileError(f"{path}: {len(prefix)} bytes, shorter than a header")
            magic, version, n, digest = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise ExpertFileError(f"{path}: magic {magic!r}, not an expert file")
            if version != VERSION:
                raise ExpertFileError(f"{path}: format version {version}, this build reads "
                                      f"{VERSION}")
            if n > ALIGN:
                raise ExpertFileError(f"{path}: header length {n} past its page")
            text = f.read(n)
            if len(text) != n or hashlib.sha256(text).digest() != digest:
                raise ExpertFileError(f"{path}: header checksum mismatch (a damaged file)")
            try:
                spec = ExpertSpec(**json.loads(text))
            except (TypeError, ValueError) as e:
                raise ExpertFileError(f"{path}: header fields: {e}") from None
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ExpertFileError(f"{path}: {e.strerror or e}") from None
    if size != spec.file_bytes:
        raise ExpertFileError(f"{path}: {size} bytes, its layout says {spec.file_bytes} "
                              "(truncated or still being written)")
    return spec


# ------------------------------------------------------------------------------------ writing
def _write(fh, ckpt, spec: ExpertSpec, progress: bool) -> None:
    """Every expert, arranged as the in-memory model arranges it, at its slot of `fh`."""
    c = ckpt.config
    layouts = _layouts(c.activation)
    offsets = {"gate": spec.gate_offset, "up": spec.up_offset, "down_t": spec.down_offset}
    layers = range(c.n_layers)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="expert file (once)", unit="layer")
    slot = np.zeros(spec.slot_bytes, np.uint8)
    for l in layers:
        arranged = {}
        for m, name in expert_names(l).items():
            t = ckpt.params[name]
            blocks, _, _ = arrange_stacked(np.asarray(t.blocks), t.qtype, layouts[m],
                                           t.stored_shape, t.transposed)
            arranged[m] = np.asarray(blocks).reshape(c.n_experts, -1)
        fh.seek(spec.data_offset + l * c.n_experts * spec.slot_bytes)
        for e in range(c.n_experts):
            slot[:] = 0
            for m, at in offsets.items():
                row = arranged[m][e]
                slot[at:at + row.size] = row
            fh.write(slot.tobytes())
        del arranged


def _write_file(dest: Path, ckpt, spec: ExpertSpec, progress: bool) -> None:
    free = shutil.disk_usage(dest.parent).free
    if free < spec.file_bytes + _FREE_MARGIN:
        raise OSError(errno.ENOSPC, f"{spec.file_bytes} bytes needed, {free} free")
    with cache.atomic_file(dest) as tmp:
        with open(tmp, "r+b") as fh:
            fh.truncate(spec.file_bytes)
            _write(fh, ckpt, spec, progress)
            fh.seek(0)
            fh.write(_header_bytes(spec))
            fh.flush()
            os.fsync(fh.fileno())
            if hasattr(os, "posix_fadvise"):  # written once: out of the page cache
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def candidates(model_path) -> list[Path]:
    """Where a model's expert file may live: next to it, then in the cache directory."""
    model_path = Path(model_path).resolve()
    name = model_path.name + SUFFIX
    return [model_path.parent / name,
            cache.cache_dir() / "experts" / f"{model_fingerprint(model_path)[:16]}-{name}"]


def ensure(ckpt, *, progress: bool = True, note=cache.note) -> tuple[Path, ExpertSpec]:
    """(path, spec) of a valid expert file for `ckpt`: an existing one, or one built now (next
    to the model, else in the cache directory). A file that does not fit this model (another
    model's, truncated, damaged) is rebuilt with a message; a directory that cannot take the file
    is skipped with a message; when none can, a UserError names them."""
    want = plan(ckpt, model_fingerprint(ckpt.source))
    places = candidates(ckpt.source)
    model = Path(ckpt.source).resolve()
    for path in places:  # an existing valid file anywhere wins
        if path.exists():
            try:
                spec = read_header(path)
            except ExpertFileError as e:
                note(f"expert file unusable ({e}); rebuilding it")
                continue
            if spec.same_model(want):
                return path, spec
            note(f"expert file {path} is for another model or format; rebuilding it")
    problems = []
    for path in places:
        if path.resolve() == model:  # (cannot happen with the suffix; never the model itself)
            continue
        try:
            with cache.lock(path, "the expert file"):
                try:  # another process may have built it while this one waited
                    spec = read_header(path)
                    if spec.same_model(want):
                        return path, spec
                except ExpertFileError:
                    pass
                note(f"writing the expert file {path} ({want.file_bytes / 2**30:.2f} GiB, once)")
                _write_file(path, ckpt, want, progress)
                return path, want
        except (OSError, UserError) as e:  # UserError: cache.lock's unwritable directory
            reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            problems.append(f"{path.parent} ({reason})")
            note(f"cannot write the expert file in {path.parent}: {reason}")
    fail("--ram-budget expert file", "a writable directory with room for "
         f"{want.file_bytes} bytes (next to the model or in the cache directory)",
         "; ".join(problems), "free disk space or set POWERINFER_JAX_CACHE to a writable "
         "directory")
