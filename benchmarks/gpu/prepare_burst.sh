#!/usr/bin/env bash
# Run HERE (the build machine) before a GPU burst (train_burst.sh): stage what the GPU machine
# lacks into .burst/ (git-ignored), in two parts that each fit a runner call's 64 MiB:
#   .burst/p1/teacher.gguf.part1   the first half of SmolLM2-135M-Instruct.Q4_1.gguf (~47 MiB)
#   .burst/p2/teacher.gguf.part2   the second half
#   .burst/p2/manifest.json        the whole file's and each part's size and sha256
#   .burst/p2/train_ids.npy        wiki.train tokenized by the model's tokenizer (uint16)
#   .burst/p2/valid_ids.npy        wiki.valid, likewise (evaluation only, never trained on)
# and the gguf wheel into .whl/ (prepare_wheels.sh). Usage: bash benchmarks/gpu/prepare_burst.sh
# Then: call 1 carries .burst/p1, call 2 carries .burst/p2 and .whl (train_burst.sh says how).
# Texts: the project's wiki.train / wiki.valid (PIJ_TRAIN_TEXT / PIJ_VALID_TEXT override them).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
rm -rf .burst && mkdir -p .burst/p1 .burst/p2
$PY - <<'EOF'
import hashlib, json, os
from pathlib import Path
import numpy as np
from powerinfer_jax.checkpoint import load_checkpoint
from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, resolve_model
from powerinfer_jax.sparsity import corpus

name = "smollm2-135m"
gguf = resolve_model(name)  # fetched into the cache on first use
data = gguf.read_bytes()
entry = KNOWN_MODELS[name]
assert len(data) == entry.size and hashlib.sha256(data).hexdigest() == entry.sha256, gguf
half = (len(data) + 1) // 2
parts = []
for i, (folder, chunk) in enumerate((("p1", data[:half]), ("p2", data[half:])), 1):
    path = Path(".burst") / folder / f"teacher.gguf.part{i}"
    path.write_bytes(chunk)
    parts.append({"name": path.name, "bytes": len(chunk),
                  "sha256": hashlib.sha256(chunk).hexdigest()})
(Path(".burst/p1") / "teacher.gguf.part1.sha256").write_text(parts[0]["sha256"] + "\n")
tok = load_checkpoint(name).tokenizer
texts = {"train": os.environ.get("PIJ_TRAIN_TEXT") or corpus.default_corpus_files()[0],
         "valid": os.environ.get("PIJ_VALID_TEXT") or corpus.SHARED_DATA / corpus.VALIDATION_NAME}
for split, path in texts.items():
    text = Path(path).read_text(encoding="utf-8")
    ids = np.asarray(tok.encode(text, add_bos=False), np.int64)
    assert ids.max() < 1 << 16
    np.save(Path(".burst/p2") / f"{split}_ids.npy", ids.astype(np.uint16))
    print(f"{split}: {ids.size} tokens")
manifest = {"model": name, "file": gguf.name, "bytes": len(data), "sha256": entry.sha256,
            "parts": parts}
(Path(".burst/p2") / "manifest.json").write_text(json.dumps(manifest, indent=1))
print(json.dumps(manifest, indent=1))
EOF
bash benchmarks/gpu/prepare_wheels.sh >/dev/null
du -sb .burst/p1 .burst/p2 .whl
echo "tracked files: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
