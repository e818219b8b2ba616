"""A re-install with nothing changed compiles nothing (CMakeLists.txt, cmake/pip_build.cmake):
pip's build runs in a new temporary environment each time, so the nested build compiles against
copies of that environment's headers (nanobind, XLA's FFI) that `pij_sync_tree` rewrites only
where a file changed. Here that copy: unchanged files keep their timestamps (nothing that
includes them is out of date), a changed one is rewritten, a new one appears."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")


def _sync(src: Path, dst: Path) -> None:
    script = src.parent / "sync.cmake"
    script.write_text(f'include("{REPO / "cmake" / "python_deps.cmake"}")\n'
                      f'pij_sync_tree("{src}" "{dst}")\n')
    out = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_header_copy_rewrites_only_what_changed(tmp_path):
    src, dst = tmp_path / "env-1" / "nanobind", tmp_path / "build" / "_deps" / "nanobind"
    (src / "include" / "nanobind").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / "include" / "nanobind" / "nanobind.h").write_text("// v1\n")
    (src / "src.cpp").write_text("int x;\n")
    (src / "__pycache__" / "x.pyc").write_bytes(b"\0")
    _sync(src, dst)
    assert (dst / "include" / "nanobind" / "nanobind.h").read_text() == "// v1\n"
    assert not (dst / "__pycache__").exists()
    old = 1_000_000_000
    for f in (dst / "include" / "nanobind" / "nanobind.h", dst / "src.cpp"):
        os.utime(f, (old, old))
    # the next pip build: the same files in another temporary environment, one changed, one new
    src2 = tmp_path / "env-2" / "nanobind"
    shutil.copytree(src, src2)
    (src2 / "src.cpp").write_text("int y;\n")
    (src2 / "new.h").write_text("// new\n")
    _sync(src2, dst)
    assert (dst / "include" / "nanobind" / "nanobind.h").stat().st_mtime == old
    assert (dst / "src.cpp").read_text() == "int y;\n" and (dst / "src.cpp").stat().st_mtime > old
    assert (dst / "new.h").is_file()
