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
  llama-bin.tar.xz      with --llama-bin (default: .peers/llama.cpp-cuda when it holds one):
                        a llama.cpp CUDA build made HERE by build_llama_cpp_cuda.sh without
                        CPU_NATIVE (sm_90, every x86 CPU level as a backend chosen at run time,
                        so it runs on any host), stripped; the check then times llama.cpp
                        without building it there (the build took 417 s of the check's 560 on
                        an H200's 16 cores). cuBLAS is not packed: the GPU image's is used
  COMMIT                this checkout's commit (+ "-dirty" when the tree has changes): the
                        device copy has no .git

    python -m benchmarks.gpu.sparse_7b_prepare [--out .gpu_carry] [--no-wheels]
        [--llama-bin DIR | --no-llama-bin]
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
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


def add_file(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    """`path` into `tar` as `arcname`, owned by nobody in particular (uid 0, no names): the
    archive says nothing of this machine's users."""
    info = tar.gettarinfo(str(path), arcname=arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    with open(path, "rb") as fh:
        tar.addfile(info, fh)


def write_subset(root: Path, dest: Path) -> dict:
    files = subset_files(root)
    tmp = dest.with_name(dest.name + ".partial")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        for f in files:
            add_file(tar, root / f, f"llama.cpp/{f}")
        stamp = f"{LLAMA_CPP_COMMIT}\n".encode()
        info = tarfile.TarInfo("llama.cpp/LLAMA_CPP_COMMIT")
        info.size = len(stamp)
        tar.addfile(info, io.BytesIO(stamp))
    tmp.replace(dest)
    return {"files": len(files), "bytes_source": sum((root / f).stat().st_size for f in files),
            "bytes_xz": dest.stat().st_size}


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worktree_bytes() -> int:
    """What the remote runner carries of this checkout besides `carry`: tracked files and untracked
    ones git does not ignore."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True)
    names = [n for n in out.stdout.decode().split("\0") if n]
    return sum((REPO / n).stat().st_size for n in names if (REPO / n).is_file())


def write_llama_bin(src: Path, dest: Path) -> dict:
    """Pack a portable llama.cpp CUDA build (build_llama_cpp_cuda.sh's staged folder, CPU
    backends for every level) as llama-bin/ in an xz tar, binaries and libraries stripped of
    what the loader does not need. BUILD_INFO says where it was packed; its cuBLAS folder is this
    machine's, so the check looks for the GPU image's own (sparse_7b_check.sh)."""
    info = src / "BUILD_INFO"
    if not info.is_file():
        sys.exit(f"--llama-bin {src}: expected a folder staged by build_llama_cpp_cuda.sh (with "
                 "BUILD_INFO), got none")
    lines = info.read_text().splitlines()
    if "cpu all-variants" not in lines:
        sys.exit(f"--llama-bin {src}: expected a build with every CPU level (BUILD_INFO 'cpu "
                 f"all-variants': build_llama_cpp_cuda.sh without CPU_NATIVE), got "
                 f"{[l for l in lines if l.startswith('cpu ')]}: it would run only on this CPU")
    if not (src / "llama-bench").is_file():
        sys.exit(f"--llama-bin {src}: expected llama-bench in it, got none")
    strip = shutil.which("strip")
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "llama-bin"
        stage.mkdir()
        for f in sorted(src.iterdir()):
            if f.is_file():
                shutil.copy2(f, stage / f.name)
                if strip and f.name != "BUILD_INFO":
                    subprocess.run([strip, "--strip-unneeded", str(stage / f.name)], check=True)
        packed = [l for l in lines if not l.startswith(("cublas_lib ", "packed "))]
        packed += ["cublas_lib none", f"packed {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                   f" from {src}"]
        (stage / "BUILD_INFO").write_text("\n".join(packed) + "\n")
        part = dest.with_name(dest.name + ".partial")
        with tarfile.open(part, "w:xz", preset=9) as tar:
            for f in sorted(stage.iterdir()):
                add_file(tar, f, f"llama-bin/{f.name}")
        part.replace(dest)
        return {"source": str(src), "files": len(list(stage.iterdir())),
                "bytes_stripped": tree_bytes(stage), "bytes_xz": dest.stat().st_size}


def default_llama_bin() -> Path | None:
    d = REPO / ".peers" / "llama.cpp-cuda"
    return d if (d / "BUILD_INFO").is_file() else None


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
    ap.add_argument("--llama-bin", default=None,
                    help="a portable llama.cpp CUDA build to pack (default: .peers/llama.cpp-cuda "
                         "when it exists)")
    ap.add_argument("--no-llama-bin", dest="pack_llama_bin", action="store_false",
                    help="pack no llama.cpp build (the check builds one on the GPU machine)")
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
    llama_bin = Path(args.llama_bin) if args.llama_bin else default_llama_bin()
    if args.pack_llama_bin and llama_bin is not None:
        report["llama-bin.tar.xz"] = write_llama_bin(llama_bin, out / "llama-bin.tar.xz")
    elif not args.pack_llama_bin and (out / "llama-bin.tar.xz").exists():
        (out / "llama-bin.tar.xz").unlink()  # said: the check builds llama.cpp there
    (out / "COMMIT").write_text(commit() + "\n")
    total = tree_bytes(out)
    carried = total + worktree_bytes() if out.resolve().is_relative_to(REPO) else 0
    if carried > CARRY_LIMIT:
        sys.exit(f"{out}: expected at most {CARRY_LIMIT >> 20} MiB with the working tree (the "
                 f"remote runner's carry), got {carried / 2 ** 20:.1f} MiB "
                 f"({total / 2 ** 20:.1f} MiB of it here): pack less (--no-llama-bin)")
    for name, r in report.items():
        print(f"{name}: {r}")
    print(f"{out}: {total / 2 ** 20:.1f} MiB in {time.perf_counter() - t0:.0f} s, commit "
          f"{(out / 'COMMIT').read_text().strip()}")


if __name__ == "__main__":
    main()
