#!/usr/bin/env bash
# Run HERE (the machine with the registries), before a GPU check: download the Python packages the
# GPU machine's image lacks as wheels for its python3 (3.12) into .whl/ (git-ignored), which the
# runner call carries (`carry: [".whl"]`) and build_and_test.sh installs into /tmp/site.
# The image has jax, flax, nanobind, tokenizers, transformers, ... but not `gguf` (the first run
# on 2026-11-27 failed on its import). Usage: bash benchmarks/gpu/prepare_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(gguf==0.17.1)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl "${WHEELS[@]}"
ls .whl
