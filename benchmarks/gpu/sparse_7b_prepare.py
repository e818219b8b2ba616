"""Run HERE (the machine with the files and the registries) before `sparse_7b_check.sh` on a GPU
machine: fill the git-ignored folder .gpu_carry/ with what that machine cannot reach, small
enough for the `device` tool's `carry` (64 MiB with the working tree):

  llama.cpp-src.tar.xz  the subset of the peers' llama.cpp tree (llama-cpp-python 0.3.36's
                        vendor/llama.cpp) that configures and builds llama-bench,
                        llama-batched-bench and llama-completion with CUDA: CMake files, ggml
                        core, its CPU and CUDA backends, src/, common/, vendor/ and tools/ less
                        its web UI and server (LLAMA_BUILD_SERVER=OFF never reads them); the
                        llama.cpp commit in LLAMA_CPP_COMMIT inside
  tokenizer.gguf        a tokenizer-only GGUF (no tensors) of the default model's GGUF: the
                        synthetic model takes its vocabulary (`--tokenizer`)
  calib.txt             the first --calib-bytes of ../shared/data/wiki.train.txt (training
                        text: the calibration text; ../shared does not travel)
  whl/                  wheels the GPU image lacks (gguf), for its Python 3.12
  COMMIT                this checkout's commit (+ "-dirty" when the tree has changes): the
                        device copy has no .git

    python -m benchmarks.gpu.sparse_7b_prepare [--out .gpu_carry] [--no-wheels]
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # build_llama_cpp_cuda.sh's
WHEELS = ("gguf==0.17.1",)  # prepare_wheels.sh's
CARRY_LIMIT = 64 * 2 ** 20
# The subset, relative to the llama.cpp tree: whole folders, then single files; tools/ less
# these (tools/CMakeLists.txt reads ui/ and server/ only with LLAMA_BUILD_SERVER=ON).
SUBSET_DIRS = ("cmake", "include", "src", "common", "vendor", "licenses", "ggml/cmake",
               "ggml/include", "ggml/src/ggml-cpu", "ggml/src/ggml-cuda", "tools")
SUBSET_SKIP = ("tools/ui", "tools/server", "tools/cli")
SUBSET_FILES = ("CMakeLists.txt", "LICENSE", "ggml/CMakeLists.txt")
SUBSET_GGML_SRC = "ggml/src"  # its own files (not its sub-folders: one per backend)


def llama_cpp_tree() -> Path:
    from powerinfer_jax.cache import cache_dir

    root = Path(os.environ.get("PIJ_LLAMA_CPP_SRC") or
                cache_dir() / "peers" / f"llama-cpp-python-{LLAMA_CPP_VERSION}" / "vendor" /
                "llama.cpp")
    if not (root / "CMakeLists.txt").is_file():
        sys.exit(f"llama.cpp tree: expected {root}/CMakeLists.txt (bash benchmarks/gpu/"
                 "build_llama_cpp_cuda.sh fetches the sdist), got none")
    return root


def subset_files(root: Path) -> list[Path]:
    """The subset's files (relative paths), sorted: the archive is the same for the same tree."""
    out = [Path(f) for f in SUBSET_FILES]
    out += [p.relative_to(root) for p in (root / SUBSET_GGML_SRC).iterdir() if p.is_file()]
    for d in SUBSET_DIRS:
        for p in (root / d).rglob("*"):
            rel = p.relative_to(root)
            if p.is_file() and not any(rel.is_relative_to(s) for s in SUBSET_SKIP):
                out.append(rel)
    missing = [str(f) for f in out if not (root / f).is_file()]
    if missing:
        sys.exit(f"llama.cpp tree {root}: expected the subset's files, missing {missing[:5]}")
    return sorted(set(out))


