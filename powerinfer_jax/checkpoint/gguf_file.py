"""A fast GGUF header reader: metadata as plain python values, tensors as views of one mmap.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every part of every metadata value,
and a model's tokenizer holds ~100k strings (tokens and merges), so opening SmolLM2's 98 MB file
took 3.7 s of a 4.3 s load. This reader walks the same layout with `struct` on an mmap, and reads
the string arrays with the compiled extension's loop (`_pij_ext.gguf_strings`) when it is built.
Type ids, block sizes and names still come from the `gguf` package's tables, and tests compare
both readers on the same files.

Layout (GGUF v2/v3, little-endian; PowerInfer's files carry "PWRI" as their magic):
  magic u32, version u32, n_tensors u64, n_kv u64,
  n_kv x (key: string, value type u32, value), n_tensors x (name: string, n_dims u32,
  ne u64 x n_dims, type u32, offset u64), padding to `general.alignment` (default 32), data.
A string is a u64 length and its UTF-8 bytes; an array is an item type u32, a count u64, items.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGICS = (b"GGUF", b"PWRI")
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 8  # arrays of arrays: none of the keys read nests; a deep one is corruption

_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {  # value type -> numpy dtype, for numeric arrays read in one piece
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_TYPED = {  # tensor types whose data is handed over typed, as GGUFReader does; others are bytes
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


_U64 = struct.Struct("<Q")


def _compiled_strings():
    """The compiled extension's string-array reader (`_pij_ext.gguf_strings`; the extension
    itself, not ops._ffi: a checkpoint imports nothing of ops), or None on a checkout where it is
    not built."""
    try:
        from powerinfer_jax import _pij_ext  # lazy: optional C++ extension
    except ImportError:
        return None
    return _pij_ext.gguf_strings


def _python_strings(mm, off: int, count: int):
    """`_pij_ext.gguf_strings` in Python, with its contract: (strings, end offset, 0), or for the
    first bad item (its index, its offset, 1: its length runs past the end | 2: its bytes, which
    are not UTF-8)."""
    size, out, unpack = len(mm), [], _U64.unpack_from
    try:  # one try around the loop: ~100k items
        for _ in range(count):
            if off + 8 > size:
                return len(out), off, 1
            (n,) = unpack(mm, off)
            off += 8
            if off + n > size:
                return len(out), off - 8, 1
            out.append(mm[off:off + n].decode("utf-8"))
            off += n
    except UnicodeDecodeError:
        return len(out), off, 2
    return out, off, 0


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout (truncated, corrupt or not a GGUF file)."""


@dataclass(frozen=True)
class Tensor:
    """One tensor's header and a read-only view of its data in the file's mmap.

    shape: GGUF's `ne` (fastest dimension first), as `GGUFReader` gives it; `data` has the numpy
    shape (ne reversed): typed for float/int types, raw bytes `[..., row_bytes]` for block types.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file opened for reading: `.metadata` (key -> python value: str, int, float, bool or
    a list of them), `.tensors` (in file order), `.version`, `.magic`."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"expected at least a 24-byte header, got {size} bytes")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = size
        self.magic = bytes(self._mm[:4])
        if self.magic not in MAGICS:
            raise GGUFFormatError(f"expected magic {MAGICS[0]!r} (or {MAGICS[1]!r}), got "
                                  f"{self.magic!r}")
        self._off = 4
        self.version = self._scalar("<I")
        if self.version not in VERSIONS:
            raise GGUFFormatError(f"expected GGUF version one of {list(VERSIONS)} (little-endian), "
                                  f"got {self.version}")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self._check_count(n_tensors, 8, "tensor count")
        self._check_count(n_kv, 12, "metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise GGUFFormatError(f"metadata key {key!r} appears twice")
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment: expected a power of two, got {alignment!r}")
        start = -(-self._off // alignment) * alignment
        whole = np.frombuffer(self._mm, dtype=np.uint8)
        self.tensors: list[Tensor] = []
        names = set()
        for name, ne, kind, offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            names.add(name)
            block, type_size = GGML_QUANT_SIZES[kind]
            n_elems = math.prod(ne)
            if ne and ne[0] % block:
                raise GGUFFormatError(f"tensor {name!r}: expected its first dimension {ne[0]} to "
                                      f"be a multiple of {kind.name}'s block size {block}")
            n_bytes = n_elems // block * type_size
            begin = start + offset
            dims = tuple(reversed(ne))
            if begin + n_bytes > size:  # a view past the end: the caller names the file and fix
                data = np.zeros(0, np.uint8)
            elif kind in _TYPED:
                data = whole[begin:begin + n_bytes].view(_TYPED[kind]).reshape(dims)
            else:
                byte_dims = dims[:-1] + (dims[-1] // block * type_size,) if dims else (n_bytes,)
                data = whole[begin:begin + n_bytes].reshape(byte_dims)
            self.tensors.append(Tensor(name, kind, np.array(ne, dtype=np.uint64), n_bytes, begin,
                                       data))

    # -------------------------------------------------------------------------------- parsing
    def _need(self, n: int, what: str) -> None:
        if n < 0 or self._off + n > self._size:
            raise GGUFFormatError(f"{what} at byte {self._off}: expected {n} more bytes, the file "
                                  f"ends at {self._size}")

    def _check_count(self, n: int, min_item_bytes: int, what: str) -> None:
        if n * min_item_bytes > self._size:  # a corrupt count: fail now, not after a long loop
            raise GGUFFormatError(f"{what}: expected at most {self._size // min_item_bytes} for a "
                                  f"{self._size}-byte file, got {n}")

    def _scalar(self, fmt: str):
        n = struct.calcsize(fmt)
        self._need(n, "value")
        (value,) = struct.unpack_from(fmt, self._mm, self._off)
        self._off += n
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        self._need(n, "string")
        raw = self._mm[self._off:self._off + n]
        self._off += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"string at byte {self._off - n}: expected UTF-8, got {e}") \
                from None

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer holds ~100k of them): read by the compiled
        extension's loop, else by the same loop in Python."""
        got, off, status = (_compiled_strings() or _python_strings)(self._mm, self._off, count)
        if status == 2:
            raise GGUFFormatError(f"string array item {got} at byte {off}: expected UTF-8")
        if status:
            raise GGUFFormatError(f"string array at byte {self._off}: expected {count} strings, "
                                  f"the file ends after {got}")
        self._off = off
        return got

    def _value(self, vtype: int, depth: int = 0):
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item, count = self._scalar("<I"), self._scalar("<Q")
            if item == GGUFValueType.STRING:
                self._check_count(count, 8, "string array length")
                return self._strings(count)
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                self._check_count(count, dtype.itemsize, "array length")
                self._need(count * dtype.itemsize, "array")
                out = np.frombuffer(self._mm, dtype, count, self._off).tolist()
                self._off += count * dtype.itemsize
                return out
            if item == GGUFValueType.ARRAY:
                self._check_count(count, 12, "array length")
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise GGUFFormatError(f"array at byte {self._off - 12}: expected arrays "
                                          f"nested at most {MAX_ARRAY_DEPTH} deep, got more")
                return [self._value(GGUFValueType.ARRAY, depth + 1) for _ in range(count)]
            raise GGUFFormatError(f"array item type: expected a GGUF value type id, got {item}")
        if vtype in _SCALARS:
            value = self._scalar(_SCALARS[vtype])
            return float(value) if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else value
        raise GGUFFormatError(f"value type at byte {self._off - 4}: expected a GGUF value type "
                              f"id, got {vtype}")

    def _tensor_info(self):
        name = self._string()
        n_dims = self._scalar("<I")
        if n_dims > 4:
            raise GGUFFormatError(f"tensor {name!r}: expected at most 4 dimensions, got {n_dims}")
        ne = [self._scalar("<Q") for _ in range(n_dims)]
        type_id, offset = self._scalar("<I"), self._scalar("<Q")
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r}: expected a GGML type id, got {type_id}") \
                from None
        if kind not in GGML_QUANT_SIZES:
            raise GGUFFormatError(f"tensor {name!r}: type {kind.name} has no known block size")
        return name, ne, kind, offset


