"""benchmarks/ext_ab.py: its inputs are checked before anything runs (no timing here)."""
import pytest

from benchmarks import ext_ab


def test_missing_build_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match=r"--before: expected a built _pij_ext \.so file, got "):
        ext_ab.main(["--before", str(tmp_path / "none.so"), "--after", str(tmp_path / "x.so")])


def test_missing_model_file_is_a_clear_error(tmp_path):
    so = tmp_path / "a.so"
    so.write_bytes(b"")
    with pytest.raises(SystemExit, match=r"--model: expected a GGUF file or a model name"):
        ext_ab.main(["--before", str(so), "--after", str(so), "--model", str(tmp_path / "m.gguf")])
