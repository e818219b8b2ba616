"""Write docs/MEASUREMENTS.md from the committed JSONL rows under benchmarks/ and results/.

  python benchmarks/report.py [--root .] [--out docs/MEASUREMENTS.md]

Every table is one run of one experiment in one file: its heading names the file, and the line under
it the commit(s), machine, threads and date its rows carry (a row without a time is dated by its
commit). Rows that say they come from random weights are marked "synthetic". Where a run has
summary rows (a key starting with `median`), the table shows those and counts the per-round rows it
leaves out; the rows themselves stay in the file. The hand-written preface (what the experiments
mean, the history of the figures) is docs/measurements_preface.md, copied in verbatim. Smoke runs
(`"quick": true`, results/quick/) are left out. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SOURCES = ("benchmarks", "results")  # folders whose top-level *.jsonl files are read
PREFACE = Path("docs") / "measurements_preface.md"
MAX_ROWS = 30  # rows shown per table; the rest are counted
MAX_COLUMNS = 11
SUMMARY_PREFIXES = ("median", "ratio_to")  # other summary keys shown after METRIC_KEYS

# What a row is about, tried in order: the first key present names the experiment.
EXPERIMENT_KEYS = ("experiment", "bench", "tag", "op")
# Keys that say which configuration a row measured (shown when they vary within a run).
CONFIG_KEYS = ("system", "kind", "config", "mode", "sparsity", "rule", "qtype", "limit_fraction",
               "policy", "variant", "stage", "shape", "op", "format", "formats", "part", "isa",
               "dtype", "weights", "weight_dtype", "gate_up", "predictor", "target_sparsity",
               "side", "batch", "concurrency", "d", "f", "o", "t", "active", "prompt_tokens",
               "new_tokens", "threads", "layer", "tokens", "step", "budget_ffn_fraction",
               "keep_quantized", "source_type", "down_format", "run_bytes", "keep")
# Measured quantities, most telling first.
METRIC_KEYS = ("status", "ours_over_llama_cpp", "ours_over_our_dense", "ours_tok_s",
               "llama_cpp_tok_s", "measured_sparsity", "ppl_over_dense", "greedy_agreement",
               "over_disk_bound", "hit_rate", "median_ratio", "median_ratio_to_llama_q4_1",
               "median_ratio_to_llama_bf16", "median_ratio_to_native_build",
               "median_ratio_to_avx2_build", "ratio_to_dense_median", "decode_ratio_median",
               "prefill_ratio_median", "vs_llama_cpp_median", "ratio_to_sequential",
               "median_tok_s", "decode_tok_s_median", "decode_tok_s", "tok_s", "aggregate_tok_s",
               "agg_tok_s_median", "prefill_tok_s", "load_plus_build_s", "ppl", "llama_ppl",
               "relative_diff", "score", "ppl_ours", "ppl_powerinfer", "ppl_ratio", "ppl_x_dense",
               "ffn_sparsity", "predictor_recall", "heldout_recall", "speedup", "speedup_vs_bf16",
               "us", "gbps", "achieved_gb_s", "achieved_gbs", "effective_gbs",
               "bandwidth_fraction", "step_ms", "neurons_for_80pct", "top10pct_share",
               "rss_growth_over_file", "weights_resident_over_file", "rel_err_max",
               "ttft_p50_s_median", "latency_p50_s_median", "errors", "sequences_differing",
               "time_over_stream", "time_over_keep1", "over_stream", "gbs")


class ReportError(ValueError):
    """A rows file the report cannot read; the message names the file and line."""


def read_rows(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{number}: expected one JSON object per line, got {e.msg}") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def flattened(row: dict) -> dict:
    """A row with its `config` dict's keys lifted beside its own (the row's own keys win)."""
    config = row.get("config")
    if isinstance(config, dict):
        row = {**config, **{k: v for k, v in row.items() if k != "config"}}
    for key, value in list(row.items()):  # a summary's {system: figure} dicts become columns
        if key.startswith(SUMMARY_PREFIXES) and isinstance(value, dict) and len(value) <= 6:
            row.update({f"{key}.{k}": v for k, v in value.items()
                        if isinstance(v, (int, float)) and f"{key}.{k}" not in row})
    return row


def notes_of(rows: list[dict]) -> str:
    """The free-text notes a run's rows carry (machine load, what was stopped), once each."""
    notes = []
    for r in rows:
        for key in ("note", "tag", "shared_machine"):
            text = r.get(key)
            if isinstance(text, str) and " " in text and text not in notes:
                notes.append(text if len(text) <= 200 else text[:197] + "...")
    return "; ".join(notes)


