"""The only module that loads the compiled extension: registers FFI targets once and calls them.

Absent optional operands are passed as zero-size arrays (the handler's convention, see
xla_ffi/sparse_ffn_args.h). vmap uses vmap_method="expand_dims": unbatched operands get a leading
size-1 dim, which the handlers accept without copying weights per batch element.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax import errors

try:
    from powerinfer_jax import _pij_ext
except ImportError as e:  # pragma: no cover - exercised only on unbuilt checkouts
    raise ImportError(
        "powerinfer_jax._pij_ext (the compiled kernels) is not built. From the repo root run "
        "`pip install -e . --no-build-isolation` (see BUILD.md), or use impl='reference'."
    ) from e

try:  # the CUDA module exists only in builds with -Ccmake.define.PIJ_CUDA=ON
    from powerinfer_jax import _pij_cuda
except ImportError:
    _pij_cuda = None

SPARSE_FFN_TARGET = "pij_sparse_ffn"
LINEAR_TARGET = "pij_linear"
LINEAR_MANY_TARGET = "pij_linear_many"
Q4_SCORES_TARGET = "pij_q4_scores"
Q4_SPARSE_FFN_TARGET = "pij_q4_sparse_ffn"
DECODE_ATTENTION_TARGET = "pij_decode_attention"
QLINEAR_TARGET = "pij_qlinear"
QLINEAR_MANY_TARGET = "pij_qlinear_many"
QSPARSE_FFN_TARGET = "pij_qsparse_ffn"
QEMBEDDING_TARGET = "pij_qembedding"
MOE_FFN_TARGET = "pij_moe_ffn"


def _register() -> None:
    for name, capsule in _pij_ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if _pij_cuda is not None:
        for name, capsule in _pij_cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _pij_cuda.use_host_pool(_pij_ext.host_pool())  # one pool per process


_register()  # module import runs once per process


def max_threads() -> int:
    """The most threads set_num_threads accepts: max(256, 4 x the hardware threads). More only
    oversubscribes the cores (cpu_backend/thread_pool.h); 5000 is a typo, not a request."""
    return _pij_ext.max_threads()


def set_num_threads(n: int) -> None:
    """Threads used by the CPU kernels (the calling thread counts as one)."""
    errors.check_positive_int("set_num_threads: n", n, maximum=max_threads())
    _pij_ext.set_num_threads(n)


def get_num_threads() -> int:
    return _pij_ext.get_num_threads()


def simd_name() -> str:
    return _pij_ext.simd_name()


def _absent(shape, dtype):
    return jnp.zeros(shape, dtype)


def _ffn_operands(x, w_up, w_down_t, w_gate, b_up, b_down, scores):
    """x as float32 and the handler's operand tuple (absent optionals as zero-size arrays)."""
    x32 = jnp.asarray(x, jnp.float32)
    f32 = lambda a: _absent((0,), jnp.float32) if a is None else jnp.asarray(a, jnp.float32)
    gate = _absent((0, w_up.shape[-1]), w_up.dtype) if w_gate is None else w_gate
    return x32, (x32, gate, w_up, w_down_t, f32(b_up), f32(b_down), f32(scores))


def sparse_ffn(x, w_up, w_down_t, *, w_gate, b_up, b_down, scores, threshold, activation,
               criterion, gate_floor=0.0):
    x32, operands = _ffn_operands(x, w_up, w_down_t, w_gate, b_up, b_down,
                                  None if criterion == "oracle" else scores)
    d = w_up.shape[-1]
    rows = x32.shape[:-1]
    call = jax.ffi.ffi_call(
        SPARSE_FFN_TARGET,
        (jax.ShapeDtypeStruct(rows + (d,), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.int32)),
        vmap_method="expand_dims")
    return call(*operands, threshold=np.float32(threshold), activation=activation,
                criterion=criterion, gate_floor=np.float32(gate_floor))


def linear(x, w, b):
    x32 = jnp.asarray(x, jnp.float32)
    out = jax.ShapeDtypeStruct(x32.shape[:-1] + (w.shape[-2],), jnp.float32)
    call = jax.ffi.ffi_call(LINEAR_TARGET, out, vmap_method="expand_dims")
    return call(x32, w, _absent((0,), jnp.float32) if b is None else jnp.asarray(b, jnp.float32))


