#!/usr/bin/env bash
# Make Q4_K_M and Q8_0 SmolLM2-135M GGUFs with llama.cpp's own `llama-quantize`, for
# benchmarks/quant_ppl_vs_hf.py (issue 14's quality check: perplexity of a Q4_1, a Q4_K_M and a
# Q8_0 file within 1% of HF transformers' on the same file).
#
#   bash benchmarks/make_quantized_smollm2.sh LLAMA_CPP_SRC [OUT_DIR]
#
# LLAMA_CPP_SRC: a llama.cpp source tree (the one the peers use:
#   <cache>/peers/llama-cpp-python-0.3.36/vendor/llama.cpp).
# OUT_DIR: default <cache>/models/smollm2-135m/quant, <cache> = ${POWERINFER_JAX_CACHE:-~/.cache/powerinfer_jax}.
#
# The only source weights on hand are the registry's Q4_1 file, so the source of the
# quantization is the F32 GGUF of its dequantized weights (experiments/peers.py `peer_ggufs`,
# written once next to the registry file): the Q4_K_M and Q8_0 files are *requantized from the
# dequantized Q4_1*, not quantized from the original BF16 release.
# SmolLM2's d_model = 576 is not a multiple of 256 (d_ff = 1536 is): llama-quantize falls back
# for every matrix with 576-value rows (attn q/k/v/o, ffn gate/up, token_embd), Q4_K -> Q5_0 and
# Q6_K -> Q8_0, so the "Q4_K_M" file's only K-quant tensors are the ffn_down matrices
# (measured: F32 61, Q4_K 16, Q5_0 166, Q6_K 14, Q8_0 15; Q8_0 file: F32 61, Q8_0 211).
# llama-quantize is built once (CPU, static, Release) under <cache>/peers/llamacpp-quantize.
# JOBS=2, NICE=10. TYPES="Q4_K_M Q8_0" (default) picks the outputs. Prints each output's tensor
# type counts (gguf package) and, on its last lines, the output paths.
set -euo pipefail

SRC="${1:?usage: make_quantized_smollm2.sh LLAMA_CPP_SRC [OUT_DIR]}"
CACHE="${POWERINFER_JAX_CACHE:-${HOME}/.cache/powerinfer_jax}"
OUT="${2:-${CACHE}/models/smollm2-135m/quant}"
BUILD="${CACHE}/peers/llamacpp-quantize"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
TYPES="${TYPES:-Q4_K_M Q8_0}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
[[ -f "${SRC}/CMakeLists.txt" ]] || { echo "no llama.cpp tree at ${SRC}" >&2; exit 2; }

QUANTIZE="${BUILD}/bin/llama-quantize"
if [[ ! -x "${QUANTIZE}" ]]; then
  nice -n "${NICE}" cmake -S "${SRC}" -B "${BUILD}" -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
  nice -n "${NICE}" cmake --build "${BUILD}" --config Release -j "${JOBS}" --target llama-quantize
fi

# The F32 source: the dequantized registry Q4_1 (written once by peer_ggufs).
F32="$(cd "${REPO}" && nice -n "${NICE}" python3 - <<'EOF'
from pathlib import Path
from powerinfer_jax.checkpoint import load_checkpoint, resolve_model
from experiments.peers import peer_ggufs
src = Path(resolve_model("smollm2-135m"))
dst = src.parent / "peers" / f"{src.stem.split('.')[0]}.F32.gguf"
ckpt = None if dst.is_file() and (dst.parent / f"{src.stem.split('.')[0]}.BF16.gguf").is_file() \
    else load_checkpoint(str(src))
print(peer_ggufs("smollm2-135m", ckpt)["F32"])
EOF
)"
[[ -f "${F32}" ]] || { echo "no F32 GGUF (${F32})" >&2; exit 1; }

mkdir -p "${OUT}"
STEM="$(basename "${F32}" .F32.gguf)"
OUTS=()
for t in ${TYPES}; do
  dst="${OUT}/${STEM}.${t}.gguf"
  if [[ ! -f "${dst}" ]]; then
    nice -n "${NICE}" "${QUANTIZE}" "${F32}" "${dst}.tmp" "${t}" "${JOBS}"
    mv "${dst}.tmp" "${dst}"
  fi
  OUTS+=("${dst}")
done

python3 - "${OUTS[@]}" <<'EOF'
import collections, sys
from gguf import GGUFReader
for path in sys.argv[1:]:
    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    print(path, dict(sorted(counts.items())), file=sys.stderr)
EOF
printf '%s\n' "${OUTS[@]}"