def experiment_of(row: dict, default: str) -> str:
    for key in EXPERIMENT_KEYS:
        if isinstance(row.get(key), str):
            return row[key]
    return default


def run_of(row: dict) -> str:
    """Rows of one run share a run id; rows from before run ids existed share a commit."""
    return str(row.get("run_id") or f"commit {row.get('commit', '?')}")


def machine_text(machine) -> str:
    if isinstance(machine, str):
        return machine
    if not isinstance(machine, dict):
        return "n/a"
    parts = [str(machine.get("gpu") or "")] if machine.get("gpu") else []
    if machine.get("cpu"):
        cpu = str(machine["cpu"])
        if machine.get("avx512f"):
            cpu += " (AVX-512)"
        elif machine.get("avx2"):
            cpu += " (AVX2 only)"
        parts.append(cpu)
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} cores")
    return ", ".join(parts) or "n/a"


class CommitDates:
    """Dates from git: of a commit, for rows that carry a commit but no time; of a rows file's
    last commit, for rows that carry neither. Empty where git does not know (no repository)."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def _git(self, *args: str) -> str:
        if args not in self.cache:
            try:
                out = subprocess.run(["git", *args], cwd=self.root, capture_output=True,
                                     text=True, check=False)
                self.cache[args] = out.stdout.strip() if out.returncode == 0 else ""
            except OSError:  # no git on this machine
                self.cache[args] = ""
        return self.cache[args]

    def __call__(self, commit: str) -> str:
        if "log" not in self.cache:  # one git call for every commit's date
            self.cache["log"] = dict(line.split() for line in
                                     self._git("log", "--all", "--format=%H %cs").splitlines())
        dates = self.cache["log"]
        return next((d for h, d in dates.items() if h.startswith(commit)), "") if commit else ""

    def of_file(self, name: str) -> str:
        return self._git("log", "-1", "--format=%cs", "--", name)


def run_date(rows: list[dict], commit_date: CommitDates, name: str) -> str:
    times = sorted(str(r["time"])[:10] for r in rows if r.get("time"))
    if times:
        return times[0] if times[0] == times[-1] else f"{times[0]}..{times[-1]}"
    run_id = str(rows[0].get("run_id") or "")
    if len(run_id) >= 8 and run_id[:8].isdigit():
        return f"{run_id[:4]}-{run_id[4:6]}-{run_id[6:8]}"
    dates = sorted({d for d in (commit_date(str(r["commit"])) for r in rows if r.get("commit")) if d})
    if dates:
        return ", ".join(dates) + " (commit date)"
    committed = commit_date.of_file(name)
    return f"{committed} (the file's last commit; the rows carry no date)" if committed else "n/a"


def synthetic_note(rows: list[dict]) -> str:
    notes = set()
    for r in rows:
        flag = r.get("synthetic")
        if isinstance(flag, str):
            notes.add(flag)
        elif flag or "synthetic" in str(r.get("model", "")):
            notes.add(str(r.get("weights_note") or "random weights"))
    return "; ".join(sorted(notes))


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"
    if isinstance(v, (list, dict)):
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 40 else text[:37] + "..."
    return str(v).replace("|", "/").replace("\n", " ")


def shown_rows(rows: list[dict]) -> tuple[list[dict], str]:
    """The summary rows of a run (kind "summary", or median fields) where it has them, else its
    rows; and a note on what is left out."""
    summaries = [r for r in rows if r.get("kind") == "summary"
                 or any(k.startswith("median") for k in r)]
    chosen = summaries if summaries and len(summaries) < len(rows) else rows
    note = f"{len(rows) - len(chosen)} per-round rows summarized" if chosen is not rows else ""
    if len(chosen) > MAX_ROWS:
        note = ", ".join(filter(None, [note, f"first {MAX_ROWS} of {len(chosen)} rows shown"]))
        chosen = chosen[:MAX_ROWS]
    return chosen, note


def columns(rows: list[dict]) -> list[str]:
    def scalar(v):
        return v is None or isinstance(v, (str, int, float, bool))

    def varies(key):
        values = {json.dumps(r.get(key), sort_keys=True) for r in rows}
        return len(values) > 1

    config = [k for k in CONFIG_KEYS if any(k in r for r in rows) and varies(k)
              and all(scalar(r.get(k)) for r in rows)]
    present = sorted({k for r in rows for k in r})
    extra = [k for k in present if k.startswith(SUMMARY_PREFIXES) and k not in METRIC_KEYS]
    metrics = [k for k in (*METRIC_KEYS, *extra) if k not in config
               and any(r.get(k) is not None and scalar(r.get(k)) for r in rows)]
    return (config + metrics)[:MAX_COLUMNS] or ["commit"]


def table(rows: list[dict]) -> list[str]:
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def section(name: str, rows: list[dict], commit_date: CommitDates) -> list[str]:
    """One file's tables: one per (experiment, run), in the order the runs were appended."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((experiment_of(r, Path(name).stem), run_of(r)), []).append(r)
    lines = [f"## `{name}`", ""]
    for (experiment, run), group in groups.items():
        commits = sorted({str(r["commit"])[:7] for r in group if r.get("commit")})
        threads = sorted({str(r["threads"]) for r in group if r.get("threads") is not None})
        machines = sorted({machine_text(r.get("machine")) for r in group if r.get("machine")})
        meta = [f"commit {', '.join(commits) or 'n/a'}", f"machine {'; '.join(machines) or 'n/a'}",
                f"threads {', '.join(threads) or 'n/a'}", f"date {run_date(group, commit_date, name)}",
                f"{len(group)} rows"]
        synthetic = synthetic_note(group)
        if synthetic:
            meta.append(f"**synthetic** ({synthetic})")
        superseded = sorted({str(r["superseded_by"]) for r in group if r.get("superseded_by")})
        if superseded:
            meta.append(f"superseded by {', '.join(superseded)}")
        shown, note = shown_rows(group)
        if note:
            meta.append(note)
        notes = notes_of(group)
        if notes:
            meta.append(f"notes: {notes}")
        lines += [f"### {experiment} ({run}) in `{name}`", "", " · ".join(meta), ""]
        lines += table(shown) + [""]
    return lines


