"""Op benchmarks of the quantized kernels: qlinear matvecs per GGUF format and the quantized sparse
FFN at 10/50/100% active, next to the float kernels (bf16 ops.linear / ops.sparse_ffn) timed in
the same run, interleaved config by config (this VM drifts 20-30% within minutes: compare ratios).

Every config is validated against the jnp reference first, then timed (median of --repeats calls
over distinct weight copies cut from a 1 GiB pool that is read through first, twice the VM's
reported last-level cache, so that each call's weights come from DRAM as in a model), then reported with napkin math: bytes read / time next to the read bandwidth measured by
the same process at the same thread count. Shapes: SmolLM2-135M (D 576; O 576, 1536, 49152; the
K-quants need D % 256 == 0 and are skipped there) and Llama-2-7B (4096 x 11008).

    nice -n 10 python benchmarks/quant_ops.py --threads 1 2 --out benchmarks/quant_ops.jsonl
Run once per build (the rows carry `isa`): the native AVX-512 one and an AVX2 one (BUILD.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from powerinfer_jax import _cli

# Weight copies timed in turn total this much: twice this VM's reported last-level cache (480 MiB)
# so each call's rows come from DRAM, as a model's do (for the quantized weights and the bf16
# comparators alike).
COLD_BYTES = 1 << 30
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SHARED = "other work shared the 2-core VM during the run (benchmarks ran under nice -n 10)"


class Pool:
    """COLD_BYTES of random bytes, cut at byte offsets into disjoint weight copies: quantized
    blocks (random quants, small finite f16 fields) or bfloat16 rows (random sign and mantissa,
    |w| in [2^-7, 2^-6)). Timing does not depend on the values; the reference check on copy 0
    still validates the kernel. `flush` reads the whole pool, evicting the copies from cache."""

    def __init__(self, rng):
        self.bytes = np.frombuffer(rng.bytes(COLD_BYTES), np.uint8).copy()

    def copies(self, nbytes: int, repeats: int) -> int:
        """Copies of nbytes each for `repeats` timed calls plus the compile call, never more
        than the pool holds."""
        return int(max(1, min(repeats + 1, COLD_BYTES // nbytes)))

    def flush(self) -> None:
        int(self.bytes.sum(dtype=np.uint64))

    def blocks(self, qtype: str, rows: int, cols: int, offset: int):
        import jax.numpy as jnp

        from powerinfer_jax.checkpoint import quants

        nb = quants.block_size(qtype)[1]
        size = rows * quants.row_bytes(qtype, cols)
        b = self.bytes[offset:offset + size].reshape(-1, nb)
        small = np.array([0.01 / quants._RANGE[qtype]], np.float16).view(np.uint8)
        for off in quants.F16_FIELDS[qtype]:
            b[:, off:off + 2] = small
        return jnp.asarray(b.reshape(rows, -1))

    def bf16(self, rows: int, cols: int, offset: int):
        import jax.numpy as jnp

        bits = self.bytes[offset:offset + rows * cols * 2].view(np.uint16)
        bits = (bits & np.uint16(0x807F)) | np.uint16(0x3C00)
        return jnp.asarray(bits.view(jnp.bfloat16).reshape(rows, cols))


def _timed(pool, fn, arg_sets, repeats):
    from powerinfer_jax._bench_ops import _median_us

    import jax

    jax.block_until_ready(fn(*arg_sets[-1]))  # compile on the last copy; time the others cold
    pool.flush()
    return _median_us(fn, arg_sets[:-1] or arg_sets, repeats=repeats)


def bench_qlinear(pool, qtype, d, o, rng, repeats):
    import jax
    import jax.numpy as jnp

    from powerinfer_jax import ops
    from powerinfer_jax.checkpoint import quants

    nbytes = o * quants.row_bytes(qtype, d)
    ws = [pool.blocks(qtype, o, d, k * nbytes) for k in range(pool.copies(nbytes, repeats))]
    x = jnp.asarray(rng.standard_normal((1, d), dtype=np.float32))
    f = jax.jit(lambda x, w: ops.qlinear(x, w, qtype, d))
    got, want = f(x, ws[0]), ops.qlinear(x, ws[0], qtype, d, impl="reference")
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    us = _timed(pool, f, [(x, w) for w in ws], repeats)
    del ws
    bf16_bytes = o * d * 2
    wb = [pool.bf16(o, d, k * bf16_bytes) for k in range(pool.copies(bf16_bytes, repeats))]
    us_bf16 = _timed(pool, jax.jit(lambda x, w: ops.linear(x, w)), [(x, w) for w in wb], repeats)
    return dict(op="qlinear", format=qtype, d=d, o=o, t=1, us=us, bytes=nbytes,
                max_rel_err_vs_reference=err, cold_working_set_bytes=COLD_BYTES,
                bf16_linear_us=us_bf16, bf16_bytes=bf16_bytes, speedup_vs_bf16=us_bf16 / us)


def bench_qsparse_ffn(pool, gu, dn, d, f, active, rng, repeats):
    import jax
    import jax.numpy as jnp

    from powerinfer_jax import ops
    from powerinfer_jax.checkpoint import quants

    gb, db = f * quants.row_bytes(gu, d), f * quants.row_bytes(dn, d)
    per = 2 * gb + db  # one copy: gate, up, down back to back
    ws = [(pool.blocks(gu, f, d, k * per), pool.blocks(gu, f, d, k * per + gb),
           pool.blocks(dn, f, d, k * per + 2 * gb)) for k in range(pool.copies(per, repeats))]
    x = jnp.asarray(rng.standard_normal((1, d), dtype=np.float32))
    n_active = max(1, round(active * f))
    mask = np.zeros((1, f), np.float32)
    mask[0, rng.permutation(f)[:n_active]] = 1.0
    scores = jnp.asarray(mask)
    kw = dict(up_qtype=gu, down_qtype=dn, threshold=0.5, criterion="scores")
    fn = jax.jit(lambda x, g, u, dd, s: ops.qsparse_ffn(x, u, dd, gate=g, scores=s, **kw)[0])
    got = fn(x, *ws[0], scores)
    want = ops.qsparse_ffn(x, ws[0][1], ws[0][2], gate=ws[0][0], scores=scores, impl="reference",
                           **kw)[0]
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    us = _timed(pool, fn, [(x,) + w + (scores,) for w in ws], repeats)
    del ws
    m = f * d * 2
    bf = [tuple(pool.bf16(f, d, 3 * k * m + j * m) for j in range(3))
          for k in range(pool.copies(3 * m, repeats))]
    sf = jax.jit(lambda x, g, u, dd, s: ops.sparse_ffn(x, u, dd, w_gate=g, scores=s,
                                                       threshold=0.5)[0])
    us_bf16 = _timed(pool, sf, [(x,) + w + (scores,) for w in bf], repeats)
    return dict(op="qsparse_ffn", format=f"{gu} gate/up, {dn} down", gate_up_format=gu,
                down_format=dn, d=d, f=f, t=1, active=active, n_active=n_active, us=us,
                bytes=n_active * (per // f), max_rel_err_vs_reference=err,
                cold_working_set_bytes=COLD_BYTES, bf16_sparse_ffn_us=us_bf16,
                bf16_bytes=n_active * 3 * d * 2, speedup_vs_bf16=us_bf16 / us)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="a few configs (smoke test)")
    ap.add_argument("--out", default="benchmarks/quant_ops.jsonl")
    args = ap.parse_args(argv)

    from powerinfer_jax import ops
    from powerinfer_jax._bench_ops import read_bandwidth_gbs
    from powerinfer_jax.ops import _ffi

    configs = [("qlinear", t, 576, o) for t in LEGACY for o in (576, 1536, 49152)]
    configs += [("qlinear", t, 4096, 11008) for t in LEGACY + K_QUANTS]
    configs += [("ffn", gu, dn, d, f, a) for gu, dn, d, f in (("Q4_1", "Q8_0", 576, 1536),
                                                               ("Q4_K", "Q8_0", 4096, 11008))
                for a in (0.1, 0.5, 1.0)]
    if args.quick:
        configs = [configs[1], configs[-4]]
    base = dict(bench="quant_ops", commit=_cli.git_commit(),
                machine=_cli.machine_info()["cpu"], isa=_ffi._pij_ext.isa_info(),
                shared_machine=SHARED, repeats=args.repeats)
    rng = np.random.default_rng(0)
    pool = Pool(rng)
    with open(args.out, "a", encoding="utf-8") as fh:
        for threads in args.threads:
            ops.set_num_threads(threads)
            bw = read_bandwidth_gbs()
            for cfg in configs:
                t0 = time.time()
                r = (bench_qlinear(pool, *cfg[1:], rng, args.repeats) if cfg[0] == "qlinear"
                     else bench_qsparse_ffn(pool, *cfg[1:], rng, args.repeats))
                gbps = r["bytes"] / (r["us"] * 1e-6) / 1e9
                r.update(base, threads=threads, gbps=gbps, read_bandwidth_gbs=bw,
                         bandwidth_fraction=gbps / bw, wall_s=time.time() - t0)
                fh.write(json.dumps(r) + "\n")
                fh.flush()
                shape = f"{r['d']}x{r.get('o', r.get('f'))}"
                active = f" {100 * r['active']:3.0f}%" if "active" in r else ""
                print(f"{threads}t {r['op']:12s} {r['format']:26s} {shape}{active}: "
                      f"{r['us']:9.1f} us {gbps:5.1f} GB/s ({100 * gbps / bw:3.0f}% of {bw:.1f}) "
                      f"x{r['speedup_vs_bf16']:.2f} vs bf16, "
                      f"err {r['max_rel_err_vs_reference']:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