class Mapping(NamedTuple):
    """One line of /proc/self/maps: [begin, end), perms ("r-xs"...), inode (0: not a file's)."""

    begin: int
    end: int
    perms: str
    inode: int
    path: str


def _mappings() -> list[Mapping]:
    """This process's mappings (/proc/self/maps); empty without /proc (not Linux)."""
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                span, perms, _, _, inode, *path = line.split(maxsplit=5)
                begin, end = (int(x, 16) for x in span.split("-"))
                out.append(Mapping(begin, end, perms, int(inode), path[0].strip() if path else ""))
    except (OSError, ValueError):
        return []
    return out


def mapping_at(address: int, mappings: list[Mapping] | None = None) -> Mapping | None:
    """The mapping of this process that holds `address` (/proc/self/maps, or `mappings` read
    from it), or None (none holds it, or no /proc: not Linux)."""
    for m in _mappings() if mappings is None else mappings:
        if m.begin <= address < m.end:
            return m
    return None


def release_mapped_pages(*arrays) -> int:
    """Drop from this process's resident set the whole pages of `array`'s bytes, when they lie
    in a read-only shared file mapping (a view of a `GGUFFile`): they were read once (e.g. to
    regroup ffn_down for the sparse kernel) and are not needed again. Such pages are the file's
    bytes and nothing else, so a later read faults them back in from the page cache or the
    file, unchanged; any other memory (anonymous, private or writable) is left alone, because
    MADV_DONTNEED would zero or discard it. Several arrays share one read of the process's
    mappings. Returns the bytes released (0 off Linux)."""
    return release_spans([s for s in file_page_spans(*arrays) if s is not None])


def file_page_spans(*arrays) -> list[tuple[int, int] | None]:
    """Per array, the span [lo, hi) of its whole pages when they lie in one read-only shared
    file mapping (what `release_spans` may drop), else None. Read while the arrays (and so
    their mappings) are alive; the spans stay valid as long as the arrays do. One read of the
    process's mappings for all of them; all None off Linux."""
    import sys

    if not sys.platform.startswith("linux"):
        return [None] * len(arrays)
    page = mmap.PAGESIZE
    wanted = []
    for array in arrays:
        a = np.asarray(array)
        span = None
        if a.size and (a.flags.c_contiguous or a.flags.f_contiguous):
            start = a.__array_interface__["data"][0]
            lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
            span = (lo, hi) if hi > lo else None
        wanted.append(span)
    if not any(wanted):
        return wanted
    mappings = _mappings()  # read once, while every array (and so its mapping) is alive
    out = []
    for span in wanted:
        # one mapping, a file's (inode), shared and not writable: how GGUFFile maps a file
        m = None if span is None else mapping_at(span[0], mappings)
        ok = (m is not None and span[1] <= m.end and m.perms[1] == "-" and m.perms[3] == "s"
              and m.inode != 0)
        out.append(span if ok else None)
    return out


def release_spans(spans) -> int:
    """MADV_DONTNEED over spans from `file_page_spans` (only those: other memory would lose its
    contents). Returns the bytes released."""
    if not spans:
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for lo, hi in spans:
        if libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) == 0:
            released += hi - lo
    return released
