"""Hypothesis: on the same machine, model file and threads, our best sparse mode decodes at least as
fast as llama.cpp at the same weight precision (our bfloat16 vs llama.cpp BF16), and faster than HF
transformers (torch CPU, fp32), while generating the same greedy tokens as the dense model.

Systems, each thread count in its own child process (same prompt ids, greedy, EOS ignored):
  powerinfer_jax   dense, predictor mode (q4 predictor, target 0.5: "predictor@0.5") and
                   predictor mode with --gate-up q4 ("predictor_q4gu@T": only down rows at the
                   dtype) at each --targets T (default 0.5 and 0.6, both within the sparsity
                   issue's perplexity target of <= 1.08x dense), float32 and bfloat16
  llama.cpp        via llama-cpp-python (CPU, n_threads = n_threads_batch = threads), on the
                   registry GGUF (Q4_1) and on F32 and BF16 GGUFs written from the same dequantized
                   weights (so llama.cpp F32/BF16 read exactly our float32/bfloat16 weights)
  hf_transformers  fp32, loaded from the registry GGUF (experiments/bench_dense_vs_hf.py)
Prefill: wall time of one eval of the prompt; decode: wall time per generated token after it.
Greedy agreement: each system's first N tokens against our dense model at its precision (Q4_1 and
F32 vs our float32: our float32 *is* the dequantized Q4_1). Without llama-cpp-python the llama.cpp
rows say how to install it.

  python -m experiments.peers [--threads 1 2] [--prompt-tokens 64] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common

LLAMA_CPP_INSTALL = ("pip install llama-cpp-python  (builds llama.cpp from source with the "
                     "machine's compiler: ~10-20 min on 2 cores)")
TARGET_SPARSITY = 0.5  # predictor mode's target (and the first of --targets by default)
TARGETS = (0.5, 0.6)  # predictor_q4gu's targets
PREDICTOR = "q4"  # predictor mode's predictor (sparsity/nibble_predictor.py)
REFERENCE = {"Q4_1": "float32", "F32": "float32", "BF16": "bfloat16", "float32": "float32",
             "bfloat16": "bfloat16"}  # weights -> the precision of our dense reference tokens


def tokenizer_meta(path: Path) -> dict:
    """The tokenizer metadata of a GGUF file, as `write_gguf`'s tokenizer_meta."""
    from powerinfer_jax.checkpoint.gguf import tokenizer_metadata

    return tokenizer_metadata(path)


def peer_ggufs(model: str, ckpt) -> dict[str, Path]:
    """{"Q4_1": registry file, "F32": ..., "BF16": ...}: F32/BF16 written once next to the
    registry file from the dequantized params (what our float32/bfloat16 models load)."""
    from powerinfer_jax.checkpoint.gguf import write_gguf
    from powerinfer_jax.checkpoint.registry import resolve_model

    src = Path(resolve_model(model))
    out = {"Q4_1" if "Q4_1" in src.name else "source": src}
    meta = tokenizer_meta(src)
    for kind in ("F32", "BF16"):
        dst = src.parent / "peers" / f"{src.stem.split('.')[0]}.{kind}.gguf"
        if not dst.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_suffix(".tmp")
            print(f"peers: writing {dst} (once)", file=sys.stderr, flush=True)
            write_gguf(tmp, ckpt.config, ckpt.params, meta, default_type=kind)
            tmp.replace(dst)
        out[kind] = dst
    return out


