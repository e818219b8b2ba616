"""Decode tokens/s of our hybrid, with the synthetic sparse model's own PowerInfer predictors,
against llama.cpp -ngl at the same VRAM budget, in interleaved rounds (sparse_7b_check.sh's
timing step).

SYNTHETIC: the model is `python -m powerinfer_jax.synthetic`'s (random weights whose ReLU FFN
neurons fire with prescribed frequencies on text, exact low-rank predictors), read from its
output folder (synthetic.json, frequencies.npz, the llama GGUF and the PowerInfer GGUF).

  ours       runtime.session.build on the llama GGUF, --sparsity powerinfer with the PowerInfer
             GGUF's fc1/fc2, --vram-budget B --offload hybrid: hot neurons (by the generator's
             calibrated frequencies, written as the model's activation profile) on the GPU,
             cold ones on the host pool
  llama.cpp  llama-bench -ngl k on the llama GGUF, k as large as fits B (llama_cpp_ngl.py's
             layout: output layer, then whole layers from the last), every neuron computed
B = our dense bytes + --budget x our FFN bytes at --dtype (llama_cpp_ngl.our_budget, the same
arithmetic as hybrid_decode.py). llama.cpp's KV cache is counted at its context (prompt + new
tokens), ours at --max-seq-len. Rounds alternate the order; --deadline (Unix time) stops
before a round that would not finish, with a row saying so.

With --device cpu (sparse_7b_check.sh --dry-run) the same path runs on a CPU: our budget places
hot rows on the CPU hybrid's notional accelerator and llama-bench is a CPU build: no GPU figure.

    python -m benchmarks.gpu.sparse_7b_bench --model-dir DIR --llama-bin BIN --budget 0.25 \
        --threads 16 --out $OUT/sparse_7b.jsonl --commit ABC
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu import llama_cpp_ngl as lcn

SYNTHETIC = ("random weights whose ReLU FFN neurons fire with prescribed frequencies on text "
             "(python -m powerinfer_jax.synthetic); speed only")


def read_model_dir(d: Path, generator: str = "powerinfer_jax.synthetic",
                   files=lambda rec: {k: rec["files"].get(k) for k in ("gguf", "powerinfer")}
                   ) -> dict:
    """The generator's record (synthetic.json) with its files (`files(rec)`: name -> path)
    checked."""
    rec_path = d / "synthetic.json"
    if not rec_path.is_file():
        sys.exit(f"--model-dir: expected {rec_path} (python -m {generator} --out {d}), got none")
    rec = json.loads(rec_path.read_text())
    for k, path in files(rec).items():
        if not Path(path or "").is_file():
            sys.exit(f"--model-dir: expected the {k} file of {rec_path}, got {path!r}")
    return rec


def model_config(rec: dict, max_seq_len: int):
    """The generator's ModelConfig (synthetic.json), at the KV length the benchmark runs."""
    from powerinfer_jax.synthetic.build import config_for

    c = dict(rec["config"])
    fields = {k: c[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                "d_ff")}
    return config_for({**fields, "max_seq_len": max_seq_len}, vocab_size=c["vocab_size"],
                      activation=c["activation"])


def write_profile(d: Path, rec: dict, cfg) -> Path:
    """The generator's calibrated frequencies as the model's activation profile, where the
    session's placement reads it (<artifacts>/target_<sparsity>/profile.npz)."""
    from powerinfer_jax.sparsity.artifacts import target_dir
    from powerinfer_jax.sparsity.profile import N_BINS, ActivationProfile

    freq = np.load(d / "frequencies.npz")["calibrated"]
    if freq.shape != (cfg.n_layers, cfg.d_ff):
        sys.exit(f"{d / 'frequencies.npz'}: expected calibrated frequencies of shape "
                 f"{(cfg.n_layers, cfg.d_ff)}, got {freq.shape}")
    n = int(rec["calib_tokens"])
    zeros = np.zeros((cfg.n_layers, N_BINS), np.int64)
    prof = ActivationProfile(n_tokens=n, activation=cfg.activation,
                             thresholds=np.zeros(cfg.n_layers), hist_contribution=zeros,
                             hist_gate=zeros, counts=np.rint(freq * n).astype(np.int64))
    out = target_dir(d / "artifacts", float(rec["sparsity"])) / "profile.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    return out


