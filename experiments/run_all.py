"""Run every experiment this machine can run, then the plots and REPORT.md.

  python -m experiments.run_all [--quick] [--force] [--only NAME ...] [--list]

Full settings write results/*.jsonl, results/*.png and experiments/REPORT.md; --quick writes
results/quick/ (and results/quick/REPORT.md) so indicative numbers never mix with real ones.
Each experiment runs in its own process (its thread-count children below it) with a time limit:
one failing or timing out is recorded in results[/quick]/run_all.jsonl and in the report, and the
others still run. Resumable: an experiment that already succeeded at the current commit with the
same settings is skipped unless --force. The estimate printed first is the last measured duration
of each experiment on this machine (run_all.jsonl), else the built-in guess for 2 cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import _common


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str  # the script experiments/<name>.py and its JSONL results/<name>.jsonl
    full_args: tuple[str, ...]
    quick_args: tuple[str, ...]
    estimate_s: tuple[float, float]  # (full, quick) seconds on a quiet 2-core machine (guess)
    out_flag: str = "--out"


REGISTRY = (
    Experiment("power_law", (), ("--quick",), (20, 15)),
    Experiment("quality_vs_sparsity",
               # Full: 2 of issue 4's six targets (0.5 is the one every speed experiment runs at),
               # to fit the run in 25 min; the script alone runs all six (~25 min more). Same
               # calibration corpus, tokens and training steps as the cached artifacts. Artifacts are not saved: the run must not change the cached
               # predictors the other experiments load mid-run.
               ("--targets", "0.5", "0.7", "--chunks", "16", "--impl", "ffi",
                "--no-save-artifacts"),
               ("--targets", "0.5", "--chunks", "4", "--max-tokens", "8192", "--steps", "150",
                "--impl", "ffi", "--no-save-artifacts"), (600, 240)),
    Experiment("ablation", (), ("--quick",), (360, 150)),
    # input sparsity's quality on the real SmolLM2 (three rules, five model-wide targets); the
    # loss-guided allocation runs ~100 forwards of 1024 tokens per rule
    Experiment("stock_sparsity_quality", (), ("--quick",), (1500, 400)),
    Experiment("peers", (), ("--quick",), (300, 150)),
    Experiment("cost_breakdown", (), ("--quick", "--dtypes", "bfloat16"), (90, 60)),
    Experiment("prompt_length", (), ("--quick",), (180, 40)),
    # GPU machines only (elsewhere one "not available" row); the estimate is an H100's
    Experiment("gpu_hybrid", (), ("--quick",), (420, 90)),
)
# Scripts in experiments/ that run_all does not run, and why (tests check every script is either
# registered or listed here).
NOT_RUN = {
    "bench_dense_vs_hf": "superseded by peers (the same HF fp32 measurement, plus llama.cpp)",
    "plot_quality_vs_sparsity": "figure script of quality_vs_sparsity (run after it)",
    "peer_files": "writes a trained model's files for benchmarks/sparse_7b (needs a PowerInfer "
                  "source tree to quantize them): run by hand",
    "peers_powerinfer": "needs a PowerInfer source tree (--powerinfer-src; no download here) and "
                        "builds it (experiments/peers_powerinfer_build.sh): run by hand",
    "plots": "figure script (run after the experiments)",
    "sparsify_curve": "rows of a finished `python -m powerinfer_jax.sparsify` run (hours of "
                      "training on 2 cores): run by hand on its output directory",
    "report": "writes REPORT.md (run last)",
    "run_all": "this script",
}
TIMEOUT_FACTOR = 4  # an experiment is stopped after this many times its estimate (min 10 min)


def results_dir(quick: bool) -> Path:
    return _common.RESULTS / "quick" if quick else _common.RESULTS


def report_path(quick: bool) -> Path:
    return results_dir(True) / "REPORT.md" if quick else _common.REPO / "experiments" / "REPORT.md"


def estimate(exp: Experiment, quick: bool, status_rows: list[dict]) -> float:
    measured = [r["seconds"] for r in status_rows
                if r["experiment"] == exp.name and r.get("status") == "ok" and
                r.get("quick") == quick and r.get("seconds")]
    return measured[-1] if measured else exp.estimate_s[1 if quick else 0]


def done_at_commit(exp: Experiment, quick: bool, commit: str, status_rows: list[dict]) -> bool:
    args = list(exp.quick_args if quick else exp.full_args)
    return any(r["experiment"] == exp.name and r.get("status") == "ok" and
               r.get("commit") == commit and r.get("quick") == quick and r.get("args") == args
               for r in status_rows)


def run_experiment(exp: Experiment, *, quick: bool, out_dir: Path, timeout_s: float,
                   module_prefix: str = "experiments.") -> dict:
    """Run one experiment in its own process; returns its status row (never raises). Its output
    goes to results/tmp/logs/ (git-ignored); the status row keeps the log's last lines."""
    args = list(exp.quick_args if quick else exp.full_args)
    out = out_dir / f"{exp.name}.jsonl"
    log = _common.RESULTS / "tmp" / "logs" / ("quick" if quick else "full") / f"{exp.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module_prefix + exp.name, *args, exp.out_flag, str(out)]
    t0 = time.perf_counter()
    status, error = "ok", None
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=_common.REPO, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
            if proc.returncode != 0:
                status, error = "failed", f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            status, error = "timeout", f"stopped after {timeout_s:.0f} s"
    seconds = time.perf_counter() - t0
    if error:
        tail = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
                if line.strip()][-3:]
        error += ": " + " / ".join(tail)
    return {"experiment": exp.name, "status": status, "seconds": round(seconds, 1),
            "error": error, "args": args, "quick": quick, "log": str(log),
            "run_id": _common.run_id(), "commit": _git_commit(),
            "machine": _machine()}


