"""Fuzzing at length: the server, the GGUF and PowerInfer-GGUF readers, the tokenizer and the
CLIs' arguments, with every case watched for a crash or a hang.

Targets (hypothesis generates every case; the checks are those of the CI tests, which run a few
hundred of the same cases):
  server           the real server (`python -m powerinfer_jax.serve`, a tiny random llama so a
                   valid request generates in milliseconds, --max-seq-len 64, --parallel 4) on
                   127.0.0.1: schemathesis cases from its own /openapi.json (every endpoint,
                   fitting and breaking the schema; benchmarks/fuzz_server.py), mutated OpenAI
                   bodies and random bytes (tests/test_serve_fuzz.py's strategies). crash: a
                   5xx, the server gone, or a traceback in its log; hang: no answer in --hang-s.
  gguf             mutated tiny GGUF files through the readers a command runs
  powerinfer-gguf  mutated PowerInfer GGUFs (with predictors) and GPU index files
                   (benchmarks/fuzz_gguf.py)
  tokenizer        any text and conversations through encode/decode/chat template, for the
                   tests' byte-level BPE, a SentencePiece-style vocabulary and the default
                   model's (when cached)
  cli              argument lists from each command's parser, run through its real main up to
                   the model load in-process, plus --cli-processes of the refused ones as the
                   real command (exit 2, one line, no traceback) (benchmarks/fuzz_inputs.py)

The file and input targets run in a child process (`--worker`) with a 6 GiB address-space
limit, which writes each case's input to disk before running it: a child that dies (a signal,
an exception that escapes) is a crash, one silent for --hang-s a hang, and that case's input is
kept under <work>/findings/. The child then restarts with the rest of the cases.

Rows appended to benchmarks/fuzz.jsonl: one "finding" row per case that crashed, hung or broke
a rule (with the kept input), then per target a summary row with exactly the fields
kind, target, cases, crashes, hangs, findings_fixed, commit. findings_fixed counts the findings
of earlier runs fixed in this code, each with its regression test (FIXED below).

  python -m benchmarks.fuzz                                   # >= 10,000 server and GGUF cases
  python -m benchmarks.fuzz --targets gguf --cases gguf=500   # one target, fewer cases
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("server", "gguf", "powerinfer-gguf", "tokenizer", "cli")
DEFAULT_CASES = {"server": 10_000, "gguf": 10_000, "powerinfer-gguf": 10_000,
                 "tokenizer": 5_000, "cli": 3_000}
MEMORY_LIMIT = 6 << 30

# Findings of earlier runs of this script, fixed, each with its regression test.
FIXED = {
    "gguf": [
        "metadata arrays nested 100,000 deep: RecursionError (test_fuzz_inputs.py::"
        "test_deeply_nested_metadata_arrays_are_a_format_error)",
        "metadata values of the wrong type (a list for block_count, a number for the token "
        "list...): TypeError/AttributeError inside the config or the tokenizer (test_fuzz_inputs"
        ".py::test_metadata_of_the_wrong_type_names_key_and_file)",
        "ModelConfig's and the tokenizer's errors on a file's values did not name the file "
        "(test_fuzz_inputs.py::test_config_and_tokenizer_errors_name_the_file)",
        "block_count 2**32 - 1: a per-layer layout of billions of entries, MemoryError (or the "
        "machine's memory) (test_fuzz_inputs.py::"
        "test_a_block_count_past_the_files_tensors_fails_at_once)",
    ],
    "powerinfer-gguf": [
        "the same four reader fixes (PowerInfer files go through the same reader and checks; "
        "the block_count one was first seen here, as a MemoryError)",
    ],
    "server": [], "tokenizer": [], "cli": [],
}


# ---------------------------------------------------------------------------- the child
def worker(target: str, cases: int, seed: int, work: Path) -> None:
    """Run `cases` generated cases of `target`, one JSON line per case on stdout; the input of
    the running case is in <work>/case.* (a crash leaves it there)."""
    import resource

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    warnings.simplefilter("ignore")  # NaN scales in mutated blocks: numpy's warnings
    import numpy as np

    np.seterr(all="ignore")
    run_one, strategy = _subject(target, work)
    done = [0]

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(strategy)
    def fuzz(case):
        if done[0] >= cases:
            return
        print(json.dumps({"start": done[0]}), flush=True)
        kind, detail = run_one(case)
        print(json.dumps({"case": done[0], "kind": kind, "detail": detail[:500]}), flush=True)
        done[0] += 1

    fuzz()


def _subject(target: str, work: Path):
    """(run one case -> (kind, detail), strategy of cases) for a file or input target."""
    from hypothesis import strategies as st

    if target in ("gguf", "powerinfer-gguf"):
        from benchmarks import fuzz_gguf as FG

        seeds = FG.write_seeds(work / "seeds")[target]
        subjects = [(p, p.read_bytes()) for p in seeds]
        strategy = st.one_of(*[st.tuples(st.just(i), FG.mutations(data, FG.layout(data)))
                               for i, (_, data) in enumerate(subjects)])

        def run(case):
            i, data = case
            path = work / subjects[i][0].name
            path.write_bytes(data)
            return FG.check(path, target)

        return run, strategy
    if target == "tokenizer":
        from benchmarks import fuzz_inputs as FI

        toks = _tokenizers(work)
        strategy = st.tuples(st.sampled_from(sorted(toks)), FI.texts(), FI.messages())

        def run(case):
            name, text, msgs = case
            (work / "case.json").write_text(json.dumps({"tokenizer": name, "text": text,
                                                        "messages": msgs}))
            tok, round_trip = toks[name]
            return FI.check_tokenizer(tok, text, msgs, round_trip=round_trip)

        return run, strategy
    if target == "cli":
        from benchmarks import fuzz_inputs as FI

        strategy = st.sampled_from(sorted(FI.CLIS)).flatmap(
            lambda cli: st.tuples(st.just(cli), FI.argv(cli)))

        def run(case):
            cli, args = case
            (work / "case.json").write_text(json.dumps({"cli": cli, "argv": args}))
            kind, detail = FI.check_cli_args(cli, args)
            return kind, json.dumps({"cli": cli, "argv": args, "detail": detail})

        os.chdir(work)  # relative junk paths land here
        return run, strategy
    raise SystemExit(f"--worker: expected one of {TARGETS[1:]}, got {target!r}")


def _tokenizers(work: Path) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers_models import spm_tokenizer_meta, write_tiny_gguf

    from powerinfer_jax.checkpoint import gguf
    from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, model_path

    files = {"tiny-bpe": (work / "bpe.gguf", None, True),
             "tiny-spm": (work / "spm.gguf", spm_tokenizer_meta(), False)}
    out = {}
    for name, (path, meta, round_trip) in files.items():
        write_tiny_gguf(path, tokenizer_meta=meta)
        out[name] = (gguf.load_gguf(path, keep_quantized=True).tokenizer, round_trip)
    real = model_path("smollm2-135m")
    if real.is_file() and real.stat().st_size == KNOWN_MODELS["smollm2-135m"].size:
        out["smollm2-135m"] = (gguf.load_gguf(real, keep_quantized=True).tokenizer, False)
    return out


# ---------------------------------------------------------------------------- the parent
def run_watched(target: str, cases: int, work: Path, hang_s: float, findings: list) -> dict:
    """Run `cases` cases of `target` in watched children; returns the counts."""
    counts = {"cases": 0, "crashes": 0, "hangs": 0, "rule": 0}
    seed = 0
    while counts["cases"] < cases:
        todo = cases - counts["cases"]
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.fuzz", "--worker", target,
                                 "--cases", str(todo), "--seed", str(seed), "--work",
                                 str(work)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        seed += 1
        started, last, outcome = None, time.monotonic(), None
        first_deadline = 300.0  # imports and seed files
        while True:
            wait = (hang_s if started is not None else first_deadline) - (time.monotonic() - last)
            ready, _, _ = select.select([proc.stdout], [], [], max(wait, 0))
            if not ready:
                proc.kill()
                proc.wait()
                outcome = "hang" if started is not None else "no start"
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                outcome = "crash" if started is not None else ("done" if proc.returncode == 0
                                                               else "no start")
                break
            last = time.monotonic()
            msg = json.loads(line)
            if "start" in msg:
                started = msg["start"]
                continue
            started = None
            counts["cases"] += 1
            if msg["kind"] == "finding":
                counts["rule"] += 1
                findings.append({"target": target, "what": "rule", "detail": msg["detail"],
                                 "input": _keep(work, target, f"rule{len(findings)}")})
            if counts["cases"] >= cases:
                break
        if outcome in ("hang", "crash"):
            counts["cases"] += 1
            counts[outcome + "es" if outcome == "crash" else "hangs"] += 1
            err = proc.stderr.read()[-1500:] if outcome == "crash" else ""
            findings.append({"target": target, "what": outcome,
                             "detail": f"exit {proc.returncode}: {err}",
                             "input": _keep(work, target, f"{outcome}{len(findings)}")})
        elif outcome == "no start":
            raise RuntimeError(f"{target} worker did not start: {proc.stderr.read()[-2000:]}")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if outcome == "done" and counts["cases"] < cases:  # hypothesis ran out of new cases
            break
        print(f"  {target}: {counts}", flush=True)
    return counts


def _keep(work: Path, target: str, name: str) -> str | None:
    """Copy the input of the case that just ran to <work>/findings/."""
    cands = sorted((p for p in work.iterdir() if p.is_file() and p.name != "worker.log"),
                   key=lambda p: p.stat().st_mtime)
    if not cands:
        return None
    dest = work / "findings" / f"{target}-{name}{''.join(cands[-1].suffixes)}"
    dest.parent.mkdir(exist_ok=True)
    shutil.copy2(cands[-1], dest)
    return str(dest)


def cli_processes(n: int, work: Path, findings: list) -> dict:
    """`n` refused argument lists run as the real commands (exit 2, one line, no traceback)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from benchmarks import fuzz_inputs as FI

    refused = []

    @settings(max_examples=50 * n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(FI.CLIS)).flatmap(lambda c: st.tuples(st.just(c),
                                                                       FI.argv(c))))
    def collect(case):
        if len(refused) < n and FI.check_cli_args(*case)[0] == "error":
            refused.append(case)

    cwd = Path.cwd()
    os.chdir(work)
    try:
        collect()
        counts = {"cases": 0, "crashes": 0, "hangs": 0, "rule": 0}
        for cli, args in refused:
            kind, detail = FI.check_cli_process(cli, args, work)
            counts["cases"] += 1
            if kind in ("finding", "hang"):
                counts["crashes" if kind == "finding" else "hangs"] += 1
                findings.append({"target": "cli", "what": kind, "detail": detail,
                                 "input": json.dumps({"cli": cli, "argv": args})})
    finally:
        os.chdir(cwd)
    return counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--cases", nargs="*", default=[], metavar="TARGET=N",
                   help="cases per target (default: " + ", ".join(
                       f"{k}={v}" for k, v in DEFAULT_CASES.items()) + ")")
    p.add_argument("--cli-processes", type=int, default=100,
                   help="refused argument lists also run as the real command")
    p.add_argument("--hang-s", type=float, default=60.0,
                   help="seconds without an answer that count as a hang")
    p.add_argument("--work", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "fuzz.jsonl"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        work = Path(args.work)
        return worker(args.worker, int(args.cases[0]), args.seed, work)

    from benchmarks import fuzz_server
    from experiments import _common

    cases = dict(DEFAULT_CASES)
    for item in args.cases:
        name, _, n = item.partition("=")
        if name not in TARGETS or not n.isdigit():
            raise SystemExit(f"--cases: expected TARGET=N with TARGET in {TARGETS}, got {item!r}")
        cases[name] = int(n)
    work_root = Path(args.work or tempfile.mkdtemp(prefix="pij-fuzz-"))
    head = _common.header("fuzz", threads=len(os.sched_getaffinity(0)), dtype="float32",
                          model="tiny random llama (tests/helpers_models.py)",
                          config={"cases": {t: cases[t] for t in args.targets},
                                  "hang_s": args.hang_s, "cli_processes": args.cli_processes},
                          quick=False)
    rows = []
    for target in args.targets:
        work = work_root / target
        work.mkdir(parents=True, exist_ok=True)
        findings: list = []
        t0 = time.perf_counter()
        print(f"{target}: {cases[target]} cases", flush=True)
        if target == "server":
            counts = fuzz_server.run(cases[target], work, args.hang_s, findings)
        else:
            counts = run_watched(target, cases[target], work, args.hang_s, findings)
            if target == "cli" and args.cli_processes:
                more = cli_processes(args.cli_processes, work, findings)
                counts = {k: counts[k] + more[k] for k in counts}
        wall = time.perf_counter() - t0
        for f in findings:
            rows.append({**head, "kind": "finding", **f})
        rows.append({**head, "kind": "run", "target": target, **counts, "wall_s": wall,
                     "fixed": FIXED[target]})
        rows.append({"kind": "summary", "target": target, "cases": counts["cases"],
                     "crashes": counts["crashes"] + counts["rule"], "hangs": counts["hangs"],
                     "findings_fixed": len(FIXED[target]), "commit": head["commit"]})
        print(f"{target}: {counts} in {wall:.0f} s", flush=True)
    _common.append_rows(args.out, rows)
    print(f"{len(rows)} rows -> {args.out} (inputs of findings under {work_root})")


if __name__ == "__main__":
    main()