def build_ours(rec: dict, d: Path, args, budget: int):
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime.session import build

    runtime = RuntimeConfig(dtype=args.dtype, threads=args.threads, max_seq_len=args.max_seq_len)
    sparsity = SparsityConfig(mode="powerinfer", predictor_file=rec["files"]["powerinfer"],
                              target_sparsity=float(rec["sparsity"]))
    placement = PlacementConfig(vram_budget_gib=budget / 2 ** 30, offload="hybrid")
    return build(rec["files"]["gguf"], runtime, sparsity, placement=placement,
                 artifacts_root=d / "artifacts", progress=False)


def placement_row(session, cfg) -> dict:
    p = session.placement
    if p is None:
        return {"placement": None}
    return {"hot_per_layer": list(p.hot), "hot_fraction": sum(p.hot) / (cfg.d_ff * cfg.n_layers),
            "served_fraction": p.served_fraction}


def header(args, rec: dict, experiment: str = "gpu_sparse_7b_check",
           model_keys=("config", "sparsity", "hot_fraction", "hot_share", "qtype", "seed",
                       "calib_tokens", "calibrated_sparsity"), synthetic: str = SYNTHETIC) -> dict:
    from powerinfer_jax import _machine

    machine = _machine.machine_info()
    try:
        import jax

        machine.update(accelerator=jax.devices()[0].device_kind, jax=jax.__version__)
    except Exception as e:  # noqa: BLE001 - the rows are still worth writing
        machine["accelerator"] = f"unknown ({type(e).__name__})"
    info = Path(args.llama_bin) / "BUILD_INFO"
    return {"experiment": experiment, "run_id": args.run_id,
            "commit": args.commit or _machine.git_commit(), "machine": machine,
            "device": args.device, "dry_run": args.device != "gpu", "threads": args.threads,
            "dtype": args.dtype, "synthetic": synthetic,
            "model": {k: rec.get(k) for k in model_keys},
            "llama_cpp_build": info.read_text().splitlines() if info.is_file() else None,
            "config": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                       "repeats": args.repeats, "max_seq_len": args.max_seq_len,
                       "kv_ctx_llama_cpp": args.prompt_tokens + args.new_tokens}}


def add_common_args(ap, *, budget_help: str) -> None:
    """The arguments this bench and moe_bench.py share."""
    ap.add_argument("--llama-bin", required=True, help="folder with llama-bench and its libraries")
    ap.add_argument("--budget", type=float, default=0.25, help=budget_help)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--deadline", type=float, default=None, help="Unix time to stop before")
    ap.add_argument("--timeout", type=float, default=240, help="per llama-bench run (s)")
    ap.add_argument("--first-build-s", type=float, default=120,
                    help="expected seconds of our first run (session build included): the "
                         "deadline check's estimate before anything was measured")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--run-id", default=datetime.datetime.now(datetime.timezone.utc)
                    .strftime("%Y%m%dT%H%M%SZ"))
    ap.add_argument("--out", required=True)


def check_args(args) -> None:
    if not 0 < args.budget <= 1:
        sys.exit(f"--budget: expected a fraction in (0, 1], got {args.budget}")
    import jax

    if (jax.default_backend() == "gpu") != (args.device == "gpu"):
        sys.exit(f"--device {args.device}: expected a {args.device.upper()} backend, got "
                 f"{jax.default_backend()}")


