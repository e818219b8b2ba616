"""Shared plumbing of the experiment scripts: result rows, JSONL files, per-thread child processes.

Every row an experiment writes carries the same header (`header`): experiment, run_id, time,
commit, machine, threads, dtype, model and a `config` dict, so report.py can name where each number
came from. Thread pinning is per process (XLA sizes its pool when it starts), so an experiment that
sweeps thread counts runs each count in a child process (`run_children`) that prints its rows as
"ROW {json}" lines on stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DATA = REPO.parent / "shared" / "data"
DEFAULT_MODEL = "smollm2-135m"
ROW_PREFIX = "ROW "
RUN_ID_ENV = "PIJ_RUN_ID"  # set by run_all so every experiment of one run shares its run id


def run_id() -> str:
    """The id of this run: run_all's (inherited by children), else a fresh UTC timestamp."""
    rid = os.environ.get(RUN_ID_ENV)
    if not rid:
        rid = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        os.environ[RUN_ID_ENV] = rid  # children started from here inherit it
    return rid


def header(experiment: str, *, threads: int | None, dtype: str | None, model: str,
           config: dict, quick: bool) -> dict:
    """The fields every result row starts with."""
    from powerinfer_jax import _cli

    return {"experiment": experiment, "run_id": run_id(), "quick": quick,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _cli.git_commit(), "machine": _cli.machine_info(), "threads": threads,
            "dtype": dtype, "model": model, "config": config}


def append_rows(path: str | os.PathLike, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file ([] when it does not exist); a malformed line is a ValueError."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: expected one JSON object per line, got "
                                 f"{line[:60]!r} ({e})") from None
    return rows


def emit(row: dict) -> None:
    """A child's result row, picked up by `run_children` from stdout."""
    print(ROW_PREFIX + json.dumps(row), flush=True)


def run_children(module: str, thread_counts, child_args: list[str]) -> list[dict]:
    """Run `python -m module --child-threads T *child_args` for each T; returns their rows.

    A child that fails raises RuntimeError with the tail of its stderr (run_all records it).
    """
    rows = []
    for t in thread_counts:
        cmd = [sys.executable, "-m", module, "--child-threads", str(t), *child_args]
        print(f"[{module}] threads={t}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=None, text=True)
        got = [json.loads(line[len(ROW_PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(ROW_PREFIX)]
        rows += got
        if proc.returncode != 0:
            raise RuntimeError(f"{module} child (threads={t}): expected exit status 0, got "
                               f"{proc.returncode} after {len(got)} rows (see stderr above)")
    return rows


def available_threads() -> list[int]:
    """The thread counts to sweep: powers of two up to the CPUs this process may use (1, 2 on a
    2-core machine)."""
    n = len(os.sched_getaffinity(0))
    out, t = [], 1
    while t <= n:
        out.append(t)
        t *= 2
    return out


def add_common_args(p, *, threads_default=None) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quick", action="store_true", help="small settings: checks the pipeline, "
                   "numbers are indicative only")
    p.add_argument("--threads", type=int, nargs="+", default=threads_default,
                   help="thread counts, each in its own child process (default: 1 and 2)")
    p.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)


def bench_engine(engine, tokenizer, *, prompt_tokens: int, new_tokens: int, repeats: int,
                 max_seconds: float, prompt: list[int] | None = None) -> dict:
    """Prefill and decode tokens/s of an Engine within a time budget (EOS ignored).

    Like powerinfer_jax.bench.bench_model, but a slow configuration (e.g. bfloat16 through XLA's
    CPU dot, ~1 tok/s) must not eat the whole run: a short cold run (compiles every bucket the
    timed runs need, and measures speed) sizes the timed runs so that `repeats` of them take about
    max_seconds, never fewer than 8 new tokens or 1 run. The row records what was run.
    """
    import statistics

    from powerinfer_jax.bench import prompt_ids

    ids = prompt if prompt is not None else prompt_ids(tokenizer, prompt_tokens)
    engine.check_prompt(len(ids))
    if len(ids) + new_tokens > engine.max_seq_len:
        raise ValueError(f"prompt + new tokens: expected at most {engine.max_seq_len} "
                         f"(max_seq_len), got {len(ids) + new_tokens}")
    cold = engine.generate(ids, max_new_tokens=new_tokens if new_tokens <= 16 else 16)
    per_token = cold.decode_s / max(len(cold.tokens) - 1, 1)
    budget_tokens = int(max_seconds / repeats / max(per_token, 1e-6))
    n_new = max(8, min(new_tokens, budget_tokens))
    runs = [engine.generate(ids, max_new_tokens=n_new)]
    while len(runs) < repeats and sum(r.prefill_s + r.decode_s for r in runs) < max_seconds:
        runs.append(engine.generate(ids, max_new_tokens=n_new))
    return {"prefill_tok_s": statistics.median(r.prefill_tok_s for r in runs),
            "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
            "decode_tok_s_runs": [r.decode_tok_s for r in runs],
            "prefill_s": statistics.median(r.prefill_s for r in runs),
            "decode_ms_per_token": 1e3 / max(statistics.median(r.decode_tok_s for r in runs),
                                             1e-9),
            "first_token_s": cold.first_token_s, "compile_s": cold.compile_s,
            "prompt_tokens": len(ids), "new_tokens": n_new, "new_tokens_requested": new_tokens,
            "repeats": len(runs), "compiles": engine.compile_count,
            "tokens": runs[0].tokens}


def mode_label(row: dict) -> str:
    """A quality row's mode, naming predictor mode's predictor ("predictor (q4)"); predictor rows
    from before the q4 predictor existed were low-rank."""
    if row.get("mode") != "predictor":
        return row.get("mode", "")
    kind = row.get("predictor", "lowrank")
    return f"predictor ({kind}, gate/up q4)" if row.get("gate_up") == "q4" else f"predictor ({kind})"


PREDICTOR = "q4"  # predictor mode's predictor in every experiment (sparsity/nibble_predictor.py)


def sparsity_for(label: str, target: float | None = None):
    """The SparsityConfig of an experiment's mode label: "dense", "predictor" (q4 predictor,
    gate/up rows at the dtype), "predictor_q4gu" (--gate-up q4), optionally "@T" for the target."""
    from powerinfer_jax.config import DEFAULT_TARGET_SPARSITY, SparsityConfig

    name, _, at = label.partition("@")
    if name == "dense":
        return SparsityConfig()
    if name not in ("predictor", "predictor_q4gu"):
        raise ValueError(f"mode: expected dense, predictor or predictor_q4gu[@T], got {label!r}")
    return SparsityConfig(mode="predictor", predictor=PREDICTOR,
                          gate_up="q4" if name == "predictor_q4gu" else "full",
                          target_sparsity=float(at or target or DEFAULT_TARGET_SPARSITY))


def build_mode(model: str, label: str, *, dtype: str, max_seq_len: int, checkpoint=None,
               target: float | None = None, max_batch: int = 1, **runtime):
    """A built session (runtime.session.build) for an experiment's mode label."""
    from powerinfer_jax.config import RuntimeConfig
    from powerinfer_jax.runtime.session import build

    runtime.setdefault("weights", "dtype")  # every weight at the dtype: the q4 predictor predicts
    return build(model, RuntimeConfig(dtype=dtype, max_seq_len=max_seq_len, **runtime),
                 sparsity_for(label, target), checkpoint=checkpoint, max_batch=max_batch,
                 progress=False)