def linear_many(x, ws, bs):
    x32 = jnp.asarray(x, jnp.float32)
    outs = tuple(jax.ShapeDtypeStruct(x32.shape[:-1] + (w.shape[-2],), jnp.float32) for w in ws)
    call = jax.ffi.ffi_call(LINEAR_MANY_TARGET, outs, vmap_method="expand_dims")
    biases = [_absent((0,), jnp.float32) if b is None else jnp.asarray(b, jnp.float32)
              for b in bs]
    return tuple(call(x32, *ws, *biases))


def q4_scores(x, q, dm, b_up, *, activation, signed=False):
    x32 = jnp.asarray(x, jnp.float32)
    out = jax.ShapeDtypeStruct(x32.shape[:-1] + (q.shape[-3],), jnp.float32)
    call = jax.ffi.ffi_call(Q4_SCORES_TARGET, out, vmap_method="expand_dims")
    b = _absent((0,), jnp.float32) if b_up is None else jnp.asarray(b_up, jnp.float32)
    return call(x32, q, dm, b, activation=activation, output="signed" if signed else "magnitude")


def q4_sparse_ffn(x, q, dm, w_down_t, b_up, b_down, *, threshold, activation):
    x32 = jnp.asarray(x, jnp.float32)
    rows = x32.shape[:-1]
    call = jax.ffi.ffi_call(
        Q4_SPARSE_FFN_TARGET,
        (jax.ShapeDtypeStruct(rows + (x32.shape[-1],), jnp.float32),
         jax.ShapeDtypeStruct(rows, jnp.int32)), vmap_method="expand_dims")
    f32 = lambda a: _absent((0,), jnp.float32) if a is None else jnp.asarray(a, jnp.float32)
    return call(x32, q, dm, f32(b_up), w_down_t, f32(b_down), activation=activation,
                threshold=np.float32(threshold))


def _qid(qtype: str) -> np.int32:
    from powerinfer_jax.checkpoint import quants  # lazy: start-up (gguf only for GGUF files)

    return np.int32(quants.type_id(qtype))


def _opt_f32(a):
    return _absent((0,), jnp.float32) if a is None else jnp.asarray(a, jnp.float32)


def qlinear(x, blocks, qtype, b):
    x32 = jnp.asarray(x, jnp.float32)
    out = jax.ShapeDtypeStruct(x32.shape[:-1] + (blocks.shape[-2],), jnp.float32)
    call = jax.ffi.ffi_call(QLINEAR_TARGET, out, vmap_method="expand_dims")
    return call(x32, blocks, _opt_f32(b), qtype=_qid(qtype))


def qlinear_many(x, blocks_list, qtypes, bs):
    x32 = jnp.asarray(x, jnp.float32)
    outs = tuple(jax.ShapeDtypeStruct(x32.shape[:-1] + (w.shape[-2],), jnp.float32)
                 for w in blocks_list)
    call = jax.ffi.ffi_call(QLINEAR_MANY_TARGET, outs, vmap_method="expand_dims")
    ids = np.asarray([_qid(q) for q in qtypes], np.int32)
    return tuple(call(x32, *blocks_list, *[_opt_f32(b) for b in bs], qtypes=ids))


def qembedding(ids, blocks, qtype, in_features):
    ids32 = jnp.asarray(ids, jnp.int32)
    out = jax.ShapeDtypeStruct(ids32.shape + (in_features,), jnp.float32)
    call = jax.ffi.ffi_call(QEMBEDDING_TARGET, out, vmap_method="expand_dims")
    return call(ids32, blocks, qtype=_qid(qtype), dim=np.int64(in_features))


