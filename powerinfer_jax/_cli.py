"""Flags and start-up shared by every CLI (generate, evaluate, bench, calibrate).

Imports nothing heavy at module level: `--threads` must pin the process before XLA's CPU client
starts its thread pool (XLA sizes the pool from the CPUs the process may run on).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CONTEXT_CAP = 2048  # KV cache slots unless --max-seq-len says otherwise
DEFAULT_TARGET_SPARSITY = 0.5  # threshold/predictor modes without --target-sparsity


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="registry name, .gguf file or Hugging Face directory (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight dtype for matmuls (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for XLA and the sparse kernels (default: all available)")
    p.add_argument("--sparsity", default="dense",
                   choices=["dense", "oracle", "threshold", "predictor"],
                   help="how the FFN's active neurons are found: dense; oracle (true activations); "
                        "threshold (calibrated |act(gate)|, CATS-style); predictor (see --predictor) "
                        "(default: %(default)s)")
    p.add_argument("--predictor", default="q4", choices=["q4", "lowrank"],
                   help="predictor mode's predictor: q4 (|a_i| estimated from 4-bit gate/up rows; "
                        "default) or lowrank (trained D->R->F MLPs, built by calibrate)")
    p.add_argument("--gate-up", default="full", choices=["full", "q4"],
                   help="predictor mode with --predictor q4: where the active neurons' gate/up "
                        "dots come from: full (their rows at --dtype) or q4 (the predictor's own "
                        "4-bit estimate, so only down rows are read at --dtype; for a Q4_1 "
                        "checkpoint these are its own gate/up weights, with 8-bit activations) "
                        "(default: %(default)s)")
    p.add_argument("--threshold", type=float, default=0.0,
                   help="oracle: a neuron is active when |a_i| > threshold (default: 0)")
    p.add_argument("--target-sparsity", type=float, default=None,
                   help="calibrated FFN sparsity to run at (threshold/predictor: default "
                        f"{DEFAULT_TARGET_SPARSITY}; oracle: use calibrated per-layer thresholds "
                        "instead of --threshold); artifacts are built by python -m "
                        "powerinfer_jax.calibrate, for the default model on first use")
    p.add_argument("--impl", default="ffi", choices=["ffi", "reference"],
                   help="sparse FFN implementation: the compiled custom call or its pure-jnp "
                        "reference (default: %(default)s)")
    p.add_argument("--kernels", default="auto", choices=["auto", "xla", "ffi"],
                   help="who runs the dense matmuls: XLA, or the project's custom calls on the C++ "
                        "thread pool (auto: the custom calls on CPU) (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"KV cache length (default: min(model context, {DEFAULT_CONTEXT_CAP}))")
    p.add_argument("--vram-budget", type=float, default=None, metavar="GIB",
                   help="accelerator memory for the model in GiB (dense parts, KV cache, hot FFN "
                        "rows); default: a GPU's free memory minus a margin; on a CPU-only machine "
                        "no placement unless given (then it is the notional accelerator of the "
                        "CPU hybrid: hot rows through XLA, cold rows through the FFI pool)")
    p.add_argument("--offload", default="hybrid", choices=["hybrid", "layers"],
                   help="what stays off the accelerator: hybrid (cold FFN neurons, by activation "
                        "frequency) or layers (whole trailing layers, llama.cpp -ngl style) "
                        "(default: %(default)s)")
    p.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                   help="print one JSON object as the last line of stdout")


def configure_threads(threads: int | None) -> int:
    """Pin the process to `threads` CPUs (before XLA starts) and return the thread count in use."""
    available = sorted(os.sched_getaffinity(0))
    if threads is None:
        return len(available)
    if threads < 1:
        raise ValueError(f"--threads: expected a positive integer, got {threads}")
    if threads > len(available):
        raise ValueError(f"--threads: expected at most {len(available)} (CPUs available), "
                         f"got {threads}")
    os.sched_setaffinity(0, available[:threads])
    return threads


def setup(args) -> int:
    """Apply --threads everywhere it matters; returns the thread count."""
    n = configure_threads(args.threads)
    if args.sparsity != "dense" and getattr(args, "impl", "ffi") == "ffi":
        from powerinfer_jax import ops

        ops.set_num_threads(n)
    return n


def fail(msg: str) -> "SystemExit":
    """A user error: print it plainly (no traceback) and exit with status 2."""
    print(f"error: {msg}", file=sys.stderr)
    return SystemExit(2)


def run_main(main) -> None:
    """Call main(), turning user errors (ValueError, FileNotFoundError) into a clear message."""
    try:
        main()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None


def print_json(obj) -> None:
    print(json.dumps(obj), flush=True)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "host": platform.node()}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