def run_rounds(args, head: dict, layout, cmd: list[str], ours_mode: str, build_session,
               describe_placement) -> None:
    """--rounds interleaved rounds of llama-bench (`cmd`, placed as `layout`) and our session
    (`build_session()` once, then `describe_placement(session)` in its rows), one JSONL row per
    run in --out, stopping before a run the --deadline leaves no time for."""
    def emit(row: dict) -> None:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("round", "system", "mode", "ngl", "n_cpu_moe",
                                                  "decode_tok_s", "hot_fraction", "error",
                                                  "stopped")}), flush=True)

    from powerinfer_jax.bench import bench_model
    from powerinfer_jax.ops import _ffi

    env = lcn.library_env(args.llama_bin)
    # the wall time a run is expected to take: its last run's, and for our first one the
    # session's build (loading the file, placing, moving hot rows) as --first-build-s guesses
    last = {"llama.cpp": 30.0, "powerinfer_jax": float(args.first_build_s)}
    session, ours_ready = None, {}
    for rnd in range(args.rounds):
        # llama.cpp first in round 0: its row does not wait for our session's build
        order = ("llama.cpp", "powerinfer_jax") if rnd % 2 == 0 else ("powerinfer_jax",
                                                                      "llama.cpp")
        for system in order:
            row = {**head, "time": datetime.datetime.now(datetime.timezone.utc)
                   .isoformat(timespec="seconds"), "round": rnd, "system": system}
            need = last[system] * 1.2 + 5
            if args.deadline is not None and time.time() + need > args.deadline:
                emit({**row, "stopped": f"the deadline: {args.deadline - time.time():.0f} s "
                                         f"left, a run is expected to take {need:.0f} s"})
                continue
            t1 = time.perf_counter()
            try:
                if system == "llama.cpp":
                    left = (args.timeout if args.deadline is None
                            else max(1.0, min(args.timeout, args.deadline - time.time())))
                    row.update(mode=layout.kind, ngl=layout.ngl, n_cpu_moe=layout.n_cpu_moe,
                               bytes_device=layout.gpu_bytes, command=" ".join(cmd),
                               **lcn.run_llama_bench(cmd, env, left))
                else:
                    row["mode"] = ours_mode
                    if session is None and "error" not in ours_ready:
                        try:
                            session = build_session()
                            _ffi.set_num_threads(args.threads)
                            ours_ready = {"load_s": time.perf_counter() - t1,
                                          **describe_placement(session)}
                        except Exception as e:  # noqa: BLE001 - llama.cpp's rows still count
                            ours_ready = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    row.update(ours_ready)
                    t1 = time.perf_counter()  # the next run's estimate: without the build
                    if session is not None:
                        row.update(bench_model(session, prompt_tokens=args.prompt_tokens,
                                               new_tokens=args.new_tokens, repeats=args.repeats))
            except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            last[system] = time.perf_counter() - t1
            emit(row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True, help="python -m powerinfer_jax.synthetic --out")
    add_common_args(ap, budget_help="VRAM beyond our dense parts, as a fraction of our FFN "
                                    "bytes")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = ap.parse_args(argv)
    check_args(args)
    d = Path(args.model_dir)
    rec = read_model_dir(d)
    cfg = model_config(rec, args.max_seq_len)
    profile = write_profile(d, rec, cfg)
    budget, ours_sizes = lcn.our_budget(cfg, args.dtype, args.budget, args.max_seq_len)
    n_ctx = args.prompt_tokens + args.new_tokens
    layout = lcn.llama_cpp_layout(lcn.gguf_bytes(rec["files"]["gguf"]), budget, n_ctx, "ngl")
    cmd = lcn.llama_bench_cmd(args.llama_bin, rec["files"]["gguf"], layout, threads=args.threads,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              repeats=args.repeats)
    head = header(args, rec)
    head.update(budget_ffn_fraction=args.budget, budget_bytes=budget,
                bytes_dense_ours=ours_sizes.dense, bytes_ffn_ours=ours_sizes.ffn)
    print(json.dumps({"budget_gib": round(budget / 2 ** 30, 3), "ngl": layout.ngl,
                      "llama_cpp_gpu_gib": round(layout.gpu_bytes / 2 ** 30, 3),
                      "profile": str(profile)}), flush=True)
    run_rounds(args, head, layout, cmd, "hybrid_powerinfer_predictors",
               lambda: build_ours(rec, d, args, budget), lambda s: placement_row(s, cfg))
    print_ratio(args.out, args.run_id)


def print_ratio(path, run_id) -> None:
    rows = [json.loads(l) for l in open(path, encoding="utf-8")]
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.get("run_id") == run_id and "decode_tok_s" in r:
            by.setdefault(r["system"], []).append(r["decode_tok_s"])
    if by.get("llama.cpp") and by.get("powerinfer_jax"):
        a, b = statistics.median(by["powerinfer_jax"]), statistics.median(by["llama.cpp"])
        print(f"hybrid / llama.cpp = {a / b:.2f}x ({a:.2f} vs {b:.2f} tok/s, medians over "
              "rounds; synthetic)", flush=True)


if __name__ == "__main__":
    main()
