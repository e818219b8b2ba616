"""PowerInfer's files (SJTU-IPADS/PowerInfer at d3ebd7c: convert.py, powerinfer-py, llama.cpp):
its model GGUF with predictors, its activation statistics and its GPU index.

`*.powerinfer.gguf`: a GGUF v3 whose first four bytes read "PWRI" (gguf.py reads and writes the
model; `write_powerinfer_gguf` adds what PowerInfer needs). Per layer a predictor, fc1 -> ReLU ->
fc2 without biases: `blk.i.fc1.weight` [R, D] and `blk.i.fc2.weight` [F, R] (numpy order). Its
input is NOT our FFN input: llama/bamboo/opt feed it the residual after attention, before
ffn_norm (llama.cpp `build_llama_variants`/`build_opt`: `ffn_inp`), falcon the block input
(`inpL`); in both cases the tensor the FFN's norm normalizes (sparsity/powerinfer_predictor.py
runs it there). Neuron i is computed when fc2's output i >= `powerinfer.sparse_threshold`
(float32, default 0; ggml.c skips `sparse_idx[i] < threshold`).

`activation/activation_<i>.pt`: torch-saved 1-D tensors, per layer the activation count of each
neuron (powerinfer-py's solver input). Read with torch (optional: a clear error without it); the
files are ordered by their number, not as text (PowerInfer's export_split.py sorts the names as
text, so with 10+ layers layer 10 gets layer 2's statistics: issue #247).

`<model>.generated.gpuidx`: a GGUF patched to "PWRI", arch "generic.gpu_index", u64
`split.vram_capacity` (bytes the split needs), and per layer, read by position, `blk.i.gpu_idx`
(I32 [F], 1 = neuron on the GPU) then `blk.i.gpu_bucket` (I32, the GPU neurons' indices, sorted).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from powerinfer_jax.checkpoint import gguf as _gguf
from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import UserError, fail

SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"
VRAM_CAPACITY_KEY = "split.vram_capacity"
GPU_INDEX_ARCH = "generic.gpu_index"


@dataclasses.dataclass(frozen=True)
class PowerInferPredictors:
    """Per layer fc1 [R_l, D] and fc2 [F, R_l] (float32 arrays, or `QuantTensor`s of the file's
    blocks from `load_predictors(keep_quantized=True)`), and the file's sparse threshold."""

    fc1: tuple[np.ndarray, ...]
    fc2: tuple[np.ndarray, ...]
    threshold: float = 0.0

    def check(self, config: ModelConfig, source: str) -> None:
        """Shapes match the model: one predictor per layer, fc1 [R, D], fc2 [F, R]."""
        if len(self.fc1) != config.n_layers or len(self.fc2) != config.n_layers:
            fail(f"{source}: predictors", f"one per layer ({config.n_layers})",
                 f"{len(self.fc1)} fc1 and {len(self.fc2)} fc2")
        for i, (a, b) in enumerate(zip(self.fc1, self.fc2)):
            a_shape, b_shape = tuple(a.shape), tuple(b.shape)
            r = a_shape[0] if len(a_shape) == 2 else -1
            if len(a_shape) != 2 or a_shape[1] != config.d_model:
                fail(f"{source}: blk.{i}.fc1.weight shape", f"[R, D = {config.d_model}]",
                     a_shape, "a predictor for another model")
            if b_shape != (config.d_ff, r):
                fail(f"{source}: blk.{i}.fc2.weight shape", f"[F, R] = {(config.d_ff, r)}",
                     b_shape, "a predictor for another model")
        if not np.isfinite(self.threshold):
            fail(f"{source}: {SPARSE_THRESHOLD_KEY}", "a finite float", self.threshold)


def load_predictors(path: str | os.PathLike, config: ModelConfig | None = None, *,
                    keep_quantized: bool = False) -> PowerInferPredictors:
    """The predictors of a PowerInfer GGUF (checked against `config` when given). keep_quantized:
    block-quantized fc1/fc2 (PowerInfer's `quantize` writes them in the model's type) stay
    `QuantTensor`s, for the predictor to compute on the file's blocks as PowerInfer does."""
    path = Path(path)
    source = f"PowerInfer GGUF {str(path)!r}"
    reader = _gguf._open(path)
    meta = _gguf.read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    n_layers = config.n_layers if config is not None else int(
        meta.get(f"{meta.get('general.architecture')}.block_count", 0))
    fc1, fc2 = [], []
    for i in range(n_layers):
        for name, out in ((f"blk.{i}.fc1.weight", fc1), (f"blk.{i}.fc2.weight", fc2)):
            t = tensors.get(name)
            if t is None:
                fail(f"{source}: tensor {name!r}", "present (a predictor per layer)", None,
                     "the file has no predictors: it is a dense GGUF, not a PowerInfer one")
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            out.append(_gguf._read_stored(t, shape, source, keep_quantized))
    threshold = float(meta.get(SPARSE_THRESHOLD_KEY, 0.0))
    preds = PowerInferPredictors(tuple(fc1), tuple(fc2), threshold)
    if config is not None:
        preds.check(config, source)
    return preds


