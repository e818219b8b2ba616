"""The README's first command, run twice on a fresh clone, next to a bare `generate` (issue 53).

A new user runs `python3 -m pip install -e . && python3 -m powerinfer_jax.generate ...` (the
README's first command, read from README.md), then runs it again. Here: a fresh clone of this
checkout's commit, a new virtual environment, an empty cache (POWERINFER_JAX_CACHE in a temporary
folder) holding only a copy of the default model's own entry (no download); the command once
(the first run), then --rounds rounds of the command again (a second run) and the generate half
alone on the warm cache (the bare `generate` a second run is compared with), each half of the
command timed on its own (pip, then generate, as the `&&` runs them). A second run also counts
the compiled steps its generate wrote (`steps_recompiled`: 0 when the re-install kept them).
Rows in benchmarks/startup.jsonl: kind "readme_first_run", "readme_second_run",
"bare_generate_warm" and one "readme_second_run_summary" with the medians and ratios.

    python benchmarks/second_run.py [--rounds 3] [--out benchmarks/startup.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerinfer_jax._machine import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]


def readme_command(readme: Path) -> str:
    """The first line of the README's first bash block."""
    m = re.search(r"```bash\n(.+?)\n", readme.read_text(encoding="utf-8"))
    if not m:
        raise SystemExit(f"{readme}: no ```bash block")
    return m.group(1).strip()


def timed(cmd: str, env: dict, cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(["bash", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=3600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{cmd!r} failed ({out.returncode}): {out.stderr[-3000:]}")
    return wall, out.stdout


def _steps(cache: Path) -> dict:
    """Every stored compiled step of the cache: path -> mtime (a rewritten one is recompiled)."""
    return {str(p): p.stat().st_mtime_ns for p in (cache / "executables").glob("*/*.exe")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--model-cache", default=str(Path.home() / ".cache" / "powerinfer_jax"),
                   help="the cache whose models/<model> is copied into the empty one")
    p.add_argument("--python", default="python3", help="the interpreter the venv is made from")
    p.add_argument("--rounds", type=int, default=3,
                   help="second runs, each followed by a bare generate (default: 3)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="pij-second-run-"))
    clone, venv, cache = tmp / "clone", tmp / "venv", tmp / "cache"
    commit = git_commit()
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)],
                       check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach",
                        subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                       capture_output=True, text=True,
                                       check=True).stdout.strip()], check=True)
        subprocess.run([args.python, "-m", "venv", str(venv)], check=True)
        shutil.copytree(Path(args.model_cache) / "models" / args.model,
                        cache / "models" / args.model,
                        ignore=shutil.ignore_patterns("sparsity", ".*lock"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                   VIRTUAL_ENV=str(venv), POWERINFER_JAX_CACHE=str(cache))
        cmd = readme_command(clone / "README.md")
        pip_cmd, gen_cmd = (c.strip() for c in cmd.split("&&", 1))
        base = {"bench": "startup", "run_id": time.strftime("%Y%m%dT%H%M%S"), "commit": commit,
                "machine": machine_info(), "threads": len(os.sched_getaffinity(0)),
                "config": {"model": args.model, "command": cmd, "fresh_clone": True,
                           "new_venv": True, "cache": "empty but for the model's file"},
                "system": "ours"}
        rows = []

        def readme_run(kind: str) -> dict:
            before = _steps(cache)
            pip_s, _ = timed(pip_cmd, env, clone)
            gen_s, text = timed(gen_cmd, env, clone)
            after = _steps(cache)
            row = {**base, "kind": kind, "wall_s": pip_s + gen_s, "pip_s": pip_s,
                   "generate_s": gen_s, "loadavg": os.getloadavg()[0],
                   "steps_recompiled": sum(after.get(k) != v for k, v in before.items())
                   + len(set(after) - set(before)), "text": text.strip()[-200:]}
            print(f"{kind}: {pip_s + gen_s:.1f} s (pip {pip_s:.1f} s, generate {gen_s:.1f} s, "
                  f"{row['steps_recompiled']} steps compiled)", file=sys.stderr)
            return row

        rows.append(readme_run("readme_first_run"))
        for r in range(args.rounds):
            rows.append({**readme_run("readme_second_run"), "round": r})
            gen_s, text = timed(gen_cmd, env, clone)
            rows.append({**base, "kind": "bare_generate_warm", "round": r, "wall_s": gen_s,
                         "loadavg": os.getloadavg()[0], "text": text.strip()[-200:]})
            print(f"bare generate: {gen_s:.1f} s", file=sys.stderr)
        seconds = [x for x in rows if x["kind"] == "readme_second_run"]
        med = statistics.median(x["wall_s"] for x in rows if x["kind"] == "bare_generate_warm")
        total = statistics.median(x["wall_s"] for x in seconds)
        gen = statistics.median(x["generate_s"] for x in seconds)
        rows.append({**base, "kind": "readme_second_run_summary", "summary": True,
                     "rounds": args.rounds, "first_run_s": rows[0]["wall_s"],
                     "first_run_pip_s": rows[0]["pip_s"],
                     "median_second_run_s": total,
                     "median_second_run_pip_s": statistics.median(x["pip_s"] for x in seconds),
                     "median_second_run_generate_s": gen,
                     "median_bare_generate_s": med,
                     "second_run_to_bare": total / med,
                     "second_run_generate_to_bare": gen / med,
                     "steps_recompiled_in_second_runs": sum(x["steps_recompiled"]
                                                            for x in seconds),
                     "same_text": len({x["text"] for x in rows if "text" in x}) == 1})
        print(json.dumps(rows[-1], indent=1))
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