def llama_cpp_runner(path: Path, ids: list[int], *, threads: int, new_tokens: int):
    """run(n_new) -> (prefill s, decode s, tokens): prefill and greedy decode through
    llama-cpp-python's low-level eval (no sampling layer)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(ids) + new_tokens + 8, n_batch=max(len(ids), 8),
                n_threads=threads, n_threads_batch=threads, verbose=False)

    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # llama-cpp-python >= 0.3 keeps no logits in `scores` unless logits_all (which would make
        # the prompt's eval compute V logits per token): read the last token's from the context.
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(np.argmax(logits))

    def run(n_new: int):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = greedy()
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n_new - 1):
            llm.eval([tok])
            tok = greedy()
            out.append(tok)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    run(8)  # warm-up (page in the weights)
    return run


def bench_llama_cpp(path: Path, ids: list[int], *, threads: int, new_tokens: int,
                    repeats: int, max_seconds: float) -> dict:
    run = llama_cpp_runner(path, ids, threads=threads, new_tokens=new_tokens)
    runs = [run(new_tokens)]
    while len(runs) < repeats and sum(r[0] + r[1] for r in runs) < max_seconds:
        runs.append(run(new_tokens))
    return {"prefill_tok_s": statistics.median(len(ids) / r[0] for r in runs),
            "decode_tok_s": statistics.median((new_tokens - 1) / r[1] for r in runs),
            "decode_tok_s_runs": [(new_tokens - 1) / r[1] for r in runs],
            "prompt_tokens": len(ids), "new_tokens": new_tokens, "repeats": len(runs),
            "tokens": runs[0][2], "file": path.name}


def head_to_head(engines: dict, llama_run, ids: list[int], *, new_tokens: int,
                 rounds: int) -> dict:
    """Decode tok/s of llama.cpp BF16 and each of our engines, interleaved: every round runs them
    all once, in a fixed order. Per mode: the median tok/s and the median of the per-round ratios
    to llama.cpp (the figure the target is checked against)."""
    for eng in engines.values():
        eng.generate(ids, max_new_tokens=4)  # compiled and warm before the first round
    peer, ours = [], {m: [] for m in engines}
    for _ in range(rounds):
        _, decode_s, _ = llama_run(new_tokens)
        peer.append((new_tokens - 1) / decode_s)
        for m, eng in engines.items():
            ours[m].append(eng.generate(ids, max_new_tokens=new_tokens).decode_tok_s)
    out = {"rounds": rounds, "new_tokens": new_tokens, "prompt_tokens": len(ids),
           "llama_cpp_bf16_tok_s": statistics.median(peer), "llama_cpp_bf16_runs": peer,
           "modes": {}}
    for m, runs in ours.items():
        out["modes"][m] = {"tok_s": statistics.median(runs), "runs": runs,
                           "ratio": statistics.median(o / p for o, p in zip(runs, peer))}
    return out


def agreement(tokens: list[int], reference: list[int]) -> dict:
    """Fraction of the first N positions with equal tokens, and the first divergence."""
    n = min(len(tokens), len(reference))
    same = [a == b for a, b in zip(tokens[:n], reference[:n])]
    first = next((i for i, s in enumerate(same) if not s), n)
    return {"agree_n": n, "agree_fraction": sum(same) / n if n else 0.0,
            "agree_prefix": first}


def child(args) -> None:
    from powerinfer_jax import _cli
    from powerinfer_jax.bench import prompt_ids
    from powerinfer_jax.checkpoint import load_checkpoint

    threads = _cli.configure_threads(args.child_threads)
    ckpt = load_checkpoint(args.model)
    ids = prompt_ids(ckpt.tokenizer, args.prompt_tokens)
    max_len = len(ids) + max(args.new_tokens, args.agree_tokens)
    rows, reference = [], {}

    def head(system, weights, sparsity):
        cfg = {"system": system, "weights": weights, "sparsity": sparsity,
               "prompt_tokens": len(ids), "new_tokens": args.new_tokens}
        dtype = REFERENCE.get(weights, weights)
        return {**_common.header("peers", threads=threads, dtype=dtype, model=args.model,
                                 config=cfg, quick=args.quick),
                "system": system, "weights": weights, "sparsity": sparsity}

    def record(row):
        rows.append(row)
        if row.get("status") == "ok":
            print(f"threads={threads} {row['system']:16s} {row['weights']:9s} "
                  f"{row['sparsity']:9s} decode {row['decode_tok_s']:7.1f} tok/s prefill "
                  f"{row['prefill_tok_s']:8.1f} tok/s", file=sys.stderr, flush=True)

    # ours
    engines = {}
    modes = [("dense", None), ("predictor", TARGET_SPARSITY)] + [
        ("predictor_q4gu", t) for t in args.targets]
    for dtype in args.dtypes:
        for mode, target in modes:
            label = mode if target is None else f"{mode}@{target:g}"
            h = head("powerinfer_jax", dtype, label)
            try:
                if target is not None:
                    h["target_sparsity"] = target
                session = _common.build_mode(args.model, mode, dtype=dtype, max_seq_len=max_len,
                                             checkpoint=ckpt, target=target)
                eng = session.engine
                res = _common.bench_engine(eng, ckpt.tokenizer, prompt_tokens=len(ids),
                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                           max_seconds=args.max_seconds, prompt=ids)
                res["tokens"] = eng.generate(ids, max_new_tokens=args.agree_tokens).tokens
                if mode == "dense":
                    reference[dtype] = res["tokens"]
                if dtype == "bfloat16":
                    engines[label] = eng  # for the interleaved head-to-head below
                record({**h, "status": "ok", "kernels": session.model.kernels, **res})
            except Exception as e:  # keep the other systems' rows
                record({**h, "status": "failed", "reason": f"{type(e).__name__}: {e}"})

    # llama.cpp
    try:
        import llama_cpp  # noqa: F401
        missing = None
    except ImportError as e:
        missing = f"llama-cpp-python not importable ({e}); install: {LLAMA_CPP_INSTALL}"
    files = {} if missing else peer_ggufs(args.model, ckpt)
    for weights in args.llama_cpp_weights:
        h = head("llama.cpp", weights, "dense")
        if missing:
            record({**h, "status": "not available", "reason": missing})
            continue
        try:
            res = bench_llama_cpp(files[weights], ids, threads=threads,
                                  new_tokens=max(args.new_tokens, args.agree_tokens),
                                  repeats=args.repeats, max_seconds=args.max_seconds)
            import llama_cpp

            record({**h, "status": "ok", "llama_cpp_version": llama_cpp.__version__, **res})
        except Exception as e:
            record({**h, "status": "failed", "reason": f"{type(e).__name__}: {e}"})

    # Interleaved head-to-head: this VM's speed drifts by 20-30% within minutes, so systems
    # measured one after another can rank either way. Here each round times llama.cpp BF16 and
    # our bf16 engines back to back; the ratio is the median of the per-round ratios.
    if args.rounds > 0 and not missing and "BF16" in files and engines:
        h = head("head_to_head", "BF16", "interleaved")
        try:
            record({**h, "status": "ok", **head_to_head(
                engines, llama_cpp_runner(files["BF16"], ids, threads=threads,
                                          new_tokens=args.new_tokens),
                ids, new_tokens=args.new_tokens, rounds=args.rounds)})
        except Exception as e:
            record({**h, "status": "failed", "reason": f"{type(e).__name__}: {e}"})

    # HF transformers
    if args.hf:
        h = head("hf_transformers", "float32", "dense")
        try:
            from experiments.bench_dense_vs_hf import bench_hf

            res = bench_hf(args.model, ids, max(args.new_tokens, args.agree_tokens),
                           args.repeats, threads)
            record({**h, "status": "ok", "prompt_tokens": len(ids),
                    "new_tokens": max(args.new_tokens, args.agree_tokens), **res})
        except Exception as e:
            record({**h, "status": "failed", "reason": f"{type(e).__name__}: {e}"})

    for r in rows:
        ref = reference.get(REFERENCE.get(r["weights"]))
        if r.get("status") == "ok" and ref is not None and "tokens" in r:
            r.update(agreement(r["tokens"][:args.agree_tokens], ref),
                     agree_reference=f"powerinfer_jax dense {REFERENCE[r['weights']]}")
        _common.emit(r)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--llama-cpp-weights", nargs="+", default=["Q4_1", "F32", "BF16"],
                   choices=["Q4_1", "F32", "BF16"])
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also HF transformers fp32")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick: 16)")
    p.add_argument("--agree-tokens", type=int, default=None,
                   help="greedy tokens compared with our dense model (default 32; quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="timed runs' wall-time budget per configuration (default 10, quick: 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved head-to-head rounds, ours bf16 vs llama.cpp BF16 (default "
                        "5, quick: 2; 0 skips it)")
    p.add_argument("--targets", nargs="+", type=float, default=list(TARGETS),
                   help="target sparsities of the predictor_q4gu mode (default 0.5 0.6)")
    p.add_argument("--out", default=str(_common.RESULTS / "peers.jsonl"))
    args = p.parse_args(argv)
    if not all(0.0 < t < 1.0 for t in args.targets):
        p.error(f"--targets: expected values in (0, 1), got {args.targets}")
    q = args.quick
    args.rounds = args.rounds if args.rounds is not None else (2 if q else 5)
    args.prompt_tokens = args.prompt_tokens or (16 if q else 64)
    args.new_tokens = args.new_tokens or (16 if q else 64)
    args.agree_tokens = args.agree_tokens or (16 if q else 32)
    args.repeats = args.repeats or (1 if q else 3)
    args.max_seconds = args.max_seconds or (3.0 if q else 10.0)
    if args.child_threads is not None:
        return child(args)
    threads = args.threads or ([max(_common.available_threads())] if q
                               else _common.available_threads())
    child_args = ["--model", args.model, "--dtypes", *args.dtypes, "--llama-cpp-weights",
                  *args.llama_cpp_weights, "--hf" if args.hf else "--no-hf",
                  "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
                  str(args.new_tokens), "--agree-tokens", str(args.agree_tokens),
                  "--repeats", str(args.repeats), "--max-seconds", str(args.max_seconds),
                  "--rounds", str(args.rounds),
                  "--targets", *(str(t) for t in args.targets)] + (["--quick"] if q else [])
    rows = _common.run_children("experiments.peers", threads, child_args)
    _common.append_rows(args.out, rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
