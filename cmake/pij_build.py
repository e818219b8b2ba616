"""The build backend pip runs (pyproject.toml [build-system]): scikit-build-core's, with jaxlib
asked for only when the environment being installed into lacks it.

The C++ extension compiles against XLA's FFI headers, which ship inside jaxlib. pip builds in a
new isolated environment every time, and a static `jaxlib` build requirement had pip install
jaxlib (with scipy, numpy, ml_dtypes) into it at every `pip install -e .`, about 13 s of a 16 s
re-install that compiled nothing. The environment being installed into usually holds a
suitable jaxlib already (it is a runtime dependency): the build then takes the headers from it
(cmake/python_deps.cmake), which are also the headers of the jaxlib the module will run with.
Where it has none (a first install into a new environment), jaxlib is a build requirement as
before."""
from __future__ import annotations

import subprocess
import sys

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # the hooks pip calls, unchanged
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
           "get_requires_for_build_sdist", "get_requires_for_build_wheel",
           "prepare_metadata_for_build_editable", "prepare_metadata_for_build_wheel"]

JAXLIB = "jaxlib>=0.10"  # as [project] dependencies and the headers the sources need

# -I: the interpreter's own environment, not the isolated build environment pip put on its path;
# the version only where the FFI headers are there too (what cmake/python_deps.cmake looks for)
_PROBE = ("import os, jaxlib, jaxlib.version as v; "
          "h = os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "
          "'include', 'xla', 'ffi', 'api', 'ffi.h'); "
          "print(v.__version__ if os.path.isfile(h) else '')")


def installed_jaxlib() -> str | None:
    """The version of jaxlib in the environment pip installs into, or None (none there, or one
    without the XLA FFI headers)."""
    try:
        out = subprocess.run([sys.executable, "-I", "-c", _PROBE], capture_output=True,
                             text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _jaxlib_requirement() -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion

    version = installed_jaxlib()
    try:
        if version is not None and Requirement(JAXLIB).specifier.contains(version):
            return []
    except InvalidVersion:
        pass
    return [JAXLIB]


def get_requires_for_build_wheel(config_settings=None):
    return _skbuild.get_requires_for_build_wheel(config_settings) + _jaxlib_requirement()


def get_requires_for_build_editable(config_settings=None):
    return _skbuild.get_requires_for_build_editable(config_settings) + _jaxlib_requirement()
