"""Where a sparsification run's time goes on this CPU, and how fast its step is
(powerinfer_jax.sparsify; issue: the end-to-end rate of a long run >= 80% of its step's).

  --steps R         one step per setting in R interleaved rounds, one process (VM drift cancels in
                    the per-round ratios): online teacher vs cached top-k targets, bfloat16 vs
                    float32 matmuls, FFN vs FFN + norms trained
  --flags R         the cached step in a fresh process per XLA_FLAGS setting, R interleaved rounds
  --samples N       N teacher samples of 256 through the runtime's batched Engine vs the run's own
                    generator (a bfloat16 XLA decode loop, nucleus within the top 64)
  --fill            the long run's top-k cache filled ahead (shared cache): teacher tokens/s
  --piece first|resumed  one piece of a long run (BUILD.md's command) of --piece-budget seconds,
                    each in its own process as a later session would run it: the split of the
                    piece's wall time, its e2e tokens/s over its step tokens/s
  --e2e STEPS       a real run (relu, ProSparse recipe, cached teacher) of STEPS steps, twice: with
                    an empty top-k cache (the first pass computes it) and with it filled; the
                    split of each run's wall time (load, samples, refit, teacher, data, step,
                    checkpoint, eval, fatrelu, export) from its record
Rows: benchmarks/sparsify_throughput.jsonl (config, commit, machine, threads, load average).
Time it alone: flock -x /tmp/pij_cpu.lock python benchmarks/sparsify_throughput.py --steps 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "sparsify_throughput.jsonl"
MODEL = "smollm2-135m"
TRAIN_TEXT = Path(os.environ.get("PIJ_TRAIN_TEXT", "/work/shared/data/wiki.train.txt"))
VALID_TEXT = Path(os.environ.get("PIJ_VALID_TEXT", "/work/shared/data/wiki.valid.txt"))
SAMPLE_SLOTS = 32  # the Engine's rows in the samples comparison
FLAGS = ("", "--xla_cpu_use_onednn=true", "--xla_cpu_use_xnnpack=true",
         "--xla_cpu_enable_fast_math=true", "--xla_cpu_prefer_vector_width=512")


def header(kind: str, config: dict) -> dict:
    from powerinfer_jax import _cli

    return {"experiment": "sparsify_throughput", "kind": kind,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _cli.git_commit(), "machine": _cli.machine_info(),
            "threads": len(os.sched_getaffinity(0)), "load_avg_1min": os.getloadavg()[0],
            "model": MODEL, "config": config}


def append(rows: list[dict], path: Path) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            print(json.dumps({k: r[k] for k in r if k not in ("machine", "config")}), flush=True)


SETTINGS = {  # name -> DistillConfig changes (base: relu, batch 4 x 256, bf16, FFN trained)
    "online bf16 ffn": dict(teacher="online"),
    "cached bf16 ffn": dict(teacher="cached"),
    "cached bf16 ffn+norms": dict(teacher="cached", train="ffn+norms"),
    "cached f32 ffn": dict(teacher="cached", compute_dtype="float32"),
}


def _distiller(ckpt, **changes):
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsify import DistillConfig
    from powerinfer_jax.sparsify.train import Distiller

    cfg = DistillConfig(variant="relu", refit=False, samples=0, sample_fraction=0.0,
                        tokens=1 << 20, l1_on="gate", l1=0.01, **changes)
    teacher = from_params(ckpt.config, ckpt.params, kernels="xla") \
        if cfg.teacher == "online" else None
    return Distiller(from_params(ckpt.config, ckpt.params, kernels="xla"), teacher, cfg), cfg


def _batch(ckpt, cfg):
    """A real batch (wiki.train text) and its teacher top-k targets."""
    import jax.numpy as jnp

    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.sparsify import forward as fw

    ids = ckpt.tokenizer.encode(TRAIN_TEXT.read_text(encoding="utf-8")[:200_000], add_bos=False)
    tokens = np.asarray(ids[:cfg.batch * cfg.seq_len], np.int32).reshape(cfg.batch, cfg.seq_len)
    teacher = from_params(ckpt.config, ckpt.params, kernels="xla")
    logits = fw.forward(teacher, jnp.asarray(tokens), fw.teacher_spec(ckpt.config))[0]
    ids_k, logp = fw.teacher_topk(logits, cfg.topk)
    return {"tokens": tokens, "ids": np.asarray(ids_k).astype(np.uint16),
            "logp": np.asarray(logp).astype(np.float16)}


def step_rows(rounds: int, names=None) -> list[dict]:
    from powerinfer_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(MODEL)
    runs = {}
    batch = None
    for name in names or SETTINGS:
        d, cfg = _distiller(ckpt, **SETTINGS[name])
        batch = batch or _batch(ckpt, cfg)
        b = batch if cfg.teacher == "cached" else batch["tokens"]
        t0 = time.perf_counter()
        d.step(b, 0)  # compiles
        runs[name] = {"d": d, "cfg": cfg, "b": b, "compile_s": time.perf_counter() - t0,
                      "s": []}
    for r in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run["d"].step(run["b"], r + 1)
            run["s"].append(time.perf_counter() - t0)
    ref = runs[next(iter(runs))]["s"]
    rows = []
    for name, run in runs.items():
        n = run["cfg"].batch * run["cfg"].seq_len
        rows.append({**header("step", run["cfg"].to_dict()), "setting": name,
                     "tok_s_median": n / statistics.median(run["s"]),
                     "tok_s_rounds": [n / s for s in run["s"]],
                     "x_first_median": statistics.median(a / b for a, b in zip(ref, run["s"])),
                     "compile_s": run["compile_s"], "rounds": rounds, "tokens_per_step": n})
    return rows


def one_flag_row(steps: int) -> dict:
    """The cached bf16 step in this process (XLA_FLAGS as set by the parent)."""
    from powerinfer_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(MODEL)
    d, cfg = _distiller(ckpt, teacher="cached")
    b = _batch(ckpt, cfg)
    t0 = time.perf_counter()
    d.step(b, 0)
    compile_s = time.perf_counter() - t0
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        d.step(b, s + 1)
        times.append(time.perf_counter() - t0)
    n = cfg.batch * cfg.seq_len
    return {"tok_s_median": n / statistics.median(times), "tok_s": [n / t for t in times],
            "compile_s": compile_s, "config": cfg.to_dict()}


def flag_rows(rounds: int, steps: int = 2) -> list[dict]:
    results: dict = {f: [] for f in FLAGS}
    for _ in range(rounds):
        for flags in FLAGS:
            env = {**os.environ, "XLA_FLAGS": flags}
            p = subprocess.run([sys.executable, __file__, "--one-flag", str(steps)], env=env,
                               capture_output=True, text=True, cwd=REPO)
            if p.returncode != 0:
                results[flags].append({"error": p.stderr[-500:]})
                continue
            results[flags].append(json.loads(p.stdout.strip().splitlines()[-1]))
    base = [r.get("tok_s_median") for r in results[""]]
    rows = []
    for flags, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        ratios = [r["tok_s_median"] / b for r, b in zip(runs, base) if "error" not in r and b]
        rows.append({**header("xla_flags", ok[0]["config"] if ok else {}),
                     "xla_flags": flags or "(default)",
                     "tok_s_median": statistics.median(r["tok_s_median"] for r in ok) if ok
                     else None, "x_default_median": statistics.median(ratios) if ratios else None,
                     "runs": runs, "rounds": rounds})
    return rows


def samples_rows(n: int) -> list[dict]:
    """n teacher samples of 256 tokens: the runtime's batched Engine (SAMPLE_SLOTS rows, its
    sampler sorts the vocabulary) vs the run's own generator (teacher.samples: a bfloat16 XLA
    decode loop, SAMPLE_BATCH rows, nucleus within the top 64)."""
    import jax.numpy as jnp

    from powerinfer_jax.checkpoint import load_checkpoint
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.models.transformer import from_params
    from powerinfer_jax.runtime.session import build
    from powerinfer_jax.sparsify import samples as smp
    from powerinfer_jax.sparsify.teacher import SAMPLE_BATCH

    ckpt = load_checkpoint(MODEL)
    rows = []
    t0 = time.perf_counter()
    s = build(MODEL, RuntimeConfig(dtype="bfloat16", max_seq_len=256), max_batch=SAMPLE_SLOTS,
              progress=False)
    out = smp.generate_samples_engine(s.engine, ckpt.tokenizer, n=n, seq_len=256, seed=0,
                                      progress=False)
    dt = time.perf_counter() - t0
    rows.append({**header("samples", {"n": n, "seq_len": 256, "slots": SAMPLE_SLOTS}),
                 "generator": "runtime Engine (Q4_1 kernels, bf16)", "seconds": dt,
                 "tok_s": out.size / dt, "compiles": s.engine.compile_count,
                 "compile_s": s.engine.compile_s})
    t0 = time.perf_counter()
    model = from_params(ckpt.config, ckpt.params, kernels="xla", dtype=jnp.bfloat16)
    out = smp.generate_samples(model, ckpt.tokenizer, n=n, seq_len=256, seed=0,
                               batch=SAMPLE_BATCH, progress=False)
    dt = time.perf_counter() - t0
    rows.append({**header("samples", {"n": n, "seq_len": 256, "batch": SAMPLE_BATCH,
                                      "dtype": "bfloat16"}),
                 "generator": "XLA decode loop (bfloat16), nucleus within the top 64",
                 "seconds": dt, "tok_s": out.size / dt})
    return rows


def fill_rows() -> list[dict]:
    """The whole top-k cache of the default long run (wiki.train + its 64 samples, seq 256,
    k 64) filled ahead, in the shared cache (later runs read it)."""
    from powerinfer_jax.sparsify.recipe import recipe
    from powerinfer_jax.sparsify.run import fill_teacher_cache

    cfg = recipe("prosparse", variant="relu", teacher="cached")
    t0 = time.perf_counter()
    res = fill_teacher_cache(MODEL, cfg, corpus=[TRAIN_TEXT], progress=False)
    wall = time.perf_counter() - t0
    return [{**header("fill_teacher_cache", cfg.to_dict()), **res, "wall_s": wall,
             "teacher_tok_s": res["tokens_filled"] / res["seconds"] if res["seconds"] else None}]


def piece_row(piece: str, tokens: int, budget: float) -> dict:
    """One piece of a long run (the BUILD.md command's settings, `tokens` planned) in the shared
    cache: the first (fresh output) or a resumed one, `budget` seconds; its time split."""
    from powerinfer_jax.sparsify import distill
    from powerinfer_jax.sparsify.recipe import recipe

    from powerinfer_jax.sparsify.checkpoints import TrainCheckpoints

    cfg = recipe("prosparse", variant="relu", teacher="cached", tokens=tokens, lr=2e-4)
    out = Path(tempfile.gettempdir()) / "pij-e2e-piece"
    before = {}
    if piece != "first":  # what the earlier pieces spent, from the checkpoint's record
        ck = TrainCheckpoints(out.with_name(out.name + ".train"))
        if ck.latest_step():
            before = ck.read_record(ck.latest_step())
            before["step"] = ck.latest_step()
        ck.close()
    t0 = time.perf_counter()
    res = distill(MODEL, cfg, out=out, corpus=[TRAIN_TEXT], resume=piece != "first",
                  force=piece == "first", progress=False, calibrate=False, eval_every=50,
                  eval_chunks=4, eval_text=VALID_TEXT, save_every=25, time_budget=budget)
    wall = time.perf_counter() - t0
    rec = res["record"]
    timing = {k: v - before.get("timing", {}).get(k, 0.0) for k, v in rec["timing"].items()}
    steady = rec["counts"]["steady_steps"] - before.get("counts", {}).get("steady_steps", 0)
    done = res.get("stopped_at", rec.get("steps")) - before.get("step", 0)
    n = cfg.batch * cfg.seq_len
    step_tok_s = steady * n / timing["step"]
    return {**header("e2e_piece", cfg.to_dict()), "piece": piece, "budget_s": budget,
            "wall_s": wall, "steps_in_piece": done, "tokens_in_piece": done * n,
            "timing_in_piece": timing, "step_tok_s": step_tok_s, "e2e_tok_s": done * n / wall,
            "e2e_over_step": done * n / wall / step_tok_s,
            "note": "wall: the whole call (load to the saved checkpoint); the top-k cache filled "
                    "ahead (fill_teacher_cache)"}


def e2e_rows(steps: int) -> list[dict]:
    """Two runs of `steps` steps in a fresh cache: the first fills the top-k cache, the second
    (same data, --force) reads it."""
    from powerinfer_jax.sparsify import distill
    from powerinfer_jax.sparsify.recipe import recipe

    from powerinfer_jax.checkpoint.registry import cache_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="pij-e2e-") as tmp:
        # a fresh cache (samples, top-k targets, compiled code) that still holds the model file
        (Path(tmp) / "models").mkdir()
        (Path(tmp) / "models" / MODEL).symlink_to(cache_dir() / "models" / MODEL)
        os.environ["POWERINFER_JAX_CACHE"] = tmp
        cfg = recipe("prosparse", variant="relu", teacher="cached", samples=32,
                     sample_fraction=0.25, tokens=steps * 4 * 256, lr=2e-4)
        for cache_state in ("empty", "filled"):
            t0 = time.perf_counter()
            res = distill(MODEL, cfg, out=Path(tmp) / "out", corpus=[TRAIN_TEXT], force=True,
                          progress=False, calibrate=False, eval_every=max(steps // 2, 1),
                          eval_chunks=2, eval_text=VALID_TEXT, save_every=max(steps // 2, 1))
            wall = time.perf_counter() - t0
            rec = res["record"]
            timing, tokens = rec["timing"], rec["tokens_trained"]
            step_tok_s = rec["counts"]["steady_steps"] * cfg.batch * cfg.seq_len / timing["step"]
            e2e = tokens / wall
            rows.append({**header("e2e", cfg.to_dict()), "top_k_cache": cache_state,
                         "steps": rec["steps"], "tokens": tokens, "wall_s": wall,
                         "timing": timing, "step_tok_s": step_tok_s, "e2e_tok_s": e2e,
                         "e2e_over_step": e2e / step_tok_s,
                         "note": "wall: the whole distill call (load to export); step: the steady "
                                 "steps (the first, with compilation, is first_step); the "
                                 "samples are generated by the first run and cached"})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=0, metavar="ROUNDS")
    p.add_argument("--settings", nargs="*", default=None, choices=tuple(SETTINGS))
    p.add_argument("--flags", type=int, default=0, metavar="ROUNDS")
    p.add_argument("--samples", type=int, default=0, metavar="N")
    p.add_argument("--e2e", type=int, default=0, metavar="STEPS")
    p.add_argument("--fill", action="store_true", help="fill the long run's top-k cache ahead")
    p.add_argument("--piece", choices=("first", "resumed"), default=None,
                   help="one piece of a long run (first: a fresh one), --piece-budget seconds")
    p.add_argument("--piece-budget", type=float, default=600.0)
    p.add_argument("--one-flag", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if args.one_flag:
        print(json.dumps(one_flag_row(args.one_flag)))
        return
    out = Path(args.out)
    if args.steps:
        append(step_rows(args.steps, args.settings), out)
    if args.flags:
        append(flag_rows(args.flags), out)
    if args.samples:
        append(samples_rows(args.samples), out)
    if args.e2e:
        append(e2e_rows(args.e2e), out)
    if args.fill:
        append(fill_rows(), out)
    if args.piece:
        append([piece_row(args.piece, 1 << 20, args.piece_budget)], out)


if __name__ == "__main__":
    main()
