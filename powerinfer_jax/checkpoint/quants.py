"""GGML tensor types: sizes, dequantization and quantization, on the `gguf` package.

Block layouts and dequantizers come from the `gguf` package (llama.cpp's own Python mirror of
ggml-common.h), which this module wraps: its tables say how many values and bytes a block holds,
`gguf.quants.dequantize` turns blocks into float32 and `gguf.quants.quantize` makes blocks for the
types it can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16). It cannot quantize K-quants; Q4_K has
a simple quantizer here (`quantize_q4_k`, for re-blocking FFN down rows; not llama.cpp's
search-based one). The C++ kernels (cpu_backend/quant_formats.h) unpack the same layouts
independently; tests check both against each other and against hand-decoded blocks.

Every function takes and returns whole rows: raw `uint8[..., row_bytes]` <-> float32
`[..., row_elements]`, row_elements a multiple of the type's block size.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq

from powerinfer_jax.errors import fail

FLOAT_TYPES = ("F32", "F16", "BF16")
# The block formats the loader keeps and the quantized kernels read (cpu_backend/quant_formats.h).
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = FLOAT_TYPES + QUANTIZED_TYPES
# Types gguf.quants can quantize, plus our Q4_K.
QUANTIZABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K")


def _kind(qtype: str) -> GGMLQuantizationType:
    if qtype not in SUPPORTED_TYPES:
        fail("tensor type", f"one of {list(SUPPORTED_TYPES)}", qtype,
             "requantize the model to one of these types (llama.cpp's llama-quantize)")
    return GGMLQuantizationType[qtype]


def arrangement(qtype: str) -> tuple[str, int]:
    """A type name the kernels take -> (its file format, its arrangement's id bit): the one
    encoding of how a matrix is arranged, a suffix here and a bit of the id in C++
    (cpu_backend/quant_formats.h Arrangement): "Q4_0" the file's rows (0), "Q4_0x16" rows
    interleaved by 16 (INTERLEAVED_ID_FLAG), "Q4_0c64" the columns layout (COLUMNS_ID_FLAG),
    "Q4_0g32" ffn_down's down groups (GROUPS_ID_FLAG)."""
    for names, suffix, flag in ((INTERLEAVED_TYPES, INTERLEAVED_SUFFIX, INTERLEAVED_ID_FLAG),
                                (COLUMNS_TYPES, COLUMNS_SUFFIX, COLUMNS_ID_FLAG),
                                (GROUPS_TYPES, GROUPS_SUFFIX, GROUPS_ID_FLAG)):
        if qtype in names:
            return qtype[:-len(suffix)], flag
    return qtype, 0


def type_id(qtype: str) -> int:
    """GGML's id of the type (what a GGUF tensor header stores, what the kernels take), with
    its arrangement's bit (`arrangement`)."""
    base, flag = arrangement(qtype)
    return int(_kind(base).value) | flag


def block_size(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) from the gguf package's table (an arranged name: its
    format's; the columns layout's row bytes also depend on the row count:
    `columns_row_bytes`)."""
    return GGML_QUANT_SIZES[_kind(arrangement(qtype)[0])]


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` values; cols must be a multiple of the block size."""
    block, nbytes = block_size(qtype)
    if cols <= 0 or cols % block:
        fail(f"{qtype} row length", f"a positive multiple of the block size {block}", cols)
    return cols // block * nbytes


