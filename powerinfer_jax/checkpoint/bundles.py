"""Neuron bundle files: a quantized model's FFN laid out for reading neurons from disk.

For `--ram-budget` (runtime/offload.py) the FFN rows of neurons that are not resident are read per
token from a file where each neuron's gate row, up row and down row are contiguous (a *bundle*,
as PowerInfer-2 and LLM-in-a-flash bundle them), so one neuron is one read and neurons adjacent in
the file are one read together. Written once next to the model (or, when that directory is not
writable, in the cache directory), never into the model file.

Layout (little endian; every offset a multiple of ALIGN = 4096, the disk's physical block):
  [0, 48)            magic b"PIJNEURB", version u32, header JSON length u32, sha256 of the JSON
  [48, ...)          the header JSON (`BundleSpec`: the model's fingerprint, shapes, formats,
                     offsets, the order table's sha256, how the down rows were made)
  order_offset       int32 [L, F]: order[l][p] = the neuron whose bundle is at file position p
  planes_offset      down groups only: per layer (planes_stride apart) the scale planes of its
                     down groups, uint8 [F / 32, scale bytes * D] (checkpoint.quants.down_codes)
  data_offset        L * F slots of slot_bytes (a multiple of 512, O_DIRECT's unit): at
                     (l * F + p) * slot_bytes the bundle of neuron order[l][p]: its gate row
                     (gated FFNs), up row and down row, each in its block format, zero padded
Positions follow the activation frequencies known when the file is built (most frequent first, so
a layer's hot neurons are one read when the store loads them, and neurons of like frequency are
neighbours); a file built from other frequencies stays valid (only the model must match).

Rows: gate and up are the file's own rows. The down row is what the in-memory sparse kernel reads
for the same model (models/qweights.py's layouts for a selector's neurons), so that a model under
--ram-budget computes the in-memory run's bits (`down_source`):
  "rows"    a PowerInfer GGUF's ffn_down_t: neuron rows already, used as they are;
  "groups"  llama.cpp's ffn_down [D, F] (blocked along F) in a 32-weight legacy format: the
            neuron's code row (its quant bytes of the file's blocks), the blocks' scales kept as
            the down groups' planes in their own section, read into memory when the store opens
            (the in-memory kernel reads down groups: the same bytes and arithmetic, nothing
            re-quantized; the planes are 2 or 4 bytes per 32 weights, 1/9 of Q4_0's down);
  "requantized"  any other format (K-quants): rows re-blocked per neuron in DOWN_ROWS_QTYPE,
            as the in-memory kernel's rows are, with the added error measured over the whole
            matrix and recorded in the header (`down_error`: relative RMS).

A file is used only if its header is intact (magic, version, checksums), names this model (the
fingerprint: sha256 of the model file's size, header and 64 sampled blocks) and these shapes and
formats, and is as long as its layout; otherwise it is rebuilt with a message. Builds run under
an exclusive lock (two processes: the second waits, then reuses the first's file) and are
written to a temporary name renamed into place at the end, so a reader never sees half a file.
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

from powerinfer_jax import cache, cache_limit
from powerinfer_jax.checkpoint.base import QuantTensor
from powerinfer_jax.errors import UserError, fail

MAGIC = b"PIJNEURB"
VERSION = 2  # 2: down groups (planes section, code rows); down rows as the in-memory kernel reads them
ALIGN = 4096
SLOT_ALIGN = 512
DOWN_ROWS_QTYPE = "Q8_0"  # models.qweights.DOWN_ROWS_QTYPE (tests/test_offload.py checks they agree)
SUFFIX = ".pij-neurons"
_PREFIX = struct.Struct("<8sII32s")
_CHUNK = 1024  # neurons per write (bounds the builder's memory: one layer's down as float32)
_FREE_MARGIN = 64 << 20  # bytes left free on the disk after the file


class BundleError(Exception):
    """Why an existing bundle file cannot be used (it is then rebuilt)."""


@dataclasses.dataclass(frozen=True)
class BundleSpec:
    """What a bundle file holds (its header)."""

    model_fingerprint: str
    n_layers: int
    n_neurons: int
    dim: int
    gated: bool
    gate_qtype: str | None
    up_qtype: str
    down_qtype: str
    slot_bytes: int
    order_offset: int
    data_offset: int
    file_bytes: int
    down_source: str  # "rows", "groups" or "requantized" (module docstring)
    down_error: float = 0.0
    order_sha256: str = ""
    planes_offset: int = 0  # down groups: the scale planes' section, a layer's planes_stride apart
    planes_stride: int = 0

    @property
    def row_bytes(self) -> tuple[int, int, int]:
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        gate = quants.row_bytes(self.gate_qtype, self.dim) if self.gated else 0
        return gate, quants.row_bytes(self.up_qtype, self.dim), _down_bytes(
            self.down_qtype, self.down_source, self.dim)

    @property
    def bundle_bytes(self) -> int:
        return sum(self.row_bytes)

    @property
    def plane_bytes(self) -> int:
        """One layer's down-group scale planes (0 unless down_source is "groups")."""
        from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

        if self.down_source != "groups":
            return 0
        return self.n_neurons // 32 * quants.check_down_groups(self.down_qtype, self.dim,
                                                               self.n_neurons)[1] * self.dim

    def same_model(self, other: "BundleSpec") -> bool:
        """Whether a file with header `self` serves a model whose plan is `other`."""
        keys = ("model_fingerprint", "n_layers", "n_neurons", "dim", "gated", "gate_qtype",
                "up_qtype", "down_qtype", "down_source")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _down_bytes(qtype: str, source: str, dim: int) -> int:
    """A bundle's down row: a code row (groups: the block's bytes less its scales, per 32
    weights) or a neuron row."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    if source == "groups":
        nb, sb = quants.check_down_groups(qtype, dim, 32)
        return dim // 32 * (nb - sb)
    return quants.row_bytes(qtype, dim)


def ffn_names(config, layer: int) -> dict[str, str]:
    """The canonical names of layer `layer`'s FFN matrices."""
    p = f"layers.{layer}.ffn."
    names = {"up": p + "up.weight", "down": p + "down_t.weight"}
    if config.gated:
        names["gate"] = p + "gate.weight"
    return names


