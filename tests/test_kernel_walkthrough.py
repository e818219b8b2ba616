"""BUILD.md's "Adding a CPU kernel" stays true: its files are few and new, every adapter's
PIJ_CPU_TARGET line reaches the module's registrations, and (slow) the walkthrough's own files,
read from BUILD.md, compile against this checkout's headers, register through the target table
and pass their own test against their reference.

The slow test compiles the example's adapter with the two small files it links to (ffi_util.cc,
cpu_targets.cc) into a library of its own, not the whole extension: ~20 s on 2 cores."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Adding a CPU kernel"
# where each kind of file of a kernel goes; each place is picked up without editing a list
PLACES = (r"cpu_backend/\w+\.(h|cc)", r"xla_ffi/\w+_cpu\.cc", r"powerinfer_jax/ops/\w+\.py",
          r"tests/test_\w+\.py")


def walkthrough() -> dict[str, str]:
    """{path: text} of the files BUILD.md's walkthrough adds, in its order."""
    text = (REPO / "BUILD.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    section = text[start:end]
    files = re.findall(r"File `([\w/.]+)`:\n\n```\w*\n(.*?)```", section, re.S)
    return dict(files)


def test_the_walkthrough_adds_at_most_five_new_files_in_globbed_places():
    files = walkthrough()
    assert 3 <= len(files) <= 5, sorted(files)
    for path in files:
        assert any(re.fullmatch(p, path) for p in PLACES), path
        assert not (REPO / path).exists(), f"{path}: the walkthrough's example is not a real file"
    cmake = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    assert "cpu_backend/*.cc" in cmake and "xla_ffi/*_cpu.cc" in cmake  # the globs it relies on


def test_every_adapter_target_is_registered():
    ext = pytest.importorskip("powerinfer_jax._pij_ext", reason="the extension is not built")
    from powerinfer_jax.ops import _ffi

    lines = {}
    for f in sorted((REPO / "xla_ffi").glob("*_cpu.cc")):
        for name, symbol in re.findall(r'^PIJ_CPU_TARGET\("(\w+)", (\w+)\);',
                                       f.read_text(encoding="utf-8"), re.M):
            assert name not in lines, f"{name} in {lines.get(name)} and {f.name}"
            lines[name] = f.name
    assert set(ext.registrations()) == set(lines)
    named = {v for k, v in vars(_ffi).items() if k.endswith("_TARGET") and isinstance(v, str)}
    assert named - {_ffi.HYBRID_TARGET} <= set(lines)  # the CUDA one lives in _pij_cuda


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


@pytest.mark.slow
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler (CXX, c++ or g++)")
def test_the_walkthrough_kernel_builds_registers_and_passes_its_test(tmp_path, monkeypatch):
    import jax

    pytest.importorskip("powerinfer_jax._pij_ext", reason="the extension is not built")
    files = walkthrough()
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    adapter = next(p for p in files if p.startswith("xla_ffi/"))
    op_path = next(p for p in files if p.startswith("powerinfer_jax/ops/"))
    test_path = next(p for p in files if p.startswith("tests/"))
    shim = tmp_path / "table.cc"  # reads the target table back, for this test only
    shim.write_text('#include "xla_ffi/cpu_targets.h"\n'
                    'extern "C" int TableSize() { return (int)pij::CpuTargets().size(); }\n'
                    'extern "C" const char* TableName(int i) { return pij::CpuTargets()[i].name; }\n')
    lib = tmp_path / "libwalkthrough.so"
    cmd = [_compiler(), "-std=c++20", "-O1", "-fPIC", "-shared", f"-I{tmp_path}", f"-I{REPO}",
           "-isystem", jax.ffi.include_dir(), str(tmp_path / adapter), str(shim),
           str(REPO / "xla_ffi" / "ffi_util.cc"), str(REPO / "xla_ffi" / "cpu_targets.cc"),
           "-o", str(lib)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    so = ctypes.CDLL(str(lib))
    so.TableName.restype = ctypes.c_char_p
    table = [so.TableName(i).decode() for i in range(so.TableSize())]
    module = Path(op_path).stem
    spec = importlib.util.spec_from_file_location(f"powerinfer_jax.ops.{module}", tmp_path / op_path)
    op = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op)
    assert table == [op.TARGET]  # the adapter's one PIJ_CPU_TARGET line
    symbol = re.search(r"PIJ_CPU_TARGET\(\"\w+\", (\w+)\)", files[adapter]).group(1)
    # what ops._ffi does for every entry of the module's table
    jax.ffi.register_ffi_target(op.TARGET, jax.ffi.pycapsule(getattr(so, symbol)), platform="cpu")

    import powerinfer_jax.ops as ops_pkg

    monkeypatch.setitem(sys.modules, f"powerinfer_jax.ops.{module}", op)
    monkeypatch.setattr(ops_pkg, module, op, raising=False)
    spec = importlib.util.spec_from_file_location("walkthrough_test", tmp_path / test_path)
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    ran = 0
    for name, fn in vars(tests).items():
        if not name.startswith("test_"):
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        if marks:  # one parametrize: run every value
            (argname, values), = [m.args for m in marks]
            for v in values:
                fn(**{argname: v})
                ran += 1
        else:
            fn()
            ran += 1
    assert ran >= 2
