"""Tensor parallelism over a JAX mesh: attention heads and FFN neurons split across devices.

`shard_model(model, n)` lays a built Transformer over the first n devices (one mesh axis, "tp")
and makes its layers run inside `jax.shard_map`. Device i holds and computes
  * attention: n_heads/n query heads and n_kv_heads/n KV heads (rows of q, k, v and their
    biases, columns of o) and its heads' slice of the KV cache [B, S, K/n, H];
  * FFN: F/n neurons (rows of gate, up, down_t, the up bias and every per-neuron array of the
    layer's selector). A placed FFN splits its hot rows and its cold rows each into n equal
    parts: device i holds hot rows [i*H/n, (i+1)*H/n) and cold rows [i*C/n, (i+1)*C/n). Cold
    rows are host memory read by the host's FFI pool, so each host's pool serves its devices'
    cold rows (on a CPU the "devices" share one pool, which runs their calls in turn).
  * an MoE layer: E/n whole experts (expert parallelism): every device routes every token
    (the router is replicated), computes the pairs whose expert it holds and passes the others
    to ops.moe_ffn as -1; a shared expert is added by device 0.
The devices may belong to several processes (jax.distributed, e.g. two on 127.0.0.1 with gloo
collectives on CPU): each process builds the same model and gives its devices' shards.
After the o projection and after the down projection each device holds a partial sum over its
heads or neurons; one psum (all-reduce) per sublayer makes the residual stream whole again
(Megatron-LM's layout; a bias after a partial sum is added by device 0 only). Embeddings, norms
and the lm_head are replicated.

Why shard_map and not sharding annotations alone: the FFI custom calls (sparse FFN, linear, q4
scores, decode attention) are per-device ops that XLA's partitioner cannot split; inside
shard_map every op, custom or not, sees its own device's shard at its local shape, so the layer
code runs unchanged (local head and neuron counts come from the weights' shapes). With XLA's
kernels alone, NamedSharding on the weights would propagate to the same layout; one path for both
keeps them from drifting apart.

Shapes must divide: n_heads, n_kv_heads and d_ff (or, for a placed model, every layer's hot and
cold counts: `round_placement` makes them so) by n. A selector's per-neuron arrays are found by
their axis-letter suffix (`w_out_fr`: F first) or, without one, by a leading axis of F; anything
else is replicated. Selectors must decide per neuron (oracle, thresholds, predictors): a rule
across neurons (top-k) would run per shard.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from powerinfer_jax.errors import fail
from powerinfer_jax.models.ffn import CudaHybrid
from powerinfer_jax.models.layers import Module, sow

AXIS = "tp"
_AXIS_LETTERS = set("btsdfnkghvr")  # models/layers.py's axis legend
_SUFFIX = re.compile(r"_([a-z]+)$")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The model's mesh (static: part of the model's graph definition)."""

    mesh: Mesh
    axis: str = AXIS

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def cache_sharding(self) -> NamedSharding:
        """KV cache [B, S, K, H]: split over its KV heads."""
        return NamedSharding(self.mesh, self.cache_spec)

    def run_layers(self, run, layers, x_btd, positions_bt, cache, cache_index, kv_len):
        """run(layers, x, positions, cache, cache_index, kv_len) inside shard_map, each device
        on its shard. Diagnostics sown under `capture` are passed out and sown on `layers`:
        per-shard integer counts (n_active) are summed over the shards."""
        # One split per layer: the state of an nnx.List under capture mixes int and str keys,
        # which jax's pytree flattening cannot sort.
        parts = []  # per layer: (graphdef, treedef, number of leaves)
        leaves, specs = [], []
        for i, block in enumerate(layers):
            graphdef, state = nnx.split(block)
            flat, treedef = jax.tree_util.tree_flatten_with_path(state)
            parts.append((graphdef, treedef, len(flat)))
            leaves += [leaf for _, leaf in flat]
            specs += [layer_spec([i, *_names(path)], leaf.shape, layers, self.axis)
                      for path, leaf in flat]
        cache_specs = None if cache is None else [(self.cache_spec,) * 2] * len(cache)
        capturing = hasattr(layers[0], "__captures__")  # under models.transformer.capture
        index = None if cache_index is None else jnp.asarray(cache_index, jnp.int32)
        axis, sown_paths = self.axis, []

        def body(leaves, x, positions, cache, index):
            blocks, at = [], 0
            for graphdef, treedef, n in parts:
                blocks.append(nnx.merge(graphdef, jax.tree_util.tree_unflatten(
                    treedef, leaves[at:at + n])))
                at += n
            _add_bias_once(blocks, axis)
            if not capturing:
                return run(blocks, x, positions, cache, index, kv_len), []
            out, sown = nnx.capture(
                lambda st: run(st.layers, x, positions, cache, index, kv_len),
                nnx.Intermediate)(_Stack(nnx.List(blocks)))
            values = []
            for path, var in nnx.to_flat_state(sown):
                value = var.get_value()[-1]
                if jnp.issubdtype(value.dtype, jnp.integer) and path[-1] not in _REPLICATED:
                    value = jax.lax.psum(value, axis)  # per-shard counts
                sown_paths.append(path[1:])  # traced once: the structure of the second output
                values.append(value)
            return out, values

        (x_out, new_cache), values = jax.shard_map(
            body, mesh=self.mesh, in_specs=(specs, P(), P(), cache_specs, P()),
            out_specs=((P(), cache_specs), P()), check_vma=False,
        )(leaves, x_btd, positions_bt, cache, index)
        for path, value in zip(sown_paths, values):
            module = layers
            for key in path[:-1]:
                module = module[int(key)] if str(key).isdigit() else getattr(module, key)
            sow(module, path[-1], value)
        return x_out, new_cache

    @property
    def cache_spec(self) -> P:
        return P(None, None, self.axis, None)


