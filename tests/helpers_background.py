"""Slow subprocess tests started at collection time, on the machine's idle core.

Most of the suite keeps one core busy (one test at a time, mostly single-threaded XLA work), so
a test whose body is one long subprocess (the CUDA build, the mesh cases on 4 host devices) can
run beside it. conftest.py starts every collected test module's `BACKGROUND` commands when
collection ends, niced, and runs those tests last; the test then waits for its command with
`finish(key)`. Run alone (`pytest tests/test_mesh.py`), the command starts at collection too and
the test simply waits for it.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NICE = 10  # below the foreground tests, so their figures move as little as possible


@dataclass
class Job:
    proc: subprocess.Popen
    workdir: Path
    started: float = field(default_factory=time.monotonic)


_JOBS: dict[str, Job] = {}


def start(key: str, argv: list[str], *, env: dict | None = None, cwd=None) -> None:
    """Start `argv` (once per key) with stdout and stderr in files, niced. "{workdir}" in an
    argument becomes the job's own temporary directory (removed at the session's end)."""
    if key in _JOBS:
        return
    workdir = Path(tempfile.mkdtemp(prefix=f"pij-bg-{key}-"))
    argv = [a.replace("{workdir}", str(workdir)) for a in argv]
    with open(workdir / "stdout", "w") as out, open(workdir / "stderr", "w") as err:
        # `nice` the command, not preexec_fn=os.nice: a preexec_fn forces a fork of this
        # multithreaded (jax) process, which jax warns may deadlock
        proc = subprocess.Popen(["nice", "-n", str(NICE), *argv], stdout=out, stderr=err,
                                env=env, cwd=cwd)
    _JOBS[key] = Job(proc, workdir)


def workdir(key: str) -> Path:
    return _JOBS[key].workdir


def finish(key: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait (at most `timeout` s from the job's start) for the job; its status and output."""
    job = _JOBS[key]
    left = max(1.0, timeout - (time.monotonic() - job.started))
    try:
        job.proc.wait(timeout=left)
    except subprocess.TimeoutExpired:
        job.proc.kill()
        job.proc.wait()
        raise
    return subprocess.CompletedProcess(job.proc.args, job.proc.returncode,
                                       (job.workdir / "stdout").read_text(errors="replace"),
                                       (job.workdir / "stderr").read_text(errors="replace"))


def stop_all() -> None:
    """Kill what is still running and remove every job's files (the session's end)."""
    for job in _JOBS.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
        shutil.rmtree(job.workdir, ignore_errors=True)
    _JOBS.clear()
