"""Facts about this machine and checkout, for result rows and cache keys (no heavy imports).

The lowest layer: anything may import it (the CLIs, runtime/auto.py's decision cache, the compiled
executables' cache), it imports nothing of the project.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """CPU model, CPU count and host name (rows say where a figure was measured)."""
    cpu = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    return {"cpu": cpu, "cpus": os.cpu_count(), "host": platform.node()}


def cpu_features() -> str:
    """A short digest of the CPU's instruction-set flags: code compiled for one set (AVX-512)
    must not be reused on a machine with another (AVX2 only)."""
    flags = _cpuinfo_field("flags") or platform.machine()
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
