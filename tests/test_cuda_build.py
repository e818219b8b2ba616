"""The CUDA sources must keep compiling (nvcc is on the CI machines; no GPU is needed to build).

Builds the CUDA kernel library and the _pij_cuda nanobind module in a temporary directory with
the same CMakeLists.txt the pip build uses, in the background from the suite's start
(helpers_background). Skips with a reason where nvcc or cmake is absent.
Running the kernels needs a GPU: see tests/test_cuda_kernels.py.
"""
import os
import shutil
import sys
from pathlib import Path

import pytest

import helpers_background

pytestmark = pytest.mark.slow  # a CUDA build: ~3 min on 2 cores

REPO = Path(__file__).resolve().parents[1]


def _nvcc():
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


_HAVE_TOOLS = _nvcc() is not None and shutil.which("cmake") is not None


def _start_build():
    """Configure and build in one background job (helpers_background): ~3 min on 2 cores."""
    if not _HAVE_TOOLS:
        return
    script = ('cmake -S "$1" -B "$2" -DPIJ_CUDA=ON -DPython_EXECUTABLE="$3" && '
              'cmake --build "$2" --target pij_cuda_kernels _pij_cuda -j 2')
    helpers_background.start("cuda_build", ["bash", "-c", script, "build", str(REPO),
                                            "{workdir}/build", sys.executable],
                             env=dict(os.environ, CUDACXX=_nvcc()))


BACKGROUND = {"test_cuda_sources_compile": _start_build}


@pytest.mark.skipif(not _HAVE_TOOLS, reason="nvcc or cmake not installed")
def test_cuda_sources_compile():
    # The kernel library (both .cu files) and the nanobind module with the hybrid handler's
    # cold-row store bindings, with the same CMakeLists.txt the pip build uses.
    r = helpers_background.finish("cuda_build", timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = helpers_background.workdir("cuda_build") / "build"
    assert list(out.rglob("libpij_cuda_kernels.a"))
    assert list(out.rglob("_pij_cuda*.so"))