def _git_commit() -> str:
    from powerinfer_jax import _cli

    return _cli.git_commit()


def _machine() -> dict:
    from powerinfer_jax import _cli

    return _cli.machine_info()


def make_figures_and_report(quick: bool) -> None:
    from experiments import plots, report

    out_dir = results_dir(quick)
    quality = out_dir / "quality_vs_sparsity.jsonl"
    if quality.is_file():
        subprocess.run([sys.executable, "-m", "experiments.plot_quality_vs_sparsity", "--jsonl",
                        str(quality), "--out", str(out_dir / "quality_vs_sparsity.png")],
                       cwd=_common.REPO, stdout=subprocess.DEVNULL)
    for path in plots.make_all(out_dir):
        print(f"  figure {path.relative_to(_common.REPO)}")
    path = report_path(quick)
    path.write_text(report.render(out_dir, path, quick=quick), encoding="utf-8")
    print(f"  report {path.relative_to(_common.REPO)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small settings (< 15 min on 2 cores)")
    p.add_argument("--force", action="store_true",
                   help="rerun experiments that already succeeded at this commit")
    p.add_argument("--only", nargs="+", default=None, choices=[e.name for e in REGISTRY])
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    out_dir = results_dir(args.quick)
    out_dir.mkdir(parents=True, exist_ok=True)
    status_file = out_dir / "run_all.jsonl"
    status_rows = _common.read_rows(status_file)
    commit = _git_commit()
    run_id = _common.run_id()
    chosen = [e for e in REGISTRY if args.only is None or e.name in args.only]
    plan = []
    for e in chosen:
        skip = not args.force and done_at_commit(e, args.quick, commit, status_rows)
        plan.append((e, skip, estimate(e, args.quick, status_rows)))
    total = sum(est for _, skip, est in plan if not skip)
    mode = "quick" if args.quick else "full"
    print(f"run_all ({mode}, commit {commit}, run {run_id}, {os.cpu_count()} CPUs) -> "
          f"{out_dir.relative_to(_common.REPO)}/")
    for e, skip, est in plan:
        print(f"  {e.name:22s} {'skip (done at this commit; --force reruns)' if skip else f'~{est / 60:4.1f} min'}")
    print(f"  estimated total: ~{total / 60:.0f} min (+ ~1 min figures and report)", flush=True)
    if args.list:
        return
    for e, skip, est in plan:
        if skip:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {e.name} ...", flush=True)
        row = run_experiment(e, quick=args.quick, out_dir=out_dir,
                             timeout_s=max(600.0, TIMEOUT_FACTOR * est))
        _common.append_rows(status_file, [row])
        print(f"[{time.strftime('%H:%M:%S')}] {e.name}: {row['status']} in {row['seconds']:.0f} s"
              + (f" ({row['error'][:200]})" if row["error"] else ""), flush=True)
    make_figures_and_report(args.quick)


if __name__ == "__main__":
    main()
