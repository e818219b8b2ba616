"""Slow subprocess tests started at collection time, beside the foreground tests.

Most of the suite is single-threaded XLA work, so a test whose body is one long subprocess (the
CUDA build, the mesh cases on 4 host devices) can run beside it. conftest.py starts every
collected test module's `BACKGROUND` commands when collection ends, niced, and runs those tests
last; the test then waits for its command with `finish(key)`. Run alone (`pytest
tests/test_mesh.py`), the command starts at collection too and the test simply waits for it.

With pytest-xdist (the README's `-n 2`) every worker collects every test, but only one may run a
given background test, and which one is decided later. So a job lives in a folder shared by the
run's processes (`$PIJ_BG_DIR`, made by the controlling process in conftest.py): the first worker
to create `<key>/` starts the command, whose exit status lands in `<key>/rc`; whichever worker
runs the test waits for that file, and kills the command's process group on a timeout. A job
runs in its own session and outlives the worker that started it (another worker may be waiting
for it); the controlling process, which ends last, kills what still runs and removes the folder.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

NICE = 10  # below the foreground tests, so their figures move as little as possible
ENV = "PIJ_BG_DIR"
_MADE_ROOT: Path | None = None


def make_root() -> None:
    """In the controlling process (or a run without workers): a fresh folder for the run's jobs,
    named in the environment that the workers inherit."""
    global _MADE_ROOT
    _MADE_ROOT = Path(tempfile.mkdtemp(prefix="pij-bg-"))
    os.environ[ENV] = str(_MADE_ROOT)


def _root() -> Path:
    if ENV not in os.environ:
        make_root()
    return Path(os.environ[ENV])


def workdir(key: str) -> Path:
    """The job's folder: its stdout, stderr, rc, and the command's own files."""
    return _root() / key


def start(key: str, argv: list[str], *, env: dict | None = None, cwd=None) -> None:
    """Start `argv` once per key and run (whatever the worker), with stdout and stderr in files,
    niced. "{workdir}" in an argument becomes the job's folder."""
    job = workdir(key)
    try:
        job.mkdir()
    except FileExistsError:  # another worker (or an earlier call) started it
        return
    argv = [a.replace("{workdir}", str(job)) for a in argv]
    # the exit status goes to a file any worker can read: `sh` runs the command and writes it
    script = ('nice -n "$0" "$@"; echo $? > "$PIJ_BG_JOB/rc.tmp" && '
              'mv "$PIJ_BG_JOB/rc.tmp" "$PIJ_BG_JOB/rc"')
    with open(job / "stdout", "w") as out, open(job / "stderr", "w") as err:
        # `nice` in the shell, not preexec_fn=os.nice: a preexec_fn forces a fork of this
        # multithreaded (jax) process, which jax warns may deadlock. Its own session: a timeout
        # kills the whole group from whichever worker waits
        env = {**(os.environ if env is None else env), "PIJ_BG_JOB": str(job)}
        proc = subprocess.Popen(["sh", "-c", script, str(NICE), *argv], stdout=out, stderr=err,
                                env=env, cwd=cwd, start_new_session=True)
    (job / "pid").write_text(str(proc.pid))
    (job / "started").write_text(repr(time.time()))


def finish(key: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait (at most `timeout` s from the job's start) for the job; its status and output."""
    job = workdir(key)
    for _ in range(600):  # a worker that just made the folder is writing the start time
        if (job / "started").exists():
            break
        time.sleep(0.1)
    deadline = float((job / "started").read_text()) + timeout
    while not (job / "rc").exists():
        if time.time() > deadline:
            _kill(job)
            raise subprocess.TimeoutExpired(key, timeout)
        time.sleep(1.0)
    rc = int((job / "rc").read_text().strip() or "1")
    return subprocess.CompletedProcess(key, rc, (job / "stdout").read_text(errors="replace"),
                                       (job / "stderr").read_text(errors="replace"))


def _kill(job: Path) -> None:
    try:
        os.killpg(int((job / "pid").read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass  # already gone


def stop_all() -> None:
    """A session's end. In a worker: nothing (a job it started may be another worker's to read,
    and runs on by itself). In the process that made the folder (the xdist controller, which
    ends after its workers, or a run without workers): kill every job still running, remove the
    folder."""
    global _MADE_ROOT
    if _MADE_ROOT is None:
        return
    for job in _MADE_ROOT.iterdir():
        if (job / "pid").exists() and not (job / "rc").exists():
            _kill(job)
    shutil.rmtree(_MADE_ROOT, ignore_errors=True)
    _MADE_ROOT = None
