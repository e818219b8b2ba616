"""Every instruction set the build offers (CMakeLists.txt's PIJ_ISA) must keep compiling, not only
the one this machine builds natively: the kernels choose their code at compile time, so an
AVX2-only or a portable (scalar) path can break unseen on an AVX-512 machine (the scalar path
did: an overload that became ambiguous). Each ISA's flags compile every cpu_backend source
(syntax and templates, no code generation) in one background job (helpers_background).
"""
import re
import shutil
from pathlib import Path

import pytest

import helpers_background

REPO = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")


def isa_flags() -> dict[str, str]:
    """PIJ_ISA name -> its compiler flags, read from CMakeLists.txt (native is the suite's own
    build)."""
    text = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    avx2 = re.search(r"set\(PIJ_AVX2_FLAGS ([^)]*)\)", text).group(1).split()
    flags = {"scalar": [], "avx2": avx2}
    for isa, extra in re.findall(r'PIJ_ISA STREQUAL "(\w+)"\)[^\n]*\n\s*set\(PIJ_ISA_FLAGS '
                                 r'\$\{PIJ_AVX2_FLAGS\}([^)]*)\)', text):
        flags[isa] = avx2 + extra.split()
    return {isa: " ".join(f) for isa, f in flags.items()}


def _start():
    if CXX is None:
        return
    sources = " ".join(str(p) for p in sorted((REPO / "cpu_backend").glob("*.cc")))
    script = "; ".join(
        f'for f in {sources}; do "$1" -std=c++20 -fsyntax-only -I"$2" {flags} "$f" || '
        f'echo "FAILED {isa} $f"; done'
        for isa, flags in isa_flags().items())
    helpers_background.start("isa_builds", ["bash", "-c", script, "isa", CXX, str(REPO)])


BACKGROUND = {"test_every_isa_compiles": _start}


def test_isa_flags_cover_the_builds_isas():
    assert set(isa_flags()) == {"scalar", "avx2", "avxvnni", "avx512"}
    assert "-mavxvnni" in isa_flags()["avxvnni"] and "-mavx512f" in isa_flags()["avx512"]


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")
def test_every_isa_compiles():
    r = helpers_background.finish("isa_builds", timeout=900)
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
    assert not failed and r.returncode == 0, "\n".join(failed) + r.stderr[-4000:]