def _as_bytes(raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:  # GGUFReader hands float tensors over already typed
        raw = raw.view(np.uint8).reshape(*raw.shape[:-1], -1)
    return raw


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Raw bytes of whole rows (`uint8[..., row_bytes]`, or an already typed float array) ->
    float32 `[..., row_elements]`. Rows interleaved by 16 (a "Q4_0x16" name: uint8 [O,
    row_bytes]) come out as the file's rows would."""
    base = interleaved_base(qtype)
    if base is not None:
        return dequantize(deinterleave(raw, qtype), base)
    kind = _kind(qtype)
    raw = _as_bytes(raw)
    block, nbytes = GGML_QUANT_SIZES[kind]
    if raw.ndim == 0 or raw.shape[-1] % nbytes:
        fail(f"{qtype} row", f"a multiple of {nbytes} bytes", raw.shape[-1] if raw.ndim else 0)
    if qtype == "F32":
        return raw.view(np.float32).copy()
    if qtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    if qtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(_gq.dequantize(raw, kind), dtype=np.float32)


def quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """float rows `[..., cols]` -> raw `uint8[..., row_bytes]` in `qtype` (QUANTIZABLE_TYPES)."""
    kind = _kind(qtype)
    if qtype not in QUANTIZABLE_TYPES:
        fail("quantize: type", f"one of {list(QUANTIZABLE_TYPES)}", qtype,
             "the gguf package cannot quantize this type")
    values = np.ascontiguousarray(values, dtype=np.float32)
    row_bytes(qtype, values.shape[-1])  # validates the row length
    if qtype == "F32":
        return values.view(np.uint8)
    if qtype == "F16":
        return values.astype(np.float16).view(np.uint8)
    if qtype == "Q4_K":
        return quantize_q4_k(values)
    return np.asarray(_gq.quantize(values, kind), dtype=np.uint8)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float `[..., cols]` (cols % 256 == 0) -> Q4_K blocks `uint8[..., cols / 256 * 144]`.

    Per 32-value sub-block a scale (max - min) / 15 and a minimum -min(0, min) (Q4_K's offset is
    subtracted, so it cannot be positive), both stored as 6-bit multiples of the super-block's
    f16 d = max scale / 63 and dmin = max minimum / 63; then q = round((x + m) / s) in [0, 15].
    Round to nearest throughout (llama.cpp searches for better scales; this does not).
    """
    x = np.ascontiguousarray(values, dtype=np.float32)
    lead, cols = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0).astype(np.uint8)
        mq = np.where(dmin32 > 0, np.clip(np.rint(mins / dmin32), 0, 63), 0).astype(np.uint8)
        s_eff = (d32 * sc)[..., None]
        m_eff = (dmin32 * mq)[..., None]
        q = np.where(s_eff > 0, np.clip(np.rint((x + m_eff) / s_eff), 0, 15), 0).astype(np.uint8)
    # Scales: bytes 0-3 sc[0..3] | high bits of sc[4..7] << 6; 4-7 the same for the minimums;
    # 8-11 low nibbles of sc[4..7] | low nibbles of m[4..7] << 4.
    packed = np.empty((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mq[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(x.shape[0], 128)  # pairs of sub-blocks
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                             packed, qs], axis=-1)
    return blocks.reshape(*lead, cols // 256 * 144)


# Byte offsets of each block's f16 fields (scales and minimums): random bytes there could be
# inf/NaN, so random blocks get finite values written over them.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


# The largest |quant x sub-scale| product of each format: f16 fields of scale / this keep the
# weights within about +-scale, like a real checkpoint's.
# Down groups: a GGUF ffn_down [D, F] (blocked along F) holds one block per 32 neurons at each row
# d; group g keeps the D blocks of neurons 32g .. 32g + 31 unchanged in value, rearranged so that a
# neuron's weights lie together (cpu_backend/quant_kernels.h AxpyGroup / AxpyPairs, the kernels
# that read them): the blocks' scale fields as planes over D ([D] f16 d, then [D] f16 m for Q4_1 /
# Q5_1), then the quant bytes:
#   Q5_0, Q5_1, Q8_0: 32 neuron rows, each D / 32 runs of the block's quant bytes for 32
#     consecutive d, packed as the format packs a block;
#   Q4_0, Q4_1 (DOWN_PAIR_TYPES): 16 rows of neuron pairs (2p, 2p + 1), each D / 32 runs of 32
#     bytes for 32 consecutive d: byte k holds the 4-bit codes of neuron 2p + k % 2 at d = k // 2
#     (low nibble) and at d = 16 + k // 2 (high nibble), so one 32-byte load gives, per d, the two
#     neurons' codes side by side for an integer multiply-add with their 8-bit activations.
# D * block bytes per group: the file's size, nothing re-quantized.
DOWN_GROUP_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
DOWN_PAIR_TYPES = ("Q4_0", "Q4_1")
# The kernels' name of down groups: the format's with GROUPS_SUFFIX ("Q4_0g32"), its id with
# GROUPS_ID_FLAG (`arrangement`).
GROUPS_SUFFIX = "g32"
GROUPS_ID_FLAG = 0x400
GROUPS_TYPES = tuple(t + GROUPS_SUFFIX for t in DOWN_GROUP_TYPES)
_SCALE_BYTES = {"Q4_0": 2, "Q5_0": 2, "Q8_0": 2, "Q4_1": 4, "Q5_1": 4}


def _unpack_quants(q: np.ndarray, qtype: str) -> np.ndarray:
    """A block's quant bytes [..., bytes] -> its 32 values' codes [..., 32] (uint8; Q8_0's int8
    bytes as they are)."""
    if qtype == "Q8_0":
        return q
    qs = q[..., -16:]
    v = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qtype in ("Q5_0", "Q5_1"):  # qh: bit j (little endian u32) is value j's fifth bit
        v |= np.unpackbits(q[..., :4], axis=-1, bitorder="little") << 4
    return v


def _pack_quants(v: np.ndarray, qtype: str) -> np.ndarray:
    """The inverse of _unpack_quants."""
    if qtype == "Q8_0":
        return v
    qs = (v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)
    if qtype in ("Q5_0", "Q5_1"):
        return np.concatenate([np.packbits((v >> 4) & 1, axis=-1, bitorder="little"), qs], axis=-1)
    return qs


def check_down_groups(qtype: str, d: int, f: int) -> tuple[int, int]:
    """The rule for down groups of a [D, F] ffn_down in `qtype`; (block bytes, scale bytes)."""
    if qtype not in DOWN_GROUP_TYPES:
        fail("down groups type", f"one of {list(DOWN_GROUP_TYPES)} (32-weight blocks)", qtype)
    if d % 32 or f % 32 or d <= 0 or f <= 0:
        fail("down groups shape (D, F)", "positive multiples of 32", (d, f))
    return block_size(qtype)[1], _SCALE_BYTES[qtype]


def down_codes(blocks: np.ndarray, qtype: str, d: int, f: int) -> tuple[np.ndarray, np.ndarray]:
    """ffn_down as the file stores it, uint8 [D, row_bytes(qtype, F)] -> (the down groups' scale
    planes, uint8 [F / 32, scale bytes * D]; every neuron's *code row*, uint8 [F, D / 32 *
    (block bytes - scale bytes)]: its quant bytes along D, D / 32 runs of a block's quant bytes
    for 32 consecutive d, packed as the format packs a block). The pieces of a down group (the
    layout above), split so that a neuron's part lies alone: a neuron store keeps each code row
    in its neuron's bundle and the planes in memory (checkpoint/bundles.py)."""
    nb, sb = check_down_groups(qtype, d, f)
    g = f // 32
    b = np.asarray(blocks, np.uint8)
    if b.shape != (d, g * nb):
        fail(f"ffn_down blocks ({qtype}, D={d}, F={f})", f"uint8 {(d, g * nb)}", b.shape)
    b = b.reshape(d, g, nb)
    planes = b[:, :, :sb].reshape(d, g, sb // 2, 2).transpose(1, 2, 0, 3).reshape(g, sb * d)
    codes = _unpack_quants(b[:, :, sb:], qtype).transpose(1, 2, 0)  # [G, 32 neurons, D]
    rows = _pack_quants(codes.reshape(f, d // 32, 32), qtype).reshape(f, -1)
    return np.ascontiguousarray(planes), np.ascontiguousarray(rows)


def down_groups(blocks: np.ndarray, qtype: str, d: int, f: int) -> np.ndarray:
    """ffn_down as the file stores it, uint8 [D, row_bytes(qtype, F)] -> its down groups, uint8
    [F / 32, D * block bytes] (the layout above): the scale planes, then the 32 neurons' code rows
    (down_codes), for the 4-bit formats as pair rows: byte k of a pair row's run c is byte k // 2
    of run c of neuron 2p + k % 2's code row."""
    planes, rows = down_codes(blocks, qtype, d, f)
    g = f // 32
    if qtype in DOWN_PAIR_TYPES:  # [G, pair, neuron of pair, run, byte] -> [G, pair, run, byte, neuron]
        rows = rows.reshape(g, 16, 2, d // 32, 16).transpose(0, 1, 3, 4, 2)
    return np.concatenate([planes, rows.reshape(g, -1)], axis=1)


def down_groups_to_file(groups: np.ndarray, qtype: str, d: int, f: int) -> np.ndarray:
    """The inverse of down_groups: the file's ffn_down blocks, uint8 [D, row_bytes(qtype, F)]."""
    nb, sb = check_down_groups(qtype, d, f)
    g = f // 32
    b = np.asarray(groups, np.uint8)
    if b.shape != (g, d * nb):
        fail(f"down groups ({qtype}, D={d}, F={f})", f"uint8 {(g, d * nb)}", b.shape)
    planes = b[:, :sb * d].reshape(g, sb // 2, d, 2).transpose(2, 0, 1, 3).reshape(d, g, sb)
    if qtype in DOWN_PAIR_TYPES:
        pairs = b[:, sb * d:].reshape(g, 16, d // 32, 16, 2)  # [G, pair, chunk, d in half, neuron]
        c = np.stack([pairs & 15, pairs >> 4], axis=3)  # [G, pair, chunk, half, d in half, neuron]
        codes = c.transpose(0, 1, 5, 2, 3, 4)  # [G, pair, neuron, chunk, half, d in half]
    else:
        codes = _unpack_quants(b[:, sb * d:].reshape(g, 32, d // 32, nb - sb), qtype)
    quant = _pack_quants(codes.reshape(g, 32, d).transpose(2, 0, 1), qtype)  # [D, G, bytes]
    return np.concatenate([planes, quant], axis=2).reshape(d, g * nb)


# Rows interleaved by 16 (cpu_backend/quant_interleaved.h): what ops.qlinear reads fastest. A
# [O, row_bytes] matrix in one of INTERLEAVE_TYPES, O a multiple of 16, becomes records per
# (group of 16 rows, block), group-major. A block is a run of fields in the file's order, each
# `width` bytes wide (_FIELDS: f16 scales and minimums 2, quants in chunks of 4, Q4_K's packed
# scales in 4-byte words, Q6_K's int8 scales 1); a record holds each field of its 16 rows as one
# plane, row r at width * r, planes in the field order. For the 32-weight formats: the 16 rows'
# f16 scales, for Q4_1 their f16 minimums, then chunks of 4 quant bytes per row (chunk c: bytes
# 4c .. 4c + 3 of each row's quants, row r at 4r). Same bytes, same shape [O, row_bytes]; the
# format's name gains INTERLEAVED_SUFFIX ("Q4_0x16"), its id INTERLEAVED_ID_FLAG, so nothing
# reads the rows as the file's by mistake.
INTERLEAVE = 16
INTERLEAVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
INTERLEAVED_SUFFIX = "x16"
INTERLEAVED_ID_FLAG = 0x100
INTERLEAVED_TYPES = tuple(t + INTERLEAVED_SUFFIX for t in INTERLEAVE_TYPES)
# (bytes, width) runs of a block's fields, in the file's order (quant_interleaved.h Fields)
_FIELDS = {"Q4_0": ((2, 2), (16, 4)), "Q4_1": ((4, 2), (16, 4)), "Q8_0": ((2, 2), (32, 4)),
           "Q5_0": ((2, 2), (20, 4)), "Q5_1": ((4, 2), (20, 4)),  # the fifth bits' word first
           "Q4_K": ((4, 2), (140, 4)),  # d, dmin; 3 words of 6-bit scales, 32 quant chunks
           "Q5_K": ((4, 2), (172, 4)),  # and 8 chunks of fifth bits before the quants
           "Q6_K": ((192, 4), (16, 1), (2, 2))}  # low nibbles and high bits; scales; d


def interleaved_base(qtype: str) -> str | None:
    """The file's format of an interleaved type name ("Q4_0x16" -> "Q4_0"), else None."""
    base, flag = arrangement(qtype)
    return base if flag == INTERLEAVED_ID_FLAG else None


def can_interleave(qtype: str, rows: int) -> bool:
    """Whether a [rows, ...] matrix in qtype has the interleaved layout."""
    return qtype in INTERLEAVE_TYPES and rows > 0 and rows % INTERLEAVE == 0


def interleave_index(qtype: str) -> np.ndarray:
    """int64 [16, block bytes]: where byte k of row r's block lies in its record (the map both
    directions of the layout use): field start s, width w -> INTERLEAVE * s + w * r + k - s."""
    base = interleaved_base(qtype) or qtype
    if base not in INTERLEAVE_TYPES:
        fail("interleaved rows type", f"one of {list(INTERLEAVE_TYPES)}", qtype)
    start, width = [], []
    at = 0
    for nbytes, w in _FIELDS[base]:
        k = np.arange(nbytes)
        start.append(at + k - k % w)
        width.append(np.full(nbytes, w))
        at += nbytes
    assert at == block_size(base)[1]
    s, w = np.concatenate(start)[None, :], np.concatenate(width)[None, :]
    k = np.arange(at)[None, :]
    r = np.arange(INTERLEAVE)[:, None]
    return INTERLEAVE * s + w * r + (k - s)


def _check_interleave(blocks, qtype: str) -> tuple[np.ndarray, int]:
    b = np.asarray(blocks, np.uint8)
    if b.ndim != 2 or not can_interleave(qtype, b.shape[0]):
        fail(f"rows to interleave ({qtype})",
             f"uint8 [O, row_bytes] in one of {list(INTERLEAVE_TYPES)}, O a multiple of "
             f"{INTERLEAVE}", f"{b.dtype} {b.shape}")
    nbytes = block_size(qtype)[1]
    if b.shape[1] % nbytes:
        fail(f"{qtype} row", f"a multiple of {nbytes} bytes", b.shape[1])
    return b, nbytes


def interleave(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The file's rows, uint8 [O, row_bytes] in qtype -> interleaved by 16 (same shape); the
    layout's type is qtype + INTERLEAVED_SUFFIX."""
    b, nbytes = _check_interleave(blocks, qtype)
    o, nb = b.shape[0], b.shape[1] // nbytes
    src = b.reshape(o // INTERLEAVE, INTERLEAVE, nb, nbytes).transpose(0, 2, 1, 3)
    rec = np.empty((o // INTERLEAVE, nb, INTERLEAVE * nbytes), np.uint8)
    rec[:, :, interleave_index(qtype)] = src  # [G, nb, 16, bytes] into the record's positions
    return rec.reshape(o, nb * nbytes)


def deinterleave(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The inverse of interleave: uint8 [O, row_bytes] in the file's layout of qtype (the base
    type or its interleaved name)."""
    base = interleaved_base(qtype) or qtype
    b, nbytes = _check_interleave(blocks, base)
    o, nb = b.shape[0], b.shape[1] // nbytes
    rec = b.reshape(o // INTERLEAVE, nb, INTERLEAVE * nbytes)
    return rec[:, :, interleave_index(base)].transpose(0, 2, 1, 3).reshape(o, nb * nbytes)


# The columns layout (cpu_backend/qcolumns.h): a matrix [O, I] stored input-channel-major, per
# block of the format the rows' scale fields as planes, then each input channel's O codes in tiles
# of 64 rows, so that ops.qlinear reads only the channels whose activation is nonzero. Nothing is
# re-quantized. The kernels' module arranges it (`arrange_columns`); `columns_to_float` here is an
# independent numpy decoder (the ops' reference). Type names gain COLUMNS_SUFFIX ("Q4_0c64"), ids
# COLUMNS_ID_FLAG.
COLUMNS_TILE = 64
COLUMNS_SUFFIX = "c64"
COLUMNS_ID_FLAG = 0x200
# format -> (channels per block, channels per scale group, head bytes per row per block, 8-bit codes)
_COLUMNS_FORMATS = {"Q4_0": (32, 32, 2, False), "Q4_1": (32, 32, 4, False),
                    "Q8_0": (32, 32, 2, True), "Q4_K": (256, 32, 20, False),
                    "Q6_K": (256, 16, 18, True)}
COLUMNS_BASE_TYPES = tuple(_COLUMNS_FORMATS)
COLUMNS_TYPES = tuple(t + COLUMNS_SUFFIX for t in COLUMNS_BASE_TYPES)


def columns_base(qtype: str) -> str | None:
    """The file's format of a columns type name ("Q4_0c64" -> "Q4_0"), else None."""
    base, flag = arrangement(qtype)
    return base if flag == COLUMNS_ID_FLAG else None


def groups_base(qtype: str) -> str | None:
    """The file's format of a down-groups type name ("Q4_0g32" -> "Q4_0"), else None."""
    base, flag = arrangement(qtype)
    return base if flag == GROUPS_ID_FLAG else None


def can_columns(qtype: str, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] matrix in qtype (the file's format) has the columns layout."""
    f = _COLUMNS_FORMATS.get(qtype)
    return f is not None and rows > 0 and rows % COLUMNS_TILE == 0 and cols > 0 and \
        cols % f[0] == 0


def _columns_strides(qtype: str, rows: int) -> tuple[int, int, int]:
    """(head bytes, channel stride, block bytes) of the columns layout: the head planes rounded up
    to 64-byte lines, channels an odd number of lines apart (cpu_backend/qcolumns.cc)."""
    block, _, head, wide = _COLUMNS_FORMATS[columns_base(qtype) or qtype]
    lines = -(-(rows if wide else rows // 2) // 64)
    stride = 64 * (lines + 1 if lines % 2 == 0 else lines)
    head_bytes = -(-head * rows // 64) * 64
    return head_bytes, stride, head_bytes + block * stride


def columns_row_bytes(qtype: str, rows: int, cols: int) -> int:
    """Bytes per row of a [rows, cols] matrix in the columns layout (the layout's bytes over the
    rows, rounded up; qtype: the file's format or its columns name)."""
    block = _COLUMNS_FORMATS[columns_base(qtype) or qtype][0]
    return -(-(cols // block * _columns_strides(qtype, rows)[2]) // rows)


def _tile_rows() -> tuple[np.ndarray, np.ndarray]:
    """The row each byte of a 4-bit tile (low nibble; high: + 32) and of an 8-bit tile holds."""
    k = np.arange(32)
    s = 8 * ((k >> 2) & 3) + 4 * ((k >> 4) & 1) + (k & 3)
    k8 = np.arange(64)
    return s, 32 * (k8 >> 5) + s[k8 & 31]


def columns_to_float(blocks: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """The float32 values [O, cols] of a matrix in the columns layout (qtype: the file's format
    or its columns name), decoded from the layout's description, not from the kernels'."""
    base = columns_base(qtype) or qtype
    block, sub, head, wide = _COLUMNS_FORMATS[base]
    b = np.ascontiguousarray(blocks, np.uint8)
    o = b.shape[0]
    flat = b.reshape(-1)
    head_bytes, stride, bb = _columns_strides(base, o)
    chan = o if wide else o // 2
    s4, s8 = _tile_rows()
    out = np.empty((o, cols), np.float32)
    for k in range(cols // block):
        h = flat[k * bb:k * bb + head * o]
        c = flat[k * bb + head_bytes:(k + 1) * bb].reshape(block, stride)[:, :chan]
        c = c.reshape(block, o // 64, 64 if wide else 32)
        codes = np.empty((block, o // 64, 64), np.int32)
        if wide:
            codes[:, :, s8] = c
        else:
            codes[:, :, s4] = c & 15
            codes[:, :, s4 + 32] = c >> 4
        q = codes.reshape(block, o).T.astype(np.float32)  # [O, block]
        d = h[:2 * o].view(np.float16).astype(np.float32)[:, None]
        if base == "Q4_0":
            w = d * (q - 8)
        elif base == "Q4_1":
            w = d * q + h[2 * o:4 * o].view(np.float16).astype(np.float32)[:, None]
        elif base == "Q8_0":
            w = d * (q.astype(np.int32) ^ 0x80).astype(np.uint8).view(np.int8).astype(np.float32)
        elif base == "Q4_K":
            dmin = h[2 * o:4 * o].view(np.float16).astype(np.float32)[:, None]
            sc = h[4 * o:12 * o].reshape(8, o).T.astype(np.float32)  # [O, 8]
            mn = h[12 * o:20 * o].reshape(8, o).T.astype(np.float32)
            grp = np.arange(block) // sub
            w = (d * sc[:, grp]) * q - dmin * mn[:, grp]
        else:  # Q6_K
            sc = h[2 * o:18 * o].reshape(16, o).T.view(np.int8).astype(np.float32)
            grp = np.arange(block) // sub
            w = (d * sc[:, grp]) * (q - 32)
        out[:, k * block:(k + 1) * block] = w
    return out
