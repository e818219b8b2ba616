"""llama.cpp's own tools for tests: its source tree (convert_hf_to_gguf.py with its gguf-py) and,
when built, its CPU binaries (llama-quantize).

The tree is the one the peers build: llama-cpp-python 0.3.36's sdist, vendor/llama.cpp, looked
for at $PIJ_LLAMA_CPP_SRC, else <cache>/peers/llama-cpp-python-0.3.36/vendor/llama.cpp. When it
is absent, `tree()` fetches the sdist once with `pip download` (PyPI: CI machines have no copy)
and unpacks the parts tests use; where that fails, tests skip with the reason.

Run as a script, this file converts HF directories in one process (torch imported once):
  python tests/helpers_llamacpp.py TREE DIR OUT PRE OUTTYPE [DIR OUT PRE OUTTYPE ...]
PRE: the `tokenizer.ggml.pre` to write for a byte-level BPE vocabulary, or "-" for the
converter's own detection. The converter names a BPE pre-tokenizer by hashing the ids of a
test string under the model's whole vocabulary, so only the published vocabularies are
recognised; a tokenizer trained here with Llama-3's or Qwen2's pre-tokenizer (the same split
rules, a small vocabulary) gets its family's name from the caller instead. Nothing else of the
conversion is changed.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
_MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
            "vendor/llama.cpp/gguf-py/", "vendor/llama.cpp/models/ggml-vocab-")


def cache_root() -> Path:
    env = os.environ.get("POWERINFER_JAX_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "powerinfer_jax"


def _has_converter(p: Path) -> bool:
    return (p / "convert_hf_to_gguf.py").is_file() and (p / "gguf-py").is_dir()


@functools.cache
def tree() -> tuple[Path | None, str]:
    """(llama.cpp source tree, "") or (None, why not)."""
    env = os.environ.get("PIJ_LLAMA_CPP_SRC")
    if env:
        p = Path(env)
        return (p, "") if _has_converter(p) else (None, f"$PIJ_LLAMA_CPP_SRC={env} has no "
                                                   "convert_hf_to_gguf.py")
    peers = cache_root() / "peers"
    p = peers / f"llama-cpp-python-{VERSION}" / "vendor" / "llama.cpp"
    if _has_converter(p):
        return p, ""
    return _fetch(peers, p)


def _fetch(peers: Path, p: Path) -> tuple[Path | None, str]:
    """pip download the sdist (--no-binary for this one package: the source, ~75 MB) and unpack
    convert_hf_to_gguf.py, conversion/, gguf-py/ and the vocab test files into `p`. pip prepares
    the sdist's metadata in a build environment; `--no-binary :all:` would build that
    environment's own packages (cmake among them) from source too: 215 s against 5 s here."""
    sdist = peers / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
               "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", str(sdist.parent)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"no llama.cpp tree and `pip download llama-cpp-python=={VERSION}` failed: {e}"
        if r.returncode != 0 or not sdist.is_file():
            return None, (f"no llama.cpp tree at {p} and `pip download llama-cpp-python=={VERSION}`"
                          f" failed: {r.stderr.strip()[-300:]}")
    top = f"llama_cpp_python-{VERSION}/"
    tmp = peers / f".unpack-{os.getpid()}"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(top) and m.name[len(top):].startswith(_MEMBERS)]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, members=members, filter="data")
        else:  # Python 3.11.0-3.11.3 has no extraction filters: plain files and folders only
            bad = [m.name for m in members if not (m.isfile() or m.isdir())
                   or m.name.startswith("/") or ".." in Path(m.name).parts]
            if bad:
                return None, f"{sdist}: expected plain files under {top}, got {bad[:3]}"
            tar.extractall(tmp, members=members)
    dest = p.parent.parent  # .../llama-cpp-python-VERSION
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not _has_converter(p):
        os.replace(tmp / top.rstrip("/"), dest)
    return (p, "") if _has_converter(p) else (None, f"unpacking {sdist} gave no converter")


def binary(name: str) -> Path | None:
    """A llama.cpp CPU binary (llama-quantize, llama-bench): $PIJ_LLAMA_CPP_BIN, else the native
    build under <cache>/peers (benchmarks/build_llama_bench_cpu.sh), else None."""
    dirs = [os.environ.get("PIJ_LLAMA_CPP_BIN")] + [
        str(cache_root() / "peers" / b / "bin") for b in ("llamacpp-cpu-native",
                                                          "llamacpp-quantize",
                                                          "llamacpp-cpu-avx2")]
    for d in dirs:
        if d and (Path(d) / name).is_file() and os.access(Path(d) / name, os.X_OK):
            return Path(d) / name
    return None


def convert(jobs, *, timeout: int = 600) -> None:
    """Convert [(hf_dir, out_gguf, pre, outtype)] with llama.cpp's convert_hf_to_gguf.py in one
    subprocess. Raises RuntimeError with the converter's output tail on failure."""
    src, why = tree()
    if src is None:
        raise RuntimeError(why)
    args = [sys.executable, __file__, str(src)]
    for d, out, pre, outtype in jobs:
        args += [str(d), str(out), pre or "-", outtype]
    env = {**os.environ, "PYTHONPATH": ""}  # its own gguf-py, never the installed package
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {r.returncode}):\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")


def quantize(src: Path, out: Path, qtype: str, *, threads: int = 2) -> None:
    exe = binary("llama-quantize")
    if exe is None:
        raise RuntimeError("no llama-quantize build")
    r = subprocess.run([str(exe), str(src), str(out), qtype, str(threads)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-quantize failed (exit {r.returncode}): "
                           f"{(r.stdout + r.stderr)[-2000:]}")


def _main(argv: list[str]) -> None:
    import runpy

    src = argv[0]
    # llama.cpp's converter and its gguf-py are a source tree, not installed: run them from it
    sys.path.insert(0, src + "/gguf-py")
    sys.path.insert(0, src)
    import conversion.base as base  # noqa: E402  (the tree's own package)

    detect = base.TextModel.get_vocab_base_pre
    for i in range(1, len(argv), 4):
        d, out, pre, outtype = argv[i:i + 4]
        base.TextModel.get_vocab_base_pre = (detect if pre == "-"
                                             else (lambda self, tokenizer, pre=pre: pre))
        sys.argv = ["convert_hf_to_gguf.py", d, "--outfile", out, "--outtype", outtype]
        runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1:])