def moe_ffn(x, ids, weights, gate, up, down, *, gate_qtype, up_qtype, down_qtype,
            activation="silu", mid_thresholds=None):
    """(y [N, D], kept int32 [N]); mid_thresholds None is passed as [0] (absent)."""
    x32 = jnp.asarray(x, jnp.float32)
    out = (jax.ShapeDtypeStruct(x32.shape, jnp.float32),
           jax.ShapeDtypeStruct(x32.shape[:1], jnp.int32))
    call = jax.ffi.ffi_call(MOE_FFN_TARGET, out, vmap_method="sequential")
    return call(x32, jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32), gate, up,
                down, _opt_f32(mid_thresholds), gate_qtype=_qid(gate_qtype),
                up_qtype=_qid(up_qtype), down_qtype=_qid(down_qtype), activation=activation)


def qsparse_ffn(x, up, down, *, up_qtype, down_qtype, gate, gate_qtype, b_up, b_down, scores,
                threshold, activation, criterion, gate_floor=0.0):
    x32 = jnp.asarray(x, jnp.float32)
    rows = x32.shape[:-1]
    call = jax.ffi.ffi_call(
        QSPARSE_FFN_TARGET,
        (jax.ShapeDtypeStruct(rows + (x32.shape[-1],), jnp.float32),
         jax.ShapeDtypeStruct(rows, jnp.int32)), vmap_method="expand_dims")
    gate_op = _absent((0, up.shape[-1]), jnp.uint8) if gate is None else gate
    scores_op = _opt_f32(scores if criterion == "scores" else None)
    return call(x32, gate_op, up, down, _opt_f32(b_up), _opt_f32(b_down), scores_op,
                gate_qtype=_qid(gate_qtype), up_qtype=_qid(up_qtype), down_qtype=_qid(down_qtype),
                threshold=np.float32(threshold), activation=activation, criterion=criterion,
                gate_floor=np.float32(gate_floor))


def decode_attention(q, k_new, v_new, k_cache, v_cache, where, *, kv_len, inv_freq,
                     rope_factor, scale, softcap, window, q_norm, k_norm, norm_eps):
    """One decode token's attention; the caches are updated in place (aliased operands).
    inv_freq, q_norm, k_norm: float32 arrays or None (passed as [0]: absent)."""
    call = jax.ffi.ffi_call(
        DECODE_ATTENTION_TARGET,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32),
         jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={3: 1, 4: 2})
    return call(jnp.asarray(q, jnp.float32), jnp.asarray(k_new, jnp.float32),
                jnp.asarray(v_new, jnp.float32), k_cache, v_cache,
                jnp.asarray(where, jnp.int32), _opt_f32(inv_freq), _opt_f32(q_norm),
                _opt_f32(k_norm), kv_len=np.int64(kv_len), rope_factor=np.float32(rope_factor),
                scale=np.float32(scale), softcap=np.float32(softcap), window=np.int64(window),
                norm_eps=np.float32(norm_eps))


HYBRID_TARGET = "pij_sparse_ffn_hybrid"


def register_cold_rows(up, down_t, *, gate=None, b_up=None) -> int:
    """GPU builds: copy one layer's cold rows into host memory owned by the backend (once, at
    load); returns the handle `sparse_ffn_hybrid` takes."""
    if _pij_cuda is None:
        raise RuntimeError("register_cold_rows: expected the PIJ_CUDA=ON build (powerinfer_jax."
                           "_pij_cuda), got a CPU-only build")
    dtype = np.dtype(up.dtype).name
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"register_cold_rows: up: expected float32, bfloat16 or float16 rows, "
                         f"got {dtype}")

    def host(a, as_weight=True):
        if a is None:
            return None
        a = np.ascontiguousarray(np.asarray(a))
        if as_weight and np.dtype(a.dtype).name != dtype:
            raise ValueError(f"register_cold_rows: expected every weight in {dtype} (up's dtype), "
                             f"got {a.dtype}")
        # numpy has no bfloat16 of its own (ml_dtypes' cannot cross nanobind): 16-bit rows travel
        # as their bits; `dtype` tells the backend how to read them
        return a.view(np.uint16) if as_weight and a.dtype.itemsize == 2 else a

    b = None if b_up is None else np.asarray(b_up, np.float32)
    return int(_pij_cuda.register_cold_rows(host(up), host(down_t), host(gate),
                                            host(b, as_weight=False), dtype))