# Sown integers every shard computes whole (the router's choice), passed out as they are
_REPLICATED = {"expert_ids"}


class _Stack(Module):
    """The layers under a Module root: nnx.capture on a bare nnx.List mixes key types."""

    def __init__(self, layers):
        self.layers = layers


def _add_bias_once(layers, axis: str) -> None:
    """Biases added after a partial sum (o, down) count once: device 0 adds them, others 0."""
    first = jax.lax.axis_index(axis) == 0
    for block in layers:
        down = getattr(block.ffn, "down_t", None)  # an MoE has no biases
        for bias in (block.attn.o.bias, None if down is None else down.bias):
            if bias is not None:
                bias.set_value(jnp.where(first, bias[...], 0.0))


# ---------------------------------------------------------------------------- partition rules
def _names(path) -> list:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
    return [n for n in out if n != "value"]  # a Variable's own pytree key


def _on(ndim: int, dim: int, axis: str) -> P:
    return P(*[axis if i == dim else None for i in range(ndim)])


_ROWS = {("attn", "q", "weight"), ("attn", "k", "weight"), ("attn", "v", "weight"),
         ("attn", "q", "bias"), ("attn", "k", "bias"), ("attn", "v", "bias"),
         ("ffn", "gate", "weight"), ("ffn", "up", "weight"), ("ffn", "down_t", "weight"),
         ("ffn", "up", "bias")}
_COLS = {("attn", "o", "weight")}


def neuron_dim(name: str, shape: tuple, d_ff: int) -> int | None:
    """A selector array's neuron axis: from its axis-letter suffix (`w_out_fr` -> 0, `b_in_r` ->
    none), else 0 when its leading axis has d_ff entries, else None (replicated)."""
    m = _SUFFIX.search(str(name))
    if m and set(m.group(1)) <= _AXIS_LETTERS and len(m.group(1)) == len(shape):
        return m.group(1).index("f") if "f" in m.group(1) else None
    return 0 if shape and shape[0] == d_ff else None


def layer_spec(names, shape, layers, axis: str = AXIS) -> P:
    """The PartitionSpec of one array of the layers' state, named by its path (layer index
    first, e.g. [3, "attn", "q", "weight"]; see the module docstring)."""
    if not str(names[0]).isdigit():
        return P()
    layer, rel = int(names[0]), tuple(str(n) for n in names[1:])
    ndim = len(shape)
    if rel[-3:] in _ROWS:
        return _on(ndim, 0, axis)
    if rel[-3:] in _COLS:
        return _on(ndim, ndim - 1, axis)
    if rel[:2] == ("ffn", "cold"):
        return _on(ndim, 0, axis)
    if rel[:2] == ("ffn", "experts"):  # an MoE's stacked experts [E, ...]: E/n on each device
        return _on(ndim, 0, axis)
    if rel[:2] == ("ffn", "selector"):
        ffn = layers[layer].ffn
        dim = neuron_dim(rel[-1], tuple(shape), ffn.n_hot + ffn.n_cold)
        return P() if dim is None else _on(ndim, dim, axis)
    return P()


# ---------------------------------------------------------------------------- building
def make_mesh(n_devices: int) -> Mesh:
    """A 1-D mesh ("tp") over the first n_devices devices of the default backend."""
    devices = jax.devices()
    if not (isinstance(n_devices, int) and 1 <= n_devices <= len(devices)):
        fail("devices", f"an integer in [1, {len(devices)}] (the {jax.default_backend()} "
             "devices JAX sees)", n_devices,
             "on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts "
             "makes N host devices")
    return Mesh(np.array(devices[:n_devices]), (AXIS,))


