"""Files a test run builds once and every pytest-xdist worker reads.

A session fixture runs once per worker: with the README's `-n 2` an expensive build (the tiny
family models converted to GGUF by llama.cpp's converter, then quantized) ran twice, a minute
each. `once(key, build)` runs `build(folder)` in whichever process asks first, under a lock in
the run's shared folder (`$PIJ_BG_DIR`, helpers_background.py: made by the controlling process,
removed when it ends); the others wait on the lock and get the same folder. A build that raised
leaves no mark, so the next process to ask builds again (and raises in its own test).
"""
from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import helpers_background


def once(key: str, build) -> tuple[Path, object]:
    """(folder, what `build(folder)` returned, as JSON) for the run: built by the first caller."""
    root = helpers_background.workdir("")  # the run's shared folder
    folder, mark = root / f"shared-{key}", root / f"shared-{key}.json"
    with open(root / f"shared-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not mark.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that raised half-way
            folder.mkdir()
            result = build(folder)
            mark.write_text(json.dumps(result))
        return folder, json.loads(mark.read_text())