def release_cold_rows(handle: int) -> bool:
    """Free rows registered by `register_cold_rows` (False if the handle is unknown)."""
    return _pij_cuda is not None and bool(_pij_cuda.release_cold_rows(int(handle)))


def sparse_ffn_hybrid(x, w_up, w_down_t, *, w_gate, b_up, b_down, scores, scores_cold,
                      threshold, activation, criterion, cold_handle: int):
    """GPU: hot rows (these weights, on the device) plus the cold rows behind cold_handle (host
    pool), in one custom call. x and scores [T, ...] dense, no vmap."""
    oracle = criterion == "oracle"
    x32, operands = _ffn_operands(x, w_up, w_down_t, w_gate, b_up, b_down,
                                  None if oracle else scores)
    operands += (_absent((0,), jnp.float32) if oracle
                 else jnp.asarray(scores_cold, jnp.float32),)
    d = w_up.shape[-1]
    rows = x32.shape[:-1]
    call = jax.ffi.ffi_call(
        HYBRID_TARGET,
        (jax.ShapeDtypeStruct(rows + (d,), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.int32)))
    return call(*operands, threshold=np.float32(threshold), activation=activation,
                criterion=criterion, cold_handle=np.int64(cold_handle))


DISK_FFN_TARGET = "pij_disk_ffn"


def disk_ffn(x, scores, *, store: int, layer: int, threshold, activation, criterion,
             next_scores=None, gate_floor=0.0):
    """The sparse FFN of one layer of a neuron store (cpu_backend/disk_ffn.h): its rows are read
    where they live (memory or the bundle file), not passed. x [..., D]; scores [..., F] for
    criterion "scores"; next_scores [..., F]: a guess at layer + 1's scores, whose selected
    neurons are read ahead; gate_floor: FATReLU's gate threshold (as ops.qsparse_ffn's). Returns
    (y [..., D] float32, n_active [...] int32). A side effect
    for XLA (the store's cache and reads): never dropped or merged."""
    x32 = jnp.asarray(x, jnp.float32)
    rows = x32.shape[:-1]
    call = jax.ffi.ffi_call(
        DISK_FFN_TARGET,
        (jax.ShapeDtypeStruct(rows + (x32.shape[-1],), jnp.float32),
         jax.ShapeDtypeStruct(rows, jnp.int32)), vmap_method="expand_dims", has_side_effect=True)
    return call(x32, _opt_f32(scores if criterion == "scores" else None), _opt_f32(next_scores),
                store=np.int64(store),
                layer=np.int64(layer), threshold=np.float32(threshold), activation=activation,
                criterion=criterion, gate_floor=np.float32(gate_floor))


EXPERT_FFN_TARGET = "pij_expert_ffn"


def expert_ffn(x, ids, weights, *, store: int, layer: int, d_ff: int, gate_qtype, up_qtype,
               down_qtype, activation, probs=None, next_ids=None):
    """The MoE FFN of one layer of an expert store (cpu_backend/expert_store.h): its experts are
    read where they live (memory or the expert file), not passed. x [N, D]; ids, weights
    [N, k]; probs [N, E] (the router's probabilities: the "score" cache policy's credit) or
    None; next_ids [N, k'] (a guess at layer + 1's experts, read ahead) or None. Returns y
    [N, D] float32. A side effect for XLA (the store's cache and reads): never dropped or
    merged."""
    x32 = jnp.asarray(x, jnp.float32)
    call = jax.ffi.ffi_call(EXPERT_FFN_TARGET, jax.ShapeDtypeStruct(x32.shape, jnp.float32),
                            vmap_method="sequential", has_side_effect=True)
    empty_i = jnp.zeros((0,), jnp.int32)
    return call(x32, jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32),
                _opt_f32(probs), empty_i if next_ids is None else jnp.asarray(next_ids, jnp.int32),
                store=np.int64(store), layer=np.int64(layer), d_ff=np.int64(d_ff),
                gate_qtype=_qid(gate_qtype), up_qtype=_qid(up_qtype),
                down_qtype=_qid(down_qtype), activation=activation)
