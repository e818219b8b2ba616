"""What a GPU burst (benchmarks/gpu/burst.py) brings back, within the remote runner's limits: at most 8
files, each <= 16 MiB, <= 64 MiB together, names of [A-Za-z0-9._-], at most 2 folders deep.

  ffn_delta.000.bin ...   one byte stream cut into shards of <= SHARD_BYTES: per FFN matrix the
      change from the teacher (student - teacher, float32 [L, F, D]) as GGUF blocks along D
      (DELTA_QTYPES), then the trained norm scales (float32) when the run trained them
  burst.json      the run's log: config, tokens seen, loss and sparsity curve, tokens/s, time
      split, FATReLU threshold, evaluation, the teacher's sha256, where each tensor lies in the
      stream ("tensors") and each shard's size and sha256 ("shards")

SmolLM2: gate and up in Q5_0 (18.2 MB each), down_t in Q8_0 (28.2 MB): 64.7 MB (61.7 MiB) in 4
shards, with room for the logs (and burst.log, which train_burst.sh writes beside them).
Why a delta: the student's FFN in bfloat16 is 159 MB and in Q8_0 85 MB, over the limit; 4-5 bit
blocks of the weights themselves would add their rounding error (~4-9% of the weights) on top of
the teacher's own Q4_1 error, while blocks of the change round only the change: a few percent of
the weights for gate and up, more for down after the least-squares refit (hence Q8_0 there; the
dry run measured Q4_0 on down costing ~9% perplexity on a freshly refit student). The burst
logs the change's relative size and the perplexity of the student rebuilt from these files. The
teacher is the GGUF both sides load (its sha256 is checked), dequantized by the same code.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint import quants
from powerinfer_jax.errors import check, fail

MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
MAX_TOTAL_BYTES = 64 << 20
MAX_DEPTH = 2  # folders below the output directory
SHARD_BYTES = MAX_FILE_BYTES - (1 << 10)  # 4 shards for SmolLM2's 64.7 MB
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
DELTA_QTYPES = {"gate": "Q5_0", "up": "Q5_0", "down_t": "Q8_0"}  # canonical ffn.<m>.weight
LOG = "burst.json"
SHARD = "ffn_delta.{:03d}.bin"


def encode_delta(student_lfd: np.ndarray, teacher_lfd: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF blocks uint8 [L, F, row bytes] of student - teacher (float32 [L, F, D])."""
    delta = np.asarray(student_lfd, np.float32) - np.asarray(teacher_lfd, np.float32)
    return quants.quantize(delta, qtype)