def external_names(config) -> frozenset[str]:
    """Every FFN matrix the store holds (from_params leaves them out of the model)."""
    return frozenset(n for l in range(config.n_layers) for n in ffn_names(config, l).values())


def model_fingerprint(path) -> str:
    """sha256 of the model file's size, header and 64 sampled blocks (cache.sample_sha256)."""
    path = Path(path)
    size = path.stat().st_size
    return hashlib.sha256(f"pij-neurons:{size}:{cache.sample_sha256(path, size)}".encode()
                          ).hexdigest()


def check_quantized(ckpt) -> None:
    """A UserError unless every FFN matrix is a GGUF block-format tensor (the store's kernel
    computes on blocks; float checkpoints are not offloaded)."""
    c = ckpt.config
    for l in range(c.n_layers):
        for role, name in ffn_names(c, l).items():
            t = ckpt.params.get(name)
            if not isinstance(t, QuantTensor):
                kind = type(t).__name__ if t is None else str(np.asarray(t).dtype)
                fail("--ram-budget model", "a GGUF with block-quantized FFN matrices (Q4_0, Q4_1, "
                     "Q5_0, Q5_1, Q8_0, K-quants)", f"{name} as {kind}",
                     "quantize the model (llama-quantize) or run without --ram-budget")


def plan(ckpt, fingerprint: str) -> BundleSpec:
    """The bundle file for this checkpoint: shapes, formats, offsets (before any writing). The
    down rows as the in-memory sparse kernel reads them (module docstring)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    check_quantized(ckpt)
    c = ckpt.config
    names = ffn_names(c, 0)
    up = ckpt.params[names["up"]]
    down = ckpt.params[names["down"]]
    gate = ckpt.params.get(names["gate"]) if c.gated else None
    if not down.transposed:  # PowerInfer's ffn_down_t: neuron rows already
        down_qtype, source = down.qtype, "rows"
    elif down.qtype in quants.DOWN_GROUP_TYPES and c.d_model % 32 == 0 and c.d_ff % 32 == 0:
        down_qtype, source = down.qtype, "groups"
    else:
        down_qtype, source = DOWN_ROWS_QTYPE, "requantized"
    return _spec(c, fingerprint, gate and gate.qtype, up.qtype, down_qtype, source)


def _spec(c, fingerprint, gate_qtype, up_qtype, down_qtype, source, error=0.0,
          order_sha256="") -> BundleSpec:
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    bundle = ((quants.row_bytes(gate_qtype, c.d_model) if c.gated else 0)
              + quants.row_bytes(up_qtype, c.d_model) + _down_bytes(down_qtype, source,
                                                                    c.d_model))
    slot = _round_up(bundle, SLOT_ALIGN)
    order_offset = ALIGN  # the header fits one page (checked when written)
    planes_offset = _round_up(order_offset + 4 * c.n_layers * c.d_ff, ALIGN)
    planes_stride = 0
    if source == "groups":
        sb = quants.check_down_groups(down_qtype, c.d_model, c.d_ff)[1]
        planes_stride = _round_up(c.d_ff // 32 * sb * c.d_model, ALIGN)
    data_offset = planes_offset + c.n_layers * planes_stride
    return BundleSpec(model_fingerprint=fingerprint, n_layers=c.n_layers, n_neurons=c.d_ff,
                      dim=c.d_model, gated=c.gated, gate_qtype=gate_qtype if c.gated else None,
                      up_qtype=up_qtype, down_qtype=down_qtype, slot_bytes=slot,
                      order_offset=order_offset, data_offset=data_offset,
                      file_bytes=data_offset + c.n_layers * c.d_ff * slot, down_source=source,
                      down_error=error, order_sha256=order_sha256,
                      planes_offset=planes_offset if planes_stride else 0,
                      planes_stride=planes_stride)


# ------------------------------------------------------------------------------------ header
def _header_bytes(spec: BundleSpec) -> bytes:
    text = json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()
    raw = _PREFIX.pack(MAGIC, VERSION, len(text), hashlib.sha256(text).digest()) + text
    if len(raw) > spec.order_offset:
        fail("neuron bundle header", f"at most {spec.order_offset} bytes", len(raw))
    return raw


def read_header(path) -> tuple[BundleSpec, np.ndarray]:
    """(spec, order [L, F]) of an existing bundle file, or BundleError saying what is wrong."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise BundleError(f"{path}: {len(prefix)} bytes, shorter than a header")
            magic, version, n, digest = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise BundleError(f"{path}: magic {magic!r}, not a neuron bundle file")
            if version != VERSION:
                raise BundleError(f"{path}: format version {version}, this build reads {VERSION}")
            if n > ALIGN:
                raise BundleError(f"{path}: header length {n} past its page")
            text = f.read(n)
            if len(text) != n or hashlib.sha256(text).digest() != digest:
                raise BundleError(f"{path}: header checksum mismatch (a damaged file)")
            try:
                spec = BundleSpec(**json.loads(text))
            except (TypeError, ValueError) as e:
                raise BundleError(f"{path}: header fields: {e}") from None
            size = os.fstat(f.fileno()).st_size
            if size != spec.file_bytes:
                raise BundleError(f"{path}: {size} bytes, its layout says {spec.file_bytes} "
                                  "(truncated or still being written)")
            f.seek(spec.order_offset)
            count = spec.n_layers * spec.n_neurons
            order = np.frombuffer(f.read(4 * count), np.int32)
    except OSError as e:
        raise BundleError(f"{path}: {e.strerror or e}") from None
    if order.size != count or hashlib.sha256(order.tobytes()).hexdigest() != spec.order_sha256:
        raise BundleError(f"{path}: order table checksum mismatch (a damaged file)")
    order = order.reshape(spec.n_layers, spec.n_neurons)
    if not np.array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(spec.n_neurons),
                                                                   order.shape)):
        raise BundleError(f"{path}: order table is not a permutation per layer")
    return spec, order


