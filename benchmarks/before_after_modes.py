"""Greedy tokens and perplexity of every mode on the default model, for a before/after check of a
refactor (issue 19: "greedy tokens and perplexity of every mode identical before and after").
Runs with whichever powerinfer_jax the interpreter imports (the old API before b7d44d5, or `load`
after it, with weights dequantized as the old loader did); prints one JSON line per mode:

    python benchmarks/before_after_modes.py float32 4 > after.jsonl      # in each checkout's venv
    python benchmarks/before_after_modes.py float32 4 MODES auto          # the file's blocks

The fourth argument: "dtype" (default: weights dequantized, as before b7d44d5) or "auto" (the
quantized file's blocks, kept as stored: the layouts of models/qweights.py).
"""
import json
import sys
import time
from pathlib import Path

from powerinfer_jax import _cli

_cli.configure_threads(2)
MODES = [("dense", {}), ("oracle", {}), ("oracle@0.5", {"target_sparsity": 0.5}),
         ("threshold", {"target_sparsity": 0.5}), ("predictor", {"target_sparsity": 0.5}),
         ("predictor_q4gu", {"target_sparsity": 0.5, "gate_up": "q4"}),
         ("predictor_lowrank", {"target_sparsity": 0.5, "predictor": "lowrank"})]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
VALID = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki.valid.txt"
dtypes = sys.argv[1].split(",")
chunks = int(sys.argv[2])
only = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else None
weights = sys.argv[4] if len(sys.argv) > 4 else "dtype"
text = open(VALID).read()
new_api = False
try:
    import powerinfer_jax.api  # noqa: F401
    new_api = True
except ImportError:
    pass
for dtype in dtypes:
    for label, kw in MODES:
        if only and label not in only:
            continue
        mode = label.split("@")[0].split("_")[0]
        t0 = time.time()
        if new_api:
            import powerinfer_jax as pij
            import inspect
            if "weights" in inspect.signature(pij.load).parameters:
                kw = {**kw, "weights": weights}  # the before side dequantized every file at load
            try:
                llm = pij.load("smollm2-135m", dtype=dtype, sparsity=mode, progress=False, **kw)
            except pij.UserError as e:
                if "sparsity='oracle' with target_sparsity" not in str(e):
                    raise
                # predictor q4 on a model kept in its file's blocks is refused since it predicts
                # nothing: the same computation by its name, to show the tokens are the same
                kw = {k: v for k, v in kw.items() if k not in ("gate_up", "predictor")}
                label += " (as oracle@target)"
                llm = pij.load("smollm2-135m", dtype=dtype, sparsity="oracle", progress=False,
                               **kw)
            toks = [llm.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]
            ppl = llm.perplexity(text, ctx=512, max_chunks=chunks)
        else:
            from powerinfer_jax.config import RuntimeConfig, SparsityConfig
            from powerinfer_jax.evaluate import perplexity
            from powerinfer_jax.runtime.session import open_session
            sp = SparsityConfig(mode=mode, target_sparsity=kw.get("target_sparsity"),
                                predictor=kw.get("predictor", "q4"), gate_up=kw.get("gate_up", "full"))
            s = open_session("smollm2-135m", RuntimeConfig(dtype=dtype), sp, progress=False)
            toks = []
            for p in PROMPTS:
                ids = s.tokenizer.encode(p)
                toks.append(s.engine.generate(ids, max_new_tokens=24, stop_ids=s.tokenizer.eos_ids).tokens)
            ids = s.tokenizer.encode(text, add_bos=False)
            ppl = perplexity(s.model, ids, ctx=512, max_chunks=chunks, sparsity=sp,
                             thresholds=s.thresholds, oracle_thresholds=s.oracle_thresholds)
        print(json.dumps({"mode": label, "dtype": dtype, "tokens": toks, "ppl": ppl["ppl"],
                          "ffn_sparsity": ppl["ffn_sparsity"],
                          "recall": ppl.get("predictor_recall"), "s": round(time.time() - t0)}),
              flush=True)
