"""Checks that a timing row's fields agree with each other. Speed itself is never asserted (the
machine decides it); what a row says about its own runs can be wrong, and these catch it."""
from __future__ import annotations

import statistics

import pytest


def assert_our_decode_row(row: dict, *, repeats: int, new_tokens: int,
                          runs_key: str = "decode_tok_s_runs") -> None:
    """A row of ours (bench.bench_model, benchmarks/gpu/hybrid_decode): one decode figure per
    timed run, the row's decode_tok_s their median, and (bench_model) the greedy tokens of the
    last run: at most new_tokens valid ids."""
    runs = row[runs_key]
    assert len(runs) == repeats, (runs_key, runs)
    assert all(r > 0 for r in runs), runs  # 0 is what an untimed run reports
    assert row["decode_tok_s"] == statistics.median(runs), row
    if "tokens" in row:
        tokens = row["tokens"]
        assert 1 <= len(tokens) <= new_tokens and all(isinstance(t, int) and t >= 0
                                                      for t in tokens), tokens
        assert row["new_tokens"] == new_tokens


def assert_llama_bench_row(row: dict, *, repeats: int, new_tokens: int) -> None:
    """A row from llama_cpp_ngl.run_llama_bench: llama-bench's mean (avg_ts) of its samples, one
    per repetition, over a test that generated new_tokens tokens."""
    runs = row["decode_runs"]
    assert len(runs) == repeats and all(r > 0 for r in runs), runs
    assert row["decode_tok_s"] == pytest.approx(statistics.fmean(runs), rel=1e-4), row
    assert int(row["llama_bench"]["n_gen"]) == new_tokens, row["llama_bench"]