# ------------------------------------------------------------------------------------ writing
def _order(frequencies, n_layers: int, n_neurons: int) -> np.ndarray:
    """order[l][p]: neurons by decreasing frequency (stable), or by index without frequencies."""
    if frequencies is None:
        return np.broadcast_to(np.arange(n_neurons, dtype=np.int32), (n_layers, n_neurons)).copy()
    f = np.asarray(frequencies, np.float64)
    return np.stack([np.argsort(-f[l], kind="stable") for l in range(n_layers)]).astype(np.int32)


def _write(fh, ckpt, spec: BundleSpec, order: np.ndarray, progress: bool) -> BundleSpec:
    """Write the order table, the planes (down groups) and every bundle to the open file `fh`
    (at their offsets); returns the spec with the measured down error (requantized)."""
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    c = ckpt.config
    gate_b, up_b, down_b = spec.row_bytes
    fh.seek(spec.order_offset)
    fh.write(np.ascontiguousarray(order, np.int32).tobytes())
    err_num = err_den = 0.0
    layers = range(c.n_layers)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="neuron bundles (once)", unit="layer")
    for l in layers:
        names = ffn_names(c, l)
        up = ckpt.params[names["up"]]
        down = ckpt.params[names["down"]]
        gate = ckpt.params[names["gate"]] if spec.gated else None
        # one layer's down rows (released after the layer)
        if spec.down_source == "rows":
            down_rows = np.asarray(down.blocks)
        elif spec.down_source == "groups":
            planes, down_rows = quants.down_codes(np.asarray(down.blocks), down.qtype, c.d_model,
                                                  c.d_ff)
            fh.seek(spec.planes_offset + l * spec.planes_stride)
            fh.write(planes.tobytes())
        else:
            values = down.dequantize()
            down_rows = quants.quantize(values, spec.down_qtype)
            again = quants.dequantize(down_rows, spec.down_qtype).reshape(values.shape)
            err_num += float(np.sum((again.astype(np.float64) - values) ** 2))
            err_den += float(np.sum(values.astype(np.float64) ** 2))
            del values, again
        fh.seek(spec.data_offset + l * spec.n_neurons * spec.slot_bytes)
        for lo in range(0, spec.n_neurons, _CHUNK):
            ids = order[l, lo:lo + _CHUNK]
            out = np.zeros((ids.size, spec.slot_bytes), np.uint8)
            at = 0
            if gate is not None:
                out[:, :gate_b] = np.asarray(gate.blocks)[ids]
                at = gate_b
            out[:, at:at + up_b] = np.asarray(up.blocks)[ids]
            at += up_b
            out[:, at:at + down_b] = down_rows[ids]
            fh.write(out.tobytes())
        del down_rows
    error = (err_num / err_den) ** 0.5 if err_den > 0 else 0.0
    return dataclasses.replace(spec, down_error=error)


