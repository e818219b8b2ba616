#!/usr/bin/env bash
# Build SJTU-IPADS/PowerInfer's `main`, `quantize` and `perplexity` (CPU only) from a git checkout or
# bare mirror, outside the repo.
#
#   experiments/peers_powerinfer_build.sh SOURCE_GIT_DIR [BUILD_ROOT]
#
# SOURCE_GIT_DIR: a PowerInfer git directory (a clone or a bare mirror); its HEAD is built.
# BUILD_ROOT: where builds go (default: $POWERINFER_JAX_CACHE/peers, else ~/.cache/powerinfer_jax/peers).
# Prints the path of the built `main` binary on its last line; the source commit is in
# BUILD_ROOT/powerinfer-<commit>/COMMIT. Runs under `nice -n 10` with -j2 (a shared 2-core VM).
# Patches: none were needed with gcc 12 at commit d3ebd7c (if a later commit needs one, apply it
# here with `patch`, never by committing copies of PowerInfer's code).
set -euo pipefail
src=${1:?usage: peers_powerinfer_build.sh SOURCE_GIT_DIR [BUILD_ROOT]}
root=${2:-${POWERINFER_JAX_CACHE:-$HOME/.cache/powerinfer_jax}/peers}
gitdir=$(cd "$src" && git rev-parse --absolute-git-dir)
commit=$(git --git-dir="$gitdir" rev-parse HEAD)
dir="$root/powerinfer-${commit:0:12}"
if [[ ! -d "$dir/src" ]]; then
  mkdir -p "$dir/src"
  # A mirror may lack large blobs (vocab test files, third-party code of its other projects):
  # leave out any blob that is absent; `main` needs none of them.
  mapfile -t absent < <(git --git-dir="$gitdir" ls-tree -r "$commit" | awk '$2 == "blob" {print $3" "$4}' \
    | while read -r sha path; do git --git-dir="$gitdir" cat-file -e "$sha" 2>/dev/null || echo ":(exclude)$path"; done)
  # (git archive does not honour exclude pathspecs for blobs it cannot read: archive a tree
  # written from a temporary index without them instead)
  index=$(mktemp); trap 'rm -f "$index"' EXIT
  GIT_INDEX_FILE=$index git --git-dir="$gitdir" read-tree "$commit"
  for path in "${absent[@]}"; do
    GIT_INDEX_FILE=$index git --git-dir="$gitdir" rm -q --cached -- "${path#:(exclude)}"
  done
  tree=$(GIT_INDEX_FILE=$index git --git-dir="$gitdir" write-tree)
  git --git-dir="$gitdir" archive "$tree" | tar -x -C "$dir/src"
  echo "$commit" > "$dir/COMMIT"
  # LLAMA_NATIVE: -march=native, as our own build (the binary runs on the machine that built it).
  nice -n 10 cmake -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_NATIVE=ON \
    -DLLAMA_CUBLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$dir/cmake.log" 2>&1 \
    || { tail -30 "$dir/cmake.log" >&2; exit 1; }
fi
for target in main quantize perplexity; do
  if [[ ! -x "$dir/build/bin/$target" ]]; then
    nice -n 10 cmake --build "$dir/build" --target "$target" -j2 >>"$dir/build.log" 2>&1 \
      || { tail -40 "$dir/build.log" >&2; exit 1; }
  fi
done
echo "$dir/build/bin/main"
