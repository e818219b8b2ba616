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


def _backend():
    """cmake/pij_build.py, the backend pip runs (it imports scikit-build-core)."""
    import importlib.util

    pytest.importorskip("scikit_build_core")
    spec = importlib.util.spec_from_file_location("pij_build", REPO / "cmake" / "pij_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_backend_asks_for_jaxlib_only_where_the_target_lacks_a_suitable_one(monkeypatch):
    import jaxlib.version

    backend = _backend()
    assert backend.installed_jaxlib() == jaxlib.version.__version__  # this environment's
    for installed, extra in (("0.10.2", []), ("0.11.0", []), (None, [backend.JAXLIB]),
                             ("0.9.9", [backend.JAXLIB]), ("not a version", [backend.JAXLIB])):
        monkeypatch.setattr(backend, "installed_jaxlib", lambda v=installed: v)
        assert backend.get_requires_for_build_editable() == \
            backend._skbuild.get_requires_for_build_editable() + extra, installed
        assert backend.get_requires_for_build_wheel() == \
            backend._skbuild.get_requires_for_build_wheel() + extra, installed


def test_cmake_finds_the_ffi_headers_outside_an_isolated_build_environment(tmp_path):
    """pip's build environment hides the target's packages; a jaxlib that fails to import
    stands for it here: the headers are then found with `python -I`, the target's."""
    import sys

    import jax.ffi

    hidden = tmp_path / "isolated" / "jaxlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not in the build environment')\n")
    script = tmp_path / "find.cmake"
    script.write_text(f'set(Python_EXECUTABLE "{sys.executable}")\n'
                      f'include("{REPO / "cmake" / "python_deps.cmake"}")\n'
                      'pij_find_python_deps(ffi nb)\nmessage(STATUS "FFI=${ffi}")\n')
    for pythonpath in ("", str(tmp_path / "isolated")):
        out = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": pythonpath})
        assert out.returncode == 0, out.stderr
        assert f"FFI={jax.ffi.include_dir()}" in out.stdout, (pythonpath, out.stdout)