def _write_file(dest: Path, ckpt, spec: BundleSpec, order: np.ndarray, progress: bool
                ) -> BundleSpec:
    """Build the file at `dest` (a temporary name renamed into place). Returns the final spec."""
    free = shutil.disk_usage(dest.parent).free
    if free < spec.file_bytes + _FREE_MARGIN:
        raise OSError(errno.ENOSPC, f"{spec.file_bytes} bytes needed, {free} free")
    order_sha = hashlib.sha256(np.ascontiguousarray(order, np.int32).tobytes()).hexdigest()
    spec = dataclasses.replace(spec, order_sha256=order_sha)
    with cache.atomic_file(dest) as tmp:
        with open(tmp, "r+b") as fh:
            fh.truncate(spec.file_bytes)
            spec = _write(fh, ckpt, spec, order, progress)
            fh.seek(0)
            fh.write(_header_bytes(spec))
            fh.flush()
            os.fsync(fh.fileno())
            if hasattr(os, "posix_fadvise"):  # written once: out of the page cache
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return spec


def candidates(model_path) -> list[Path]:
    """Where a model's bundle file may live: next to it, then in the cache directory."""
    model_path = Path(model_path).resolve()
    name = model_path.name + SUFFIX
    return [model_path.parent / name,
            cache.cache_dir() / "neurons" / f"{model_fingerprint(model_path)[:16]}-{name}"]


def ensure(ckpt, frequencies=None, *, progress: bool = True, note=cache.note
           ) -> tuple[Path, BundleSpec, np.ndarray]:
    """(path, spec, order) of a valid bundle file for `ckpt`: an existing one, or one built now
    (next to the model, else in the cache directory). A file that does not fit this model is
    rebuilt with a message; a directory that cannot take the file is skipped with a message;
    when none can, a UserError names them."""
    fingerprint = model_fingerprint(ckpt.source)
    want = plan(ckpt, fingerprint)
    places = candidates(ckpt.source)
    for path in places:  # an existing valid file anywhere wins
        if path.exists():
            try:
                spec, order = read_header(path)
            except BundleError as e:
                note(f"neuron bundle file unusable ({e}); rebuilding it")
                continue
            if spec.same_model(want):
                cache_limit.mark_used(path)
                return path, spec, order
            note(f"neuron bundle file {path} is for another model or format; rebuilding it")
    problems = []
    for path in places:
        try:
            with cache.lock(path, "the neuron bundle file"):
                try:  # another process may have built it while this one waited
                    spec, order = read_header(path)
                    if spec.same_model(want):
                        return path, spec, order
                except BundleError:
                    pass
                note(f"writing the neuron bundle file {path} ({want.file_bytes / 2**30:.2f} GiB, "
                     "once)")
                order = _order(frequencies, want.n_layers, want.n_neurons)
                spec = _write_file(path, ckpt, want, order, progress)
            cache_limit.enforce_after_write(path)  # the cache's cap (cache_limit.py)
            return path, spec, order
        except (OSError, UserError) as e:  # UserError: cache.lock's unwritable directory
            reason = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            problems.append(f"{path.parent} ({reason})")
            note(f"cannot write the neuron bundle file in {path.parent}: {reason}")
    fail("--ram-budget neuron bundle file", "a writable directory with room for "
         f"{want.file_bytes} bytes (next to the model or in the cache directory)",
         "; ".join(problems), "free disk space or set POWERINFER_JAX_CACHE to a writable "
         "directory")
