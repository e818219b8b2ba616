"""Hypothesis: under a VRAM budget, keeping every layer's most frequently active FFN neurons on the
GPU (hybrid) decodes faster than keeping whole layers there (--offload layers), and the gain grows
with how skewed the activation frequencies are.

The GPU part of run_all: runs benchmarks.gpu.hybrid_decode (synthetic weights, active neurons
sampled from SmolLM2's profiled frequencies; see its docstring) when a GPU and the PIJ_CUDA=ON
build are present. Elsewhere it writes one row with status "not available" and the reason, so the
report says why the section has no new rows. Rows measured by hand on a GPU machine are kept in
benchmarks/gpu_hybrid.jsonl; the report reads both files.

  python -m experiments.gpu_hybrid [--quick] [--out results/gpu_hybrid.jsonl]
"""
from __future__ import annotations

import argparse
import sys

from experiments import _common

FULL = ["--shapes", "llama2-7b", "--budgets", "0.1", "0.25", "0.5", "--overlap",
        "--new-tokens", "16", "--repeats", "2"]
QUICK = ["--shapes", "smollm2-135m", "--budgets", "0.25", "--new-tokens", "8", "--repeats", "1"]


def unavailable_reason() -> str | None:
    import jax

    if jax.default_backend() != "gpu":
        return f"needs a GPU backend, got {jax.default_backend()}"
    from powerinfer_jax.models.ffn import cuda_hybrid_available

    if not cuda_hybrid_available():
        return "needs the PIJ_CUDA=ON build (BUILD.md)"
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(_common.RESULTS / "gpu_hybrid.jsonl"))
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        row = _common.header("gpu_hybrid", threads=None, dtype="bfloat16", model="synthetic",
                             config={}, quick=args.quick)
        _common.append_rows(args.out, [{**row, "status": "not available", "reason": reason}])
        print(f"gpu_hybrid: not available ({reason})")
        return
    from benchmarks.gpu import hybrid_decode  # lazy: jax, flax and the GPU build, only here

    hybrid_decode.main([*(QUICK if args.quick else FULL), "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
