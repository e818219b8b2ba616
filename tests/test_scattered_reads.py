"""benchmarks/scattered_reads.py refuses a share or round count it cannot run, in one line
(the run itself allocates ~4.6 GB: a benchmark, not a test)."""
import pytest

from benchmarks.scattered_reads import main


@pytest.mark.parametrize("args", [["--active", "0"], ["--active", "1.5"], ["--rounds", "0"]])
def test_out_of_range_arguments_are_one_line_errors(args, tmp_path):
    with pytest.raises(SystemExit, match=r"--active/--rounds: expected a share in \(0, 1\] and "
                                         r"rounds >= 1"):
        main([*args, "--out", str(tmp_path / "rows.jsonl")])
    assert not (tmp_path / "rows.jsonl").exists()