def rows_files(root: Path) -> list[Path]:
    return sorted(p for folder in SOURCES for p in (root / folder).glob("*.jsonl"))


def build(root: Path) -> str:
    root = Path(root)
    commit_date = CommitDates(root)
    files = rows_files(root)
    if not files:
        raise ReportError(f"{root}: expected JSONL rows under {', '.join(SOURCES)}/, found none")
    body, counts = [], []
    for path in files:
        name = path.relative_to(root).as_posix()
        rows = [flattened(r) for r in read_rows(path) if not r.get("quick")]
        counts.append((name, len(rows)))
        if rows:
            body += section(name, rows, commit_date)
    preface_path = root / PREFACE
    preface = preface_path.read_text(encoding="utf-8").strip() if preface_path.exists() else ""
    head = ["# Measurements", "",
            f"Generated by `python benchmarks/report.py` from {sum(n for _, n in counts)} rows in "
            f"{len(counts)} files; do not edit by hand (the preface is `{PREFACE.as_posix()}`).", ""]
    index = ["## Files", "", "| file | rows |", "|---|---|"]
    index += [f"| `{name}` | {n} |" for name, n in counts] + [""]
    return "\n".join(head + ([preface, ""] if preface else []) + index + body).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository root (default: this checkout)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write (default: ROOT/docs/MEASUREMENTS.md; '-' for stdout)")
    args = parser.parse_args(argv)
    try:
        text = build(args.root)
    except (ReportError, OSError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    if str(args.out) == "-":
        sys.stdout.write(text)
        return 0
    out = args.out or args.root / "docs" / "MEASUREMENTS.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"report: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