def decode_delta(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [L, F, D] from encode_delta's blocks."""
    return quants.dequantize(np.asarray(blocks, np.uint8), qtype)


def stacked(params: dict, matrix: str, n_layers: int) -> np.ndarray:
    """float32 [L, F, D] of ffn.<matrix>.weight over the layers of canonical `params`."""
    return np.stack([np.asarray(params[f"layers.{i}.ffn.{matrix}.weight"], np.float32)
                     for i in range(n_layers)])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(path: Path) -> str:
    """sha256 of a model file, or of a model directory's config and weight files (name and
    sha256 of each, sorted): what ties a burst to its teacher."""
    path = Path(path)
    if path.is_file():
        return sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors")):
        h.update(f"{f.name}:{sha256(f)}\n".encode())
    return h.hexdigest()


def write(out: Path, student: dict, teacher: dict, n_layers: int, log: dict,
          norms: dict | None = None) -> dict:
    """Write the burst's files into `out` (see the module docstring), replacing earlier shards;
    returns the log as written (with "tensors", "shards" and "delta_relative_norm": per matrix
    ||student - teacher|| / ||teacher||)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts, tensors, rel, offset = [], [], {}, 0
    for m, qtype in DELTA_QTYPES.items():
        s, t = stacked(student, m, n_layers), stacked(teacher, m, n_layers)
        rel[m] = float(np.linalg.norm(s - t) / max(np.linalg.norm(t), 1e-30))
        blocks = encode_delta(s, t, qtype)
        tensors.append({"name": f"ffn.{m}", "qtype": qtype, "shape": list(s.shape),
                        "offset": offset, "bytes": int(blocks.nbytes)})
        parts.append(blocks.reshape(-1))
        offset += blocks.nbytes
    for name, value in sorted((norms or {}).items()):
        v = np.ascontiguousarray(value, np.float32)
        tensors.append({"name": name, "qtype": "F32", "shape": list(v.shape), "offset": offset,
                        "bytes": int(v.nbytes)})
        parts.append(v.view(np.uint8).reshape(-1))
        offset += v.nbytes
    stream = np.concatenate(parts)
    for old in out.glob("ffn_delta.*.bin"):
        old.unlink()
    shards = []
    for i, start in enumerate(range(0, stream.size, SHARD_BYTES)):
        path = out / SHARD.format(i)
        stream[start:start + SHARD_BYTES].tofile(path)
        shards.append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
    log = {**log, "tensors": tensors, "shards": shards, "delta_relative_norm": rel}
    (out / LOG).write_text(json.dumps(log, indent=1))
    check_limits(out)
    return log


def check_limits(out: Path) -> dict:
    """The remote runner's limits on what comes back from $OUT; returns {"files", "bytes"}."""
    out = Path(out)
    paths = [p for p in out.rglob("*")]
    files = [p for p in paths if p.is_file()]
    for p in paths:
        rel = p.relative_to(out)
        check(bool(NAME.match(p.name)), f"burst output {rel}", "a name of [A-Za-z0-9._-]", p.name)
        check(not p.is_symlink() and (p.is_file() or p.is_dir()), f"burst output {rel}",
              "a plain file or folder", "a link or special file")
        depth = len(rel.parts) - (1 if p.is_file() else 0)
        check(depth <= MAX_DEPTH, f"burst output {rel}", f"at most {MAX_DEPTH} folders deep",
              depth)
        if p.is_file():
            check(p.stat().st_size <= MAX_FILE_BYTES, f"burst output {rel}",
                  f"at most {MAX_FILE_BYTES} bytes", p.stat().st_size)
    total = sum(p.stat().st_size for p in files)
    check(len(files) <= MAX_FILES, f"burst output {out}", f"at most {MAX_FILES} files",
          len(files))
    check(total <= MAX_TOTAL_BYTES, f"burst output {out}", f"at most {MAX_TOTAL_BYTES} bytes",
          total)
    return {"files": len(files), "bytes": total}


def read(directory: Path, teacher: dict, n_layers: int) -> tuple[dict, dict]:
    """(params, log): the teacher's canonical params with the burst's FFN deltas and norms applied,
    after checking every shard against the log's size and sha256."""
    directory = Path(directory)
    log_path = directory / LOG
    if not log_path.is_file():
        fail("burst_import DIR", f"a burst output folder with {LOG}", str(directory))
    log = json.loads(log_path.read_text())
    if not log.get("shards") or not log.get("tensors"):
        fail(f"burst log {log_path}", "'shards' and 'tensors' entries", sorted(log),
             "the burst stopped before writing its weights (see burst.log)")
    chunks = []
    for meta in log["shards"]:
        path = directory / meta["name"]
        if not path.is_file() or path.stat().st_size != meta["bytes"] or \
                sha256(path) != meta["sha256"]:
            fail(f"burst file {path}", f"{meta['bytes']} bytes with sha256 {meta['sha256']}",
                 "a missing or changed file", "copy the burst's output folder again")
        chunks.append(np.fromfile(path, np.uint8))
    stream = np.concatenate(chunks)
    params = dict(teacher)
    for t in log["tensors"]:
        raw = stream[t["offset"]:t["offset"] + t["bytes"]]
        if t["qtype"] == "F32":
            value = raw.view(np.float32).reshape(t["shape"])
            if t["name"] not in teacher or np.shape(teacher[t["name"]]) != value.shape:
                fail(f"burst tensor {t['name']}", "a norm scale of the teacher's names and shapes",
                     t["shape"])
            params[t["name"]] = value.copy()
            continue
        m = t["name"].removeprefix("ffn.")
        base = stacked(teacher, m, n_layers)
        rows = int(np.prod(t["shape"][:-1]))
        delta = decode_delta(raw.reshape(rows, -1), t["qtype"]).reshape(t["shape"])
        if delta.shape != base.shape:
            fail(f"burst tensor {t['name']}", f"a delta of shape {base.shape}", delta.shape,
                 "made from another model")
        for i in range(n_layers):
            params[f"layers.{i}.ffn.{m}.weight"] = base[i] + delta[i]
    return params, log