def write_powerinfer_gguf(path: str | os.PathLike, config: ModelConfig,
                          params: Mapping[str, np.ndarray], tokenizer_meta: Mapping[str, Any],
                          predictors: PowerInferPredictors, *, weight_type: str = "F16",
                          predictor_type: str | None = None) -> Path:
    """A `*.powerinfer.gguf` PowerInfer's `main` loads: our model in its layout ("PWRI" magic,
    `ffn_down_t`, an explicit `output.weight`), the predictors, and the sparse threshold.

    weight_type: the matrices' GGML type. PowerInfer's CPU sparse kernels read F16 (and Q4_0)
    down rows only (ggml.c `ggml_compute_forward_mul_mat_axpy` treats any other type as F16), so
    "F16" (its converter's default) is the one its `main` runs correctly; F32 is for our own round
    trips. predictor_type: fc1/fc2's type (default: weight_type, as its converter writes them).
    """
    source = f"write_powerinfer_gguf {str(path)!r}"
    predictors.check(config, source)
    if config.arch == "falcon" and config.bias:
        fail(f"{source}: config.bias", "False for falcon (PowerInfer's falcon has no biases)",
             config.bias)
    ptype = predictor_type or weight_type
    extra, types = {}, {}
    for i, (a, b) in enumerate(zip(predictors.fc1, predictors.fc2)):
        for name, arr in ((f"blk.{i}.fc1.weight", a), (f"blk.{i}.fc2.weight", b)):
            extra[name] = np.asarray(arr, np.float32)
            types[name] = ptype
    names = {n: weight_type for n in params if np.ndim(params[n]) == 2}
    return _gguf.write_gguf(path, config, params, tokenizer_meta, {**names, **types},
                            powerinfer=True, extra_tensors=extra,
                            extra_meta={SPARSE_THRESHOLD_KEY: float(predictors.threshold)})


def all_active_predictors(config: ModelConfig, rank: int = 32) -> PowerInferPredictors:
    """Zero predictors: every output is 0 >= threshold 0, so every neuron is computed. PowerInfer's
    sparse graph needs predictors; these make it run the dense FFN through its sparse kernels
    (the predictor-free comparison). rank 32: one block of the 4- and 8-bit formats, so that
    PowerInfer's `quantize` can block fc2's rows (it writes a 16-wide Q4_0 row unchecked, a file
    no reader can parse)."""
    d, f = config.d_model, config.d_ff
    return PowerInferPredictors(tuple(np.zeros((rank, d), np.float32) for _ in range(config.n_layers)),
                                tuple(np.zeros((f, rank), np.float32) for _ in range(config.n_layers)),
                                0.0)


# ------------------------------------------------------------------------ activation statistics
_ACTIVATION_FILE = re.compile(r"^activation_(\d+)\.pt$")


def _torch(what: str):
    try:
        import torch
    except ImportError as e:
        raise UserError(f"{what}: expected the torch package to read PowerInfer's .pt files, got "
                        "none installed (pip install torch)") from e
    return torch


def load_activation_profile(directory: str | os.PathLike, config: ModelConfig | None = None
                            ) -> list[np.ndarray]:
    """Per layer activation counts [F] (float64) from `activation_<i>.pt`, layers in numeric
    order; every layer 0..L-1 must be present (L from `config`, else the files found)."""
    d = Path(directory)
    source = f"PowerInfer activation directory {str(d)!r}"
    if not d.is_dir():
        fail(source, "an existing directory of activation_<layer>.pt files", str(d))
    found = {int(m.group(1)): d / f for f in os.listdir(d) if (m := _ACTIVATION_FILE.match(f))}
    n_layers = config.n_layers if config is not None else len(found)
    missing = [i for i in range(n_layers) if i not in found]
    if missing or not found:
        fail(f"{source}: file {str(d / f'activation_{missing[0] if missing else 0}.pt')!r}",
             f"activation_0.pt .. activation_{max(n_layers, 1) - 1}.pt, one per layer",
             "missing", "the statistics are incomplete or for another model")
    torch = _torch(source)
    out = []
    for i in range(n_layers):  # numeric order: PowerInfer's own text sort is its bug #247
        f = found[i]
        try:
            t = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types on bad bytes
            raise UserError(f"{source}: file {str(f)!r}: expected a torch-saved tensor, got one "
                            f"that cannot be loaded ({type(e).__name__}: {e})") from e
        a = t.detach().cpu().double().numpy() if hasattr(t, "detach") else np.asarray(t)
        want = (config.d_ff,) if config is not None else None
        if a.ndim != 1 or (want is not None and a.shape != want) or not np.all(np.isfinite(a)) \
                or np.any(a < 0):
            fail(f"{source}: file {str(f)!r}", f"a 1-D tensor of {want or 'F'} finite counts >= 0",
                 f"shape {a.shape}", "statistics for another model")
        out.append(a.astype(np.float64))
    return out


