"""A trained model's files for the peer benchmark (experiments/peer_files.py) and how
benchmarks/sparse_7b.py reads a model directory (synthetic or trained)."""
import json

import pytest

from helpers_models import save_hf_llama


def test_measured_sparsity_counts_the_models_zeros_at_its_thresholds(tmp_path):
    from experiments.peer_files import measured_sparsity

    save_hf_llama(tmp_path, hidden_act="relu", seed=2)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 300))
    plain = measured_sparsity(tmp_path, text, n_tokens=256)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"fatrelu_threshold": 0.05}))
    floored = measured_sparsity(tmp_path, text, n_tokens=256)
    assert 0.2 < plain < floored < 1.0  # random ReLU: about half zeros; more under FATReLU


@pytest.mark.parametrize("kind", ["synthetic.json", "peer_model.json"])
def test_sparse_7b_reads_synthetic_and_trained_model_dirs(tmp_path, kind):
    from benchmarks.sparse_7b import model_files

    rec = {"files": {"gguf": str(tmp_path / "m.gguf"), "powerinfer": str(tmp_path / "m.pwri")},
           "sparsity": 0.86, "config": {"vocab_size": 10}}
    (tmp_path / kind).write_text(json.dumps(rec))
    files = model_files(tmp_path)
    assert files["gguf"].name == "m.gguf" and files["pwri"].name == "m.pwri"
    synthetic = files["record"]["synthetic"]
    assert (synthetic is False) if kind == "peer_model.json" else "SYNTHETIC" in synthetic


def test_sparse_7b_refuses_a_dir_without_both_files(tmp_path):
    from benchmarks.sparse_7b import model_files

    (tmp_path / "peer_model.json").write_text(json.dumps({"files": {"gguf": "m.gguf"}}))
    with pytest.raises(SystemExit, match="expected a llama GGUF and a PowerInfer GGUF"):
        model_files(tmp_path)


def test_peer_files_refuses_a_model_that_is_not_an_hf_directory(tmp_path):
    from experiments.peer_files import main

    with pytest.raises(SystemExit, match="expected an HF directory with config.json"):
        main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing written
