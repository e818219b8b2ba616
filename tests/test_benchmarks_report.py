"""benchmarks/report.py: docs/MEASUREMENTS.md from the committed JSONL rows (no timing)."""
import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_PATH = REPO / "benchmarks" / "report.py"
_spec = importlib.util.spec_from_file_location("benchmarks_report", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_report_on_committed_rows_names_every_file_and_each_run(tmp_path):
    out = tmp_path / "MEASUREMENTS.md"
    assert report.main(["--root", str(REPO), "--out", str(out)]) == 0
    text = out.read_text()
    files = report.rows_files(REPO)
    assert len(files) >= 10, files
    for path in files:
        name = path.relative_to(REPO).as_posix()
        assert f"`{name}`" in text, name
        rows = [r for r in report.read_rows(path) if not r.get("quick")]
        runs = {report.run_of(report.flattened(r)) for r in rows}
        for run in runs:  # every run of every file has its own table heading
            assert f"({run}) in `{name}`" in text, (name, run)
    total = sum(len([r for r in report.read_rows(p) if not r.get("quick")]) for p in files)
    assert f"from {total} rows in {len(files)} files" in text
    # every table's meta line names a commit, a machine, threads and a date
    metas = [line for line in text.splitlines() if line.startswith("commit ")]
    assert len(metas) == text.count("\n### "), "a table without its meta line"
    for line in metas:
        assert re.match(r"commit \S.* · machine .+ · threads .+ · date \d{4}-\d\d-\d\d", line), line
    # rows from random weights say so
    assert "**synthetic**" in text
    assert (REPO / "docs" / "measurements_preface.md").read_text().strip()[:40] in text


def _write(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_tables_summaries_synthetic_and_quick_rows(tmp_path):
    machine = {"cpu": "Test CPU", "cpus": 2, "avx2": True}
    base = {"bench": "toy", "run_id": "20261201T000000Z", "commit": "abcdef0123", "threads": 2,
            "machine": machine, "time": "2026-12-01T00:00:00+00:00"}
    _write(tmp_path / "benchmarks" / "toy.jsonl", [
        {**base, "kind": "decode", "round": 0, "system": "a", "tok_s": 10.0},
        {**base, "kind": "decode", "round": 0, "system": "b", "tok_s": 20.0},
        {**base, "kind": "summary", "system": "b", "median_ratio": 2.0, "median_tok_s": 20.0},
        {**base, "run_id": "other", "quick": True, "system": "c", "tok_s": 1.0},
    ])
    _write(tmp_path / "results" / "synth.jsonl", [
        {"experiment": "gpu", "commit": "1234567", "machine": "Some GPU box", "threads": 12,
         "synthetic": True, "weights_note": "random weights", "model": "x", "decode_tok_s": 5.0},
    ])
    text = report.build(tmp_path)
    assert "from 4 rows in 2 files" in text  # the quick row is left out
    assert "### toy (20261201T000000Z) in `benchmarks/toy.jsonl`" in text
    assert ("commit abcdef0 · machine Test CPU (AVX2 only), 2 cores · threads 2 · date 2026-12-01"
            in text)
    assert "2 per-round rows summarized" in text
    assert "| 2 | 20 |" in text  # the summary row: median_ratio, median_tok_s
    assert "| a |" not in text  # per-round rows stay in the file
    assert "other" not in text
    assert "**synthetic** (random weights)" in text
    assert "date n/a" in text  # no time, no run id, and a commit git does not know


def test_report_bad_rows_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bad.jsonl").write_text('{"a": 1}\n{not json\n')
    with pytest.raises(report.ReportError, match=r"bad.jsonl:2: expected one JSON object per line"):
        report.build(tmp_path)
    assert report.main(["--root", str(tmp_path), "--out", str(tmp_path / "o.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("report: ") and "bad.jsonl:2" in err and "\n" not in err
    (tmp_path / "benchmarks" / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(report.ReportError, match=r"bad.jsonl:1: expected a JSON object, got list"):
        report.build(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(report.ReportError, match="expected JSONL rows under benchmarks, results/"):
        report.build(empty)