def write_activation_profile(directory: str | os.PathLike,
                             frequency: Sequence[np.ndarray]) -> Path:
    """`activation_<i>.pt` files (float32 tensors), as PowerInfer's profiler leaves them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch = _torch(f"write_activation_profile {str(d)!r}")
    for i, f in enumerate(frequency):
        torch.save(torch.tensor(np.asarray(f, np.float32)), d / f"activation_{i}.pt")
    return d


# --------------------------------------------------------------------------------- GPU index
@dataclasses.dataclass(frozen=True)
class GpuIndex:
    """A `.gpuidx` file: per layer the neurons on the GPU (sorted), and the bytes they need."""

    hot: tuple[np.ndarray, ...]  # per layer int64 indices of GPU neurons, sorted
    d_ff: tuple[int, ...]
    vram_capacity: int
    source: str


def load_gpu_index(path: str | os.PathLike, config: ModelConfig) -> GpuIndex:
    """Read and validate a `.gpuidx` against the model it is applied to."""
    path = Path(path)
    source = f"PowerInfer GPU index {str(path)!r}"
    if not path.is_file():
        fail(source, "an existing file", str(path))
    if _gguf.file_magic(path) != _gguf.PWRI_MAGIC:
        fail(f"{source}: magic", repr(_gguf.PWRI_MAGIC), _gguf.file_magic(path))
    reader = _gguf._open(path)
    meta = _gguf.read_metadata(reader)
    if meta.get("general.architecture") != GPU_INDEX_ARCH:
        fail(f"{source}: general.architecture", repr(GPU_INDEX_ARCH),
             meta.get("general.architecture"))
    if VRAM_CAPACITY_KEY not in meta:
        fail(f"{source}: metadata key {VRAM_CAPACITY_KEY!r}", "present", None)
    tensors = list(reader.tensors)
    if len(tensors) != 2 * config.n_layers:  # PowerInfer's own check (llama.cpp)
        fail(f"{source}: tensors", f"2 per layer of the model ({2 * config.n_layers})",
             len(tensors), "the index belongs to another model")
    hot = []
    for i in range(config.n_layers):
        idx_t, bucket_t = tensors[2 * i], tensors[2 * i + 1]  # read by position, as PowerInfer
        for t, want in ((idx_t, f"blk.{i}.gpu_idx"), (bucket_t, f"blk.{i}.gpu_bucket")):
            if t.name != want or t.tensor_type.name != "I32":
                fail(f"{source}: tensor {2 * i + (t is bucket_t)}", f"I32 {want!r}",
                     f"{t.tensor_type.name} {t.name!r}")
        idx = np.asarray(idx_t.data).reshape(-1)
        bucket = np.asarray(bucket_t.data).reshape(-1).astype(np.int64)
        if idx.shape != (config.d_ff,) or not np.all((idx == 0) | (idx == 1)):
            fail(f"{source}: blk.{i}.gpu_idx", f"{config.d_ff} values in {{0, 1}} (the model's "
                 "F)", f"shape {idx.shape}", "the index belongs to another model")
        if not np.array_equal(bucket, np.flatnonzero(idx)):
            fail(f"{source}: blk.{i}.gpu_bucket", "the sorted indices where gpu_idx is 1",
                 f"{bucket.size} values", "a corrupt or hand-edited index")
        hot.append(bucket)
    return GpuIndex(tuple(hot), (config.d_ff,) * config.n_layers,
                    int(meta[VRAM_CAPACITY_KEY]), source)


def write_gpu_index(path: str | os.PathLike, hot: Sequence[np.ndarray], d_ff: int,
                    vram_capacity: int) -> Path:
    """A `.gpuidx` as powerinfer-py's export_split.py writes it (hot: per layer GPU neurons)."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), GPU_INDEX_ARCH)
    for i, h in enumerate(hot):
        idx = np.zeros(d_ff, np.int32)
        idx[np.asarray(h, np.int64)] = 1
        bucket = np.sort(np.asarray(h, np.int32))
        for name, arr in ((f"blk.{i}.gpu_idx", idx), (f"blk.{i}.gpu_bucket", bucket)):
            w.add_tensor(name, arr, raw_shape=arr.shape[::-1],
                         raw_dtype=gguf.GGMLQuantizationType.I32)
    w.add_block_count(len(hot))
    w.add_uint64(VRAM_CAPACITY_KEY, int(vram_capacity))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:  # export_split.py: magic "PWRI", then version 3
        f.write(_gguf.PWRI_MAGIC)
        f.write((3).to_bytes(4, "little"))
    return path
