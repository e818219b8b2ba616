"""One small op test under the AddressSanitizer + UndefinedBehaviorSanitizer build (BUILD.md,
`PIJ_SANITIZE`), when that build exists: its build directory `build/sanitize` and its venv
(`$PIJ_SANITIZE_VENV`, else `../venv-san` beside the checkout). CI never builds it, so there this
skips; the whole op suite under the sanitizers is the documented run whose result is a row in
benchmarks/sanitizers.jsonl."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _sanitizer_python() -> Path | None:
    venv = Path(os.environ.get("PIJ_SANITIZE_VENV", REPO.parent / "venv-san"))
    python = venv / "bin" / "python"
    return python if (REPO / "build" / "sanitize").is_dir() and python.is_file() else None


def _runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(_sanitizer_python() is None,
                    reason="no sanitizer build (BUILD.md: PIJ_SANITIZE, build/sanitize)")
def test_an_op_test_under_asan_and_ubsan_reports_nothing(tmp_path):
    python = _sanitizer_python()
    # reports to files: the inner pytest drops a passing test's stderr, and UBSan goes on
    logs = tmp_path / "reports"
    logs.mkdir()
    env = {**os.environ, "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libstdc++.so')}",
           "ASAN_OPTIONS": f"detect_leaks=0:log_path={logs}/asan",
           "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={logs}/ubsan"}
    check = subprocess.run([str(python), "-c", "from powerinfer_jax import _pij_ext; "
                            "print(_pij_ext.__file__)"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_ops_drelu.py"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    reports = "".join(f.read_text(errors="replace") for f in logs.iterdir())
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out, out[-3000:]
    assert not reports, reports[-3000:]
