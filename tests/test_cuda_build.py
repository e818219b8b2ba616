"""The CUDA sources must keep compiling (nvcc is on the CI machines; no GPU is needed to build).

Builds the CUDA kernel library and the _pij_cuda nanobind module in a temporary directory with
the same CMakeLists.txt the pip build uses. Skips with a reason where nvcc or cmake is absent.
Running the kernels needs a GPU: see tests/test_cuda_kernels.py.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _nvcc():
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


@pytest.mark.skipif(_nvcc() is None or shutil.which("cmake") is None,
                    reason="nvcc or cmake not installed")
def test_cuda_sources_compile(tmp_path):
    env = dict(os.environ, CUDACXX=_nvcc())
    configure = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(tmp_path), "-DPIJ_CUDA=ON",
         f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True, env=env)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    # The kernel library (both .cu files) and the nanobind module with the hybrid handler's
    # cold-row store bindings.
    build = subprocess.run(
        ["cmake", "--build", str(tmp_path), "--target", "pij_cuda_kernels", "_pij_cuda", "-j", "2"],
        capture_output=True, text=True, env=env)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert list(tmp_path.rglob("libpij_cuda_kernels.a"))
    assert list(tmp_path.rglob("_pij_cuda*.so"))