def check_divisible(config, n: int) -> None:
    """Heads and FFN neurons (an MoE's experts, each whole, at least k per device) must split
    evenly over n devices."""
    if config.qk_norm_full and n > 1:
        fail(f"devices={n}", "1 for q/k norms over the whole projection (OLMoE's: each "
             "device holds only its heads' part of it)", n)
    split = (("n_experts", config.n_experts),) if config.n_experts else (("d_ff", config.d_ff),)
    for what, value in (("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads)) + split:
        if value % n:
            fail(f"devices={n}", f"a divisor of the model's {what} ({value}): attention heads "
                 "and FFN neurons (or experts) are split evenly over the devices", n)
    if config.n_experts and config.n_experts // n < config.n_experts_used:
        fail(f"devices={n}", f"at most n_experts / n_experts_used = "
             f"{config.n_experts // config.n_experts_used} (each device holds at least the "
             "experts one token routes to)", n)


def round_placement(p, n: int, frequency=None):
    """`p` with every layer's hot count rounded down to a multiple of n (a few hot neurons move
    to the host), so hot and cold rows both split evenly over n devices; served_fraction is
    recomputed from `frequency` (per layer [F], in original neuron order) when given."""
    hot = tuple(int(h) - int(h) % n for h in p.hot)
    if hot == p.hot:
        return p
    served = p.served_fraction
    if frequency is not None:
        freqs = [np.asarray(f, np.float64) for f in frequency]
        total = sum(float(f.sum()) for f in freqs)
        served = (sum(float(f[list(o[:h])].sum()) for f, o, h in zip(freqs, p.order, hot))
                  / total) if total > 0 else 0.0
    return dataclasses.replace(p, hot=hot, served_fraction=served)


def _interleave(n_hot: int, n_cold: int, n: int) -> np.ndarray:
    """Order putting device i's hot rows, then its cold rows, in shard i of a [F] axis."""
    h, c = n_hot // n, n_cold // n
    return np.concatenate([np.concatenate([np.arange(i * h, (i + 1) * h),
                                           n_hot + np.arange(i * c, (i + 1) * c)])
                           for i in range(n)]).astype(np.int64)


def _put(leaf, sharding: NamedSharding):
    """The array laid out by `sharding`. Over devices of several processes (jax.distributed:
    each process built the same model) every process gives the shards it holds from its copy."""
    if sharding.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_model(model, n_devices: int) -> TensorParallel:
    """Shard a built (and placed, if it is) Transformer over the first n_devices devices, in
    place; its layers then run tensor-parallel. Returns the model's TensorParallel."""
    if getattr(model, "parallel", None) is not None:
        fail("shard_model", "a model not sharded yet", f"one on {model.parallel.size} devices")
    mesh = make_mesh(n_devices)
    n = n_devices
    check_divisible(model.config, n)
    for i, layer in enumerate(model.layers):
        ffn = layer.ffn
        if n > 1 and any(getattr(layer.attn, p).qtype is not None for p in "qkvo"):
            fail(f"devices={n}", "float attention weights (a file's quantized blocks are not "
                 "split by heads)", f"layer {i}'s {layer.attn.q.qtype} blocks",
                 "load the file with weights='dtype' (dequantized) to split it")
        if isinstance(ffn.backend, CudaHybrid):
            fail(f"devices={n}", "an FFN whose cold rows are operands (CPU hybrid) or none",
                 "cold rows in the CUDA module's host store",
                 "a GPU hybrid placement runs on one device; drop devices or vram_budget")
        if ffn.n_hot % n or ffn.n_cold % n:
            fail(f"layer {i} FFN hot/cold rows",
                 f"multiples of devices={n} (round_placement makes them so)",
                 f"{ffn.n_hot} hot, {ffn.n_cold} cold")
        if ffn.placed and ffn.selector is not None and n > 1:
            ffn.selector.permute(_interleave(ffn.n_hot, ffn.n_cold, n))
    tp = TensorParallel(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model))
    leaves = []
    for path, leaf in flat:
        names = _names(path)
        spec = (layer_spec(names[1:], leaf.shape, model.layers) if names[0] == "layers"
                else P())
        for dim, name in enumerate(spec):
            if name is not None and leaf.shape[dim] % n:
                fail(f"tensor {'.'.join(str(x) for x in names)}",
                     f"axis {dim} divisible by devices={n}", tuple(leaf.shape))
        leaves.append(_put(leaf, NamedSharding(mesh, spec)))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    for block in model.layers:
        block.reduce_axis = AXIS
        if model.config.n_experts:
            block.ffn.expert_axis = AXIS
    model.parallel = tp
    return tp