def write_subset(root: Path, dest: Path) -> dict:
    files = subset_files(root)
    tmp = dest.with_name(dest.name + ".partial")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        for f in files:
            info = tar.gettarinfo(str(root / f), arcname=f"llama.cpp/{f}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(root / f, "rb") as fh:
                tar.addfile(info, fh)
        stamp = f"{LLAMA_CPP_COMMIT}\n".encode()
        info = tarfile.TarInfo("llama.cpp/LLAMA_CPP_COMMIT")
        info.size = len(stamp)
        tar.addfile(info, io.BytesIO(stamp))
    tmp.replace(dest)
    return {"files": len(files), "bytes_source": sum((root / f).stat().st_size for f in files),
            "bytes_xz": dest.stat().st_size}


def write_tokenizer_gguf(src: Path, dest: Path) -> dict:
    """A GGUF holding only `src`'s tokenizer metadata; checked to tokenize as `src` does."""
    import gguf

    from powerinfer_jax.checkpoint.gguf import (TOKENIZER_WRITERS, _open, read_metadata,
                                                tokenizer_metadata)
    from powerinfer_jax.tokenizer import Tokenizer

    meta = tokenizer_metadata(src)
    tmp = dest.with_name(dest.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"tokenizer of {src.name} (no tensors)")
    for key, value in meta.items():
        getattr(w, TOKENIZER_WRITERS[key])(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    tmp.replace(dest)
    text = "The history of computing is a story of ideas, 1984 and naïve café."
    a = Tokenizer.from_gguf_metadata(read_metadata(_open(src))).encode(text)
    b = Tokenizer.from_gguf_metadata(read_metadata(_open(dest))).encode(text)
    if a != b:
        sys.exit(f"tokenizer.gguf: expected the tokens of {src}, got {b[:8]} vs {a[:8]}")
    return {"source": str(src), "bytes": dest.stat().st_size, "vocab": len(meta["tokens"])}


def write_calib(src: Path, dest: Path, n_bytes: int) -> dict:
    from powerinfer_jax.sparsity.corpus import read_corpus

    read_corpus([src])  # the corpus rules: an existing, non-empty, non-validation file
    text = src.read_bytes()[:n_bytes].decode("utf-8", errors="ignore")
    text = text[:text.rfind("\n") + 1] or text  # whole lines
    dest.write_text(text, encoding="utf-8")
    return {"source": str(src), "bytes": dest.stat().st_size}


def commit() -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)

    head = git("rev-parse", "--short=12", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head + ("-dirty" if dirty else "")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".gpu_carry"))
    ap.add_argument("--tokenizer-model", default=None,
                    help="the GGUF whose tokenizer to carry (default: the default model's)")
    ap.add_argument("--calib-text", default=None,
                    help="training text (default: ../shared/data/wiki.train.txt)")
    ap.add_argument("--calib-bytes", type=int, default=400_000)
    ap.add_argument("--wheels", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                    help="pack the llama.cpp source subset")
    args = ap.parse_args(argv)
    from powerinfer_jax.checkpoint import resolve_model
    from powerinfer_jax.config import DEFAULT_MODEL
    from powerinfer_jax.sparsity.corpus import default_corpus_files

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    t0 = time.perf_counter()
    if args.llama_cpp:
        report["llama.cpp-src.tar.xz"] = write_subset(llama_cpp_tree(),
                                                      out / "llama.cpp-src.tar.xz")
    tok_src = Path(resolve_model(args.tokenizer_model or DEFAULT_MODEL))
    report["tokenizer.gguf"] = write_tokenizer_gguf(tok_src, out / "tokenizer.gguf")
    calib = Path(args.calib_text) if args.calib_text else default_corpus_files()[0]
    report["calib.txt"] = write_calib(calib, out / "calib.txt", args.calib_bytes)
    if args.wheels:
        (out / "whl").mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                        "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                        "manylinux2014_x86_64", "--platform", "any", "-d", str(out / "whl"),
                        *WHEELS], check=True)
    (out / "COMMIT").write_text(commit() + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    for name, r in report.items():
        print(f"{name}: {r}")
    print(f"{out}: {total / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.0f} s, commit "
          f"{(out / 'COMMIT').read_text().strip()}")
    if total > CARRY_LIMIT // 2:
        print(f"warning: {out} is {total / 2 ** 20:.1f} MiB of the 64 MiB the device tool "
              "carries with the working tree", file=sys.stderr)


if __name__ == "__main__":
    main()
