"""kill -9 while the cache is written (the representative subset of benchmarks/crash_safety.py,
which runs every write step x 5 kill points on a tiny model): a child process writes compiled
steps into the executable store, or sparsity artifacts, in a loop and is SIGKILLed at a random
point; then every entry is whole (loads and computes / validates) or absent, never half there,
the next write of an entry deletes what the killed writer left, and a file of the user's in the
same folder is untouched."""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerinfer_jax import cache
from powerinfer_jax.runtime import executables as E

REPO = Path(__file__).resolve().parents[1]
STEPS = 24


def _kill_during(code: str, tmp_path: Path, seed: int) -> float:
    """Run `code` in a child; SIGKILL it a random time after it prints BEGIN."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "BEGIN", proc.stderr.read()
    delay = random.Random(seed).uniform(0.05, 1.0)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return delay


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob(".*") if p.name.endswith((".tmp", ".old"))]


def _step(i: int):
    def f(x):
        return jnp.sin(x) * i + x

    f.__name__ = E.fresh_name("step")
    with E.compiling_for_store():
        return jax.jit(f).lower(jnp.zeros(64, jnp.float32)).compile()


@pytest.mark.slow  # a child process with jax: ~5-10 s
def test_kill_during_executable_cache_writes(tmp_path):
    root = tmp_path / "executables"
    (root / "ident").mkdir(parents=True)
    mine = root / "ident" / "my-notes.txt"
    mine.write_text("the user's own file")
    _kill_during(f"""
        import jax, jax.numpy as jnp
        from powerinfer_jax.runtime import executables as E
        from test_crash_safety import _step
        store = E.Store("ident", __import__("pathlib").Path({str(root)!r}))
        _step(0)  # compile once before BEGIN: the kill lands among the writes
        print("BEGIN", flush=True)
        for i in range({STEPS}):
            store.save(("step", i), _step(i), "structure")
        """, tmp_path, seed=1)
    store = E.Store("ident", root)
    x = jnp.arange(64, dtype=jnp.float32)
    found = 0
    for i in range(STEPS):
        exe = store.take(("step", i), "structure")
        if exe is None:  # never written, or cut off: compiled and written again
            store.save(("step", i), _step(i), "structure")
            exe = store.take(("step", i), "structure")
        else:
            found += 1
        np.testing.assert_allclose(np.asarray(exe(x)), np.sin(np.asarray(x)) * i + x,
                                   rtol=1e-5, atol=1e-4)
    assert found < STEPS  # the kill came before the last write
    assert _temporaries(root) == []  # what the killed writer left went with the next write
    assert mine.read_text() == "the user's own file"


@pytest.mark.slow  # a child process with jax: ~5-10 s
def test_kill_during_artifact_writes(tmp_path):
    from powerinfer_jax.sparsity import artifacts as A
    from test_robustness import FP, make_artifacts

    root = tmp_path / "artifacts"
    root.mkdir()
    mine = root / "notes.txt"
    mine.write_text("the user's own file")
    targets = [round(0.30 + 0.05 * k, 2) for k in range(8)]
    _kill_during(f"""
        from pathlib import Path
        from powerinfer_jax.sparsity import artifacts as A
        from test_robustness import FP, make_artifacts
        arts, profile = make_artifacts(predictor=False)
        print("BEGIN", flush=True)
        for t in {targets!r}:
            A.save_artifacts(A.target_dir(Path({str(root)!r}), t), arts, profile, FP)
        """, tmp_path, seed=2)
    arts, profile = make_artifacts(predictor=False)
    found = 0
    for t in targets:
        d = A.target_dir(root, t)
        if d.exists():  # whole: every file as recorded, and valid
            assert cache.check_dir(d) is None
            assert A.load_artifacts(d, fingerprint=FP, need_predictor=False).thresholds_q4 == \
                arts.thresholds_q4
            found += 1
        else:
            A.save_artifacts(d, arts, profile, FP)
            assert A.load_artifacts(d, fingerprint=FP, need_predictor=False)
    assert found < len(targets)
    assert _temporaries(root) == []
    assert mine.read_text() == "the user's own file"


@pytest.mark.parametrize("suffix", ["tmp", "old"])
def test_only_a_dead_writers_temporaries_are_swept(tmp_path, suffix):
    dest = tmp_path / "entry.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".entry.bin.{dead}.0123abcd.{suffix}"
    live = tmp_path / f".entry.bin.{os.getpid()}.0123abcd.{suffix}"
    look_alike = tmp_path / f".entry.bin.{dead}.notahex!.{suffix}"
    other = tmp_path / f".other.bin.{dead}.0123abcd.{suffix}"
    for p in (stale, live, look_alike, other):
        p.mkdir() if suffix == "old" else p.write_text("x")
    assert cache.sweep_debris(dest) == 1
    assert not stale.exists() and live.exists() and look_alike.exists() and other.exists()
