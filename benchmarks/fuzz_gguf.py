"""Mutated GGUF and PowerInfer-GGUF files for the readers (checkpoint/gguf_file.py, gguf.py,
powerinfer.py): hypothesis strategies that corrupt a valid file where it hurts, and the check that
every result is a loaded model or a one-line error.

A seed file is a small valid model written by our own writer (a tiny llama GGUF with Q4_0, Q8_0,
Q4_1, F16 and F32 tensors and a BPE tokenizer; a PowerInfer GGUF with predictors; a PowerInfer
GPU index). `layout` walks its bytes independently of the readers and lists every structural
field (magic, version, counts, string lengths, value and item types, array lengths, tensor dims,
types and offsets, the alignment value), so mutations land on the fields a reader trusts:
  * a field set to a boundary value (0, 1, the file size, 2^31, 2^32 - 1, 2^63, 2^64 - 1, ...),
  * bytes flipped (mostly in the header), a run of bytes inserted or deleted, the file cut short.
`check` runs the readers on the result. Allowed outcomes: the model (or predictors, or index)
loads, or a `ValueError` (UserError, GGUFFormatError) with a one-line message that names the
file. Anything else
(another exception type, a message of several lines) is a finding; a crash or a hang shows up
in benchmarks/fuzz.py, which runs cases in a watched child process.

Used by tests/test_fuzz_inputs.py (a few hundred cases) and benchmarks/fuzz.py (>= 10,000).
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]

TARGETS = ("gguf", "powerinfer-gguf")
_ALIGN_KEY = b"general.alignment"


@dataclass(frozen=True)
class Field:
    offset: int
    size: int  # 4 or 8 bytes, little-endian
    name: str


def write_seeds(out: Path) -> dict[str, list[Path]]:
    """The valid seed files per target, written into `out`."""
    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from helpers_models import gpt2_tokenizer_meta, random_params, tiny_llama_config

    from powerinfer_jax.checkpoint import gguf, powerinfer

    out.mkdir(parents=True, exist_ok=True)
    meta = gpt2_tokenizer_meta()
    config = tiny_llama_config(n_layers=2, d_ff=64)
    types = {"layers.0.ffn.gate.weight": "Q4_0", "layers.0.ffn.up.weight": "Q8_0",
             "layers.0.ffn.down_t.weight": "Q4_1", "layers.1.attn.q.weight": "Q4_0",
             "layers.1.ffn.up.weight": "F16"}
    plain = out / "tiny.gguf"
    gguf.write_gguf(plain, config, random_params(config), meta, types)
    relu = tiny_llama_config(n_layers=2, d_ff=64, activation="relu")
    rng = np.random.default_rng(0)
    preds = powerinfer.PowerInferPredictors(
        tuple(rng.standard_normal((8, relu.d_model)).astype(np.float32) for _ in range(2)),
        tuple(rng.standard_normal((relu.d_ff, 8)).astype(np.float32) for _ in range(2)), 0.0)
    pwri = out / "tiny.powerinfer.gguf"
    powerinfer.write_powerinfer_gguf(pwri, relu, random_params(relu), meta, preds,
                                     weight_type="F32")
    idx = out / "tiny.generated.gpuidx"
    powerinfer.write_gpu_index(idx, [np.arange(0, 64, 3), np.arange(5, 40)], relu.d_ff, 4096)
    return {"gguf": [plain], "powerinfer-gguf": [pwri, idx]}


# ------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class Layout:
    """A valid GGUF's structure: its fields, each metadata entry's span (key start, value start,
    end), the tensor table's span and where the data section starts."""

    fields: tuple[Field, ...]
    kvs: tuple[tuple[int, int, int], ...]
    table: tuple[int, int]
    data_start: int
    alignment: int


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def layout(data: bytes) -> Layout:
    """Walk a valid GGUF `data` (written independently of the readers under test)."""
    fields: list[Field] = [Field(0, 4, "magic"), Field(4, 4, "version"),
                           Field(8, 8, "n_tensors"), Field(16, 8, "n_kv")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    off = 24
    alignment = 32

    def string(what: str) -> bytes:
        nonlocal off
        (n,) = struct.unpack_from("<Q", data, off)
        fields.append(Field(off, 8, f"{what} length"))
        off += 8 + n
        return data[off - n:off]

    def value(vtype: int, what: str) -> None:
        nonlocal off, alignment
        if vtype == 8:
            string(what)
        elif vtype == 9:
            fields.append(Field(off, 4, f"{what} item type"))
            fields.append(Field(off + 4, 8, f"{what} count"))
            item, count = struct.unpack_from("<IQ", data, off)
            off += 12
            for _ in range(count):
                value(item, what + " item")
        else:
            if _SIZES[vtype] >= 4:
                fields.append(Field(off, _SIZES[vtype], f"{what} value"))
            if what == "general.alignment":
                alignment = int.from_bytes(data[off:off + _SIZES[vtype]], "little")
            off += _SIZES[vtype]

    kvs = []
    for _ in range(n_kv):
        start = off
        key = string("key").decode()
        fields.append(Field(off, 4, f"{key} value type"))
        (vtype,) = struct.unpack_from("<I", data, off)
        off += 4
        value(vtype, key)
        kvs.append((start, start + 8 + len(key.encode()), off))
    table_start = off
    for i in range(n_tensors):
        string(f"tensor {i} name")
        fields.append(Field(off, 4, f"tensor {i} n_dims"))
        (n_dims,) = struct.unpack_from("<I", data, off)
        off += 4
        for d in range(n_dims):
            fields.append(Field(off, 8, f"tensor {i} ne[{d}]"))
            off += 8
        fields.append(Field(off, 4, f"tensor {i} type"))
        fields.append(Field(off + 4, 8, f"tensor {i} offset"))
        off += 12
    data_start = -(-off // alignment) * alignment
    return Layout(tuple(fields), tuple(kvs), (table_start, off), data_start, alignment)


def header_end(lay: Layout) -> int:
    return lay.table[1]


# ------------------------------------------------------------------------------------ mutations
def _boundaries(size: int, file_size: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    vals = [0, 1, 2, 3, 7, 8, 13, 31, 32, 33, 255, 256, 4095, 4096, 65535, 65536,
            file_size - 1, file_size, file_size + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
            top, top - 1, top // 2, top // 2 + 1]
    if size == 8:
        vals += [1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, 1 << 63]
    return sorted({v & top for v in vals})


_INT_TYPES = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _int_value(vtype: int):
    fmt = _INT_TYPES[vtype]
    bits = 8 * struct.calcsize(fmt)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt[1].islower() else (0,
                                                                                  (1 << bits) - 1)
    edges = sorted({v for v in (0, 1, 2, 3, 4, 7, 64, 255, 65535, 1 << 31, lo, hi, -1, -2)
                    if lo <= v <= hi})
    return (st.sampled_from(edges) | st.integers(lo, hi)).map(lambda v: struct.pack(fmt, v))


_SPECIAL_FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("inf"), float("-inf"),
                   float("nan")]


def _scalar_value(vtype: int):
    if vtype in _INT_TYPES:
        return _int_value(vtype)
    if vtype in (6, 12):
        fmt = "<f" if vtype == 6 else "<d"
        return (st.sampled_from(_SPECIAL_FLOATS) | st.floats(width=32 if vtype == 6 else 64)
                ).map(lambda v: struct.pack(fmt, v))
    if vtype == 7:
        return st.integers(0, 255).map(lambda v: bytes([v]))
    return st.text(max_size=24).map(_gguf_string)


def _gguf_string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def typed_values():
    """Strategy of (value type id, encoded value): any scalar, a string, an array of them."""
    scalar_type = st.sampled_from(sorted(_SIZES) + [8])
    scalar = scalar_type.flatmap(lambda t: st.tuples(st.just(t), _scalar_value(t)))
    array = scalar_type.flatmap(lambda t: st.lists(_scalar_value(t), max_size=12).map(
        lambda items: (9, struct.pack("<IQ", t, len(items)) + b"".join(items))))
    return scalar | array


def nest(depth: int) -> bytes:
    """An array header nesting `depth` one-item arrays around the array that follows it."""
    return struct.pack("<IQ", 9, 1) * depth


def mutations(data: bytes, lay: Layout):
    """A strategy of mutated copies of `data` (1 to 4 mutations each)."""
    end = header_end(lay)
    size = len(data)
    fields = list(lay.fields)
    field = st.sampled_from(fields).flatmap(lambda f: st.tuples(
        st.just("field"), st.just(f), st.sampled_from(_boundaries(f.size, size))
        | st.integers(0, (1 << (8 * f.size)) - 1)))
    where = st.integers(0, end - 1) | st.integers(0, size - 1)  # mostly the header
    flip = st.tuples(st.just("flip"), where, st.integers(1, 255))
    cut = st.tuples(st.just("cut"), st.integers(0, end) | st.integers(end, size - 1),
                    st.none())
    insert = st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16))
    delete = st.tuples(st.just("delete"), where, st.integers(1, 16))
    raw = st.one_of(field, field, flip, cut, insert, delete)
    # structure-aware: one metadata value replaced (any type) or dropped, or an array nested
    kv = st.integers(0, len(lay.kvs) - 1)
    retype = st.tuples(st.just("retype"), kv, typed_values())
    drop = st.tuples(st.just("drop"), kv, st.none())
    arrays = [f for f in fields if f.name.endswith(" item type") and f.name.count(" item") == 1]
    nested = st.tuples(st.just("nest"), st.sampled_from(arrays) if arrays else st.nothing(),
                       st.integers(2, 3000))
    semantic = st.one_of(retype, retype, drop, nested)
    return st.tuples(st.lists(semantic, max_size=2), st.lists(raw, max_size=3)).filter(
        lambda ms: ms[0] or ms[1]).map(lambda ms: apply(apply_semantic(data, lay, ms[0]), ms[1]))


def apply_semantic(data: bytes, lay: Layout, ms) -> bytes:
    """`data` rebuilt with metadata entries replaced (retype), removed (drop) or an array
    nested (nest); the tensor table and data follow, the data section re-aligned."""
    if not ms:
        return data
    kvs = [[data[s:v], data[v:e]] for s, v, e in lay.kvs]  # [key bytes, type + value bytes]
    nests = {}
    for kind, which, arg in ms:
        if kvs[which if isinstance(which, int) else 0] is None:
            continue
        if kind == "retype":
            vtype, value = arg
            kvs[which][1] = struct.pack("<I", vtype) + value
        elif kind == "drop":
            kvs[which] = None
        else:
            nests[which.offset] = arg
    for f_off, depth in nests.items():  # inside an entry: find it by its span
        for i, (s, v, e) in enumerate(lay.kvs):
            if kvs[i] is not None and v <= f_off < e and kvs[i][1] == data[v:e]:
                at = f_off - v
                kvs[i][1] = kvs[i][1][:at] + nest(depth) + kvs[i][1][at:]
    kept = [k for k in kvs if k is not None]
    head = data[:16] + struct.pack("<Q", len(kept)) + b"".join(k + v for k, v in kept)
    head += data[lay.table[0]:lay.table[1]]
    pad = -len(head) % lay.alignment
    return head + b"\0" * pad + data[lay.data_start:]


def apply(data: bytes, ms) -> bytes:
    """`data` with the byte-level mutations `ms` applied in order (each within the bytes left)."""
    b = bytearray(data)
    for kind, where, arg in ms:
        if kind == "field":
            f = where
            if f.offset + f.size <= len(b):
                b[f.offset:f.offset + f.size] = arg.to_bytes(f.size, "little")
        elif not b:
            break
        elif kind == "flip":
            b[where % len(b)] ^= arg
        elif kind == "cut":
            del b[where:]
        elif kind == "insert":
            b[where % len(b):where % len(b)] = arg
        elif kind == "delete":
            del b[where % len(b):where % len(b) + arg]
    return bytes(b)


# ------------------------------------------------------------------------------------ the check
def read(path: Path, target: str) -> str:
    """Run the readers a user's command runs on `path`; returns what loaded."""
    from powerinfer_jax.checkpoint import gguf, powerinfer

    if path.name.endswith(".gpuidx"):
        sys.path.insert(0, str(REPO / "tests"))
        from helpers_models import tiny_llama_config

        powerinfer.load_gpu_index(path, tiny_llama_config(n_layers=2, d_ff=64))
        return "gpu index"
    config = gguf.read_config(path)
    ckpt = gguf.load_gguf(path, keep_quantized=True)
    ckpt.tokenizer.decode(ckpt.tokenizer.encode("Hello world, the fox 12345"))
    gguf.load_gguf(path)  # every tensor dequantized to float32
    if target == "powerinfer-gguf":
        powerinfer.load_predictors(path, config)
        return "model and predictors"
    return "model"


def check(path: Path, target: str) -> tuple[str, str]:
    """("ok", what loaded) | ("error", the one-line message) | ("finding", what went wrong)."""
    try:
        return "ok", read(path, target)
    except ValueError as e:  # UserError, GGUFFormatError
        msg = str(e)
        if not msg or "\n" in msg:
            return "finding", f"{type(e).__name__} of {msg.count(chr(10)) + 1} lines: {msg[:300]}"
        if path.name not in msg:
            return "finding", f"{type(e).__name__} without the file's name: {msg[:300]}"
        return "error", msg
    except Exception as e:  # noqa: BLE001 (any other exception is what the fuzzer looks for)
        return "finding", f"{type(e).__name__}: {str(e)[:300]}"
