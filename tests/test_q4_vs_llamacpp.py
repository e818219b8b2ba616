"""benchmarks/q4_vs_llamacpp.py's summary on fake rows: per-round ratios, medians (no timing)."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "q4_vs_llamacpp.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("q4_vs_llamacpp", _PATH)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _row(isa, config, rnd, tok_s, kind="decode"):
    return {"kind": kind, "isa": isa, "config": config, "round": rnd, "tok_s": tok_s}


def test_summary_ratios_are_per_round(mod):
    # llama drifts 100 -> 50 between rounds; ours is always 0.8x of it: the median ratio is 0.8
    rows = [_row("native", "llama_q4_1", 0, 100.0), _row("native", "llama_q4_1", 1, 50.0),
            _row("native", "llama_q4_1", 2, 60.0),
            _row("native", "llama_bf16", 0, 50.0), _row("native", "llama_bf16", 1, 25.0),
            _row("native", "llama_bf16", 2, 30.0),
            _row("native", "dense_bf16", 0, 80.0), _row("native", "dense_bf16", 1, 40.0),
            _row("native", "dense_bf16", 2, 48.0),
            _row("avx2", "dense_bf16", 0, 40.0), _row("avx2", "dense_bf16", 1, 20.0),
            _row("native", "dense_bf16", "warmup", 1.0, kind="warmup")]
    got = {(s["isa"], s["config"]): s for s in mod.summarize(rows)}
    d = got[("native", "dense_bf16")]
    assert d["rounds"] == 3 and d["system"] == "powerinfer_jax"
    assert d["median_tok_s"] == pytest.approx(48.0)
    assert d["ratio_to_llama_q4_1_per_round"] == pytest.approx([0.8, 0.8, 0.8])
    assert d["median_ratio_to_llama_q4_1"] == pytest.approx(0.8)
    assert d["median_ratio_to_llama_bf16"] == pytest.approx(1.6)
    assert d["median_ratio_to_avx2_build"] == pytest.approx(2.0)
    # no llama.cpp rows for the avx2 build: no ratio, not a crash
    assert got[("avx2", "dense_bf16")]["median_ratio_to_llama_q4_1"] is None
    assert got[("native", "llama_q4_1")]["system"] == "llama.cpp"
    assert got[("native", "llama_q4_1")]["median_ratio_to_llama_q4_1"] == pytest.approx(1.0)
