"""Quick sanity timing of the sparse FFN kernel vs XLA's dense FFN (not a test, not the benchmark).

python -m powerinfer_jax.ops.sanity_timing [--d 4096 --f 11008 --t 1 --threads 2]
Validates against the reference first, then prints median times and the bandwidth achieved on
the active rows (bytes of gate+up+down rows actually read / time).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from powerinfer_jax import ops


def _median_seconds(fn, *args, reps):
    from powerinfer_jax._bench_ops import median_seconds

    return median_seconds(fn, *args, repeats=reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--f", type=int, default=11008)
    parser.add_argument("--t", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    ops.set_num_threads(args.threads)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    d, f, t = args.d, args.f, args.t
    w = lambda: jnp.asarray(rng.standard_normal((f, d), dtype=np.float32) / np.sqrt(d), dtype)
    w_gate, w_up, w_down_t = w(), w(), w()
    x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))

    dense = jax.jit(lambda x, g, u, dt: (jax.nn.silu(x.astype(dtype) @ g.T) * (x.astype(dtype) @ u.T)) @ dt)
    t_dense = _median_seconds(dense, x, w_gate, w_up, w_down_t, reps=args.reps)
    print(f"dense XLA {args.dtype}: {t_dense * 1e3:.3f} ms")
    # Weights as arguments, not closure constants: constants would be baked into the executable.
    sparse_w = jax.jit(lambda x, s, g, u, dt: ops.sparse_ffn(x, u, dt, w_gate=g, scores=s,
                                                             threshold=0.5))
    sparse = lambda x, s: sparse_w(x, s, w_gate, w_up, w_down_t)
    for frac in (0.1, 0.5, 1.0):
        scores = jnp.asarray((rng.random((t, f)) < frac).astype(np.float32))
        y, n = sparse(x, scores)
        y_ref, _ = ops.sparse_ffn(x, w_up, w_down_t, w_gate=w_gate, scores=scores, threshold=0.5,
                                  impl="reference")
        err = float(jnp.max(jnp.abs(y - y_ref)) / (jnp.max(jnp.abs(y_ref)) + 1e-30))
        secs = _median_seconds(sparse, x, scores, reps=args.reps)
        union = int(jnp.sum(jnp.any(scores > 0.5, axis=0)))
        gbps = union * 3 * d * dtype.itemsize / secs / 1e9
        print(f"active {frac:4.0%}: {secs * 1e3:.3f} ms  x{t_dense / secs:.2f} vs dense  "
              f"{gbps:.1f} GB/s on active rows  rel_err {err:.1e}  n_active[0]={int(n[0])}")


if __name__ == "__main__":
    main()
