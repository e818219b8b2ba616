"""Test helpers for GGML block formats: an independent per-element decoder written from llama.cpp's
reference dequantize_row_* (ggml-quants.c), and `random_blocks` (valid random blocks)."""
from __future__ import annotations

import numpy as np

from powerinfer_jax.checkpoint.quants import F16_FIELDS, block_size


def _f16(b, off):
    return float(np.frombuffer(bytes(b[off:off + 2]), np.float16)[0])


def _k4_scale_min(j, q):  # llama.cpp's get_scale_min_k4
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def decode_block(qtype: str, b: np.ndarray) -> np.ndarray:
    """One block's values, element by element (slow; a second implementation to check against)."""
    b = [int(v) for v in b]
    y = []
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b, 0)
        if qtype == "Q8_0":
            return np.array([d * (v - 256 if v > 127 else v) for v in b[2:34]], np.float64)
        m = _f16(b, 2) if qtype in ("Q4_1", "Q5_1") else None
        qh = 0
        if qtype in ("Q5_0", "Q5_1"):
            off = 2 if qtype == "Q5_0" else 4
            qh = b[off] | b[off + 1] << 8 | b[off + 2] << 16 | b[off + 3] << 24
            qs = b[off + 4:off + 20]
        else:
            qs = b[2:18] if qtype == "Q4_0" else b[4:20]
        for j in range(32):
            q = (qs[j] & 0xF) if j < 16 else (qs[j - 16] >> 4)
            if qtype in ("Q5_0", "Q5_1"):
                q |= ((qh >> j) & 1) << 4
            offset = {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
            y.append(d * (q - offset) + (m if m is not None else 0.0))
        return np.array(y, np.float64)
    if qtype == "Q2_K":
        scales, qs, d, dmin = b[0:16], b[16:80], _f16(b, 80), _f16(b, 82)
        y = [0.0] * 256
        is_ = 0
        for n in range(2):
            q = qs[32 * n:32 * n + 32]
            for j in range(4):
                for half in range(2):
                    sc = scales[is_]
                    is_ += 1
                    for l in range(16):
                        y[128 * n + 32 * j + 16 * half + l] = \
                            d * (sc & 0xF) * ((q[16 * half + l] >> (2 * j)) & 3) - dmin * (sc >> 4)
        return np.array(y, np.float64)
    if qtype == "Q3_K":
        hmask, qs, sb, d = b[0:32], b[32:96], b[96:108], _f16(b, 108)
        sc = []
        for i in range(16):
            low = (sb[i] & 0xF) if i < 8 else (sb[i - 8] >> 4)
            high = (sb[8 + i % 4] >> (2 * (i // 4))) & 3
            sc.append((low | high << 4) - 32)
        y = [0.0] * 256
        for n in range(2):
            for j in range(4):
                m = 4 * n + j
                for l in range(32):
                    q = ((qs[32 * n + l] >> (2 * j)) & 3) - (0 if (hmask[l] >> m) & 1 else 4)
                    e = 128 * n + 32 * j + l
                    y[e] = d * sc[e // 16] * q
        return np.array(y, np.float64)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin, sb = _f16(b, 0), _f16(b, 2), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if qtype == "Q5_K" else (None, b[16:144])
        y = [0.0] * 256
        for s in range(8):
            sc, m = _k4_scale_min(s, sb)
            for l in range(32):
                q = (qs[32 * (s // 2) + l] >> (4 * (s % 2))) & 0xF
                if qh is not None:
                    q |= ((qh[l] >> s) & 1) << 4
                y[32 * s + l] = d * sc * q - dmin * m
        return np.array(y, np.float64)
    if qtype == "Q6_K":
        ql, qh, sc, d = b[0:128], b[128:192], b[192:208], _f16(b, 208)
        sc = [v - 256 if v > 127 else v for v in sc]
        y = [0.0] * 256
        for n in range(2):
            for l in range(32):
                is_ = l // 16
                L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
                q1 = ((L[l] & 0xF) | ((H[l] >> 0) & 3) << 4) - 32
                q2 = ((L[l + 32] & 0xF) | ((H[l] >> 2) & 3) << 4) - 32
                q3 = ((L[l] >> 4) | ((H[l] >> 4) & 3) << 4) - 32
                q4 = ((L[l + 32] >> 4) | ((H[l] >> 6) & 3) << 4) - 32
                y[128 * n + l] = d * S[is_] * q1
                y[128 * n + l + 32] = d * S[is_ + 2] * q2
                y[128 * n + l + 64] = d * S[is_ + 4] * q3
                y[128 * n + l + 96] = d * S[is_ + 6] * q4
        return np.array(y, np.float64)
    raise ValueError(qtype)


_RANGE = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 127, "Q2_K": 45, "Q3_K": 128,
          "Q4_K": 945, "Q5_K": 1953, "Q6_K": 4096}


def random_blocks(qtype: str, rows: int, cols: int, rng, scale: float = 0.1) -> np.ndarray:
    """Valid random blocks for tests (any type, K-quants included, which nothing
    here can quantize): uint8 [rows, row_bytes] of random quants and packed scales with finite
    f16 fields, weights within about +-scale."""
    block, nbytes = block_size(qtype)
    nb = cols // block
    b = rng.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        v = (rng.uniform(0.2, 1.0, size=(rows, nb)) * scale / _RANGE[qtype]
             * rng.choice([-1, 1], size=(rows, nb)))
        b[..., off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * nbytes)
