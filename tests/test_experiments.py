"""experiments/: REPORT.md tables from synthetic JSONL, run_all's registry, isolation and resume,
and the pieces of the experiments that run on a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers_rows import assert_our_decode_row
from experiments import _common, cost_breakdown, peers, power_law, report, run_all

REPO = Path(__file__).resolve().parents[1]

MACHINE = {"cpu": "Test CPU", "cpus": 2, "host": "ci"}


def _row(experiment, run, **fields):
    return {"experiment": experiment, "run_id": run, "quick": False, "commit": "abc1234",
            "machine": MACHINE, "model": "tiny", "config": fields.pop("config", {}), **fields}


def _write(d: Path, name: str, rows):
    _common.append_rows(d / report.FILES[name], rows)


def test_report_tables_from_synthetic_rows(tmp_path):
    abl = [_row("ablation", "r1", threads=2, dtype="bfloat16", status="ok", decode_tok_s=99.0,
                config={"step": "dense_xla"})]  # an older run: must not appear
    for step, v in (("dense_xla", 10.0), ("dense_ffi", 20.0), ("predictor", 25.0)):
        abl.append(_row("ablation", "r2", threads=2, dtype="bfloat16", status="ok",
                        decode_tok_s=v, config={"step": step}))
    abl.append(_row("ablation", "r2", threads=2, dtype="bfloat16", status="not available",
                    reason="no hybrid", config={"step": "hybrid_naive"}))
    _write(tmp_path, "ablation", abl)
    peer = [_row("peers", "r2", threads=1, system="powerinfer_jax", weights="bfloat16",
                 sparsity="predictor", status="ok", decode_tok_s=30.0, prefill_tok_s=100.0,
                 agree_fraction=0.5, agree_prefix=4, agree_n=8),
            _row("peers", "r2", threads=1, system="powerinfer_jax", weights="bfloat16",
                 sparsity="predictor_q4gu@0.6", status="ok", decode_tok_s=40.0,
                 prefill_tok_s=100.0),
            _row("peers", "r2", threads=1, system="llama.cpp", weights="BF16", sparsity="dense",
                 status="ok", decode_tok_s=20.0, prefill_tok_s=200.0),
            _row("peers", "r2", threads=1, system="llama.cpp", weights="F32", sparsity="dense",
                 status="not available", reason="pip install llama-cpp-python")]
    _write(tmp_path, "peers", peer)
    _write(tmp_path, "prompt_length", [
        _row("prompt_length", "r2", threads=2, dtype="bfloat16", status="ok", sparsity=m,
             prompt_tokens=8, prefill_tok_s=p, decode_tok_s=d)
        for m, p, d in (("dense", 100.0, 10.0), ("predictor", 50.0, 20.0))])
    _write(tmp_path, "quality_vs_sparsity", [  # the pre-run-id schema of quality_vs_sparsity.py
        {"model": "tiny", "commit": "old", "machine": MACHINE, "dtype": "float32", "mode": m,
         "target_sparsity": t, "ppl": p, "ffn_sparsity": s, "eval_text": "wiki.valid.txt",
         "ctx": 512, "eval_chunks": 16}
        for m, t, p, s in (("dense", 0.0, 10.0, 0.0), ("oracle", 0.5, 10.5, 0.5))] + [
        {"model": "tiny", "commit": "new", "machine": MACHINE, "dtype": "float32",
         "mode": "predictor", "predictor": "q4", "gate_up": g, "target_sparsity": t, "ppl": p,
         "ffn_sparsity": t, "eval_text": "wiki.valid.txt", "ctx": 512, "eval_chunks": 16}
        for g, t, p in ((None, 0.5, 10.7), ("q4", 0.6, 11.0))])
    _common.append_rows(tmp_path / report.STATUS_FILE, [
        {"experiment": "peers", "status": "failed", "seconds": 3.0, "commit": "abc1234",
         "error": "exit status 1: boom"}])
    text = report.render(tmp_path, tmp_path / "REPORT.md")

    assert ("| 2 | bfloat16 | 10.0 (1.00x) | 20.0 (2.00x) | 25.0 (2.50x) | - | not available | - |"
            in text)
    assert "99.0" not in text  # older run ignored
    assert "| 1 | llama.cpp | F32 | dense | not available |" in text
    # bf16 vs llama.cpp BF16, and perplexity <= 1.08x dense: 1.07 meets it, 1.10 does not
    assert "| 1 | predictor | 30.0 | 20.0 | 1.50 | 1.070 | yes |" in text
    assert "| 1 | predictor_q4gu@0.6 | 40.0 | 20.0 | 2.00 | 1.100 | no |" in text
    assert "0.50 (prefix 4/8)" in text
    assert "| 2 | bfloat16 | 8 | 100.0 | 50.0 | 0.50 | 10.0 | 20.0 | 2.00 |" in text
    assert "| 0.50 | oracle | 0.500 | 10.500 | 1.050 |" in text
    assert "| peers | failed | 3 | abc1234 | exit status 1: boom |" in text
    assert "Test CPU (2 CPUs, host ci)" in text and "commit: abc1234" in text
    assert "## power_law\n\nNo results yet" in text  # missing experiment: says so, no crash


def test_quality_rows_keep_the_latest_row_of_each_mode_and_target():
    rows = [{"run_id": "a", "mode": "oracle", "target_sparsity": 0.5, "ppl": 1.0},
            {"run_id": "a", "mode": "predictor", "predictor": "q4", "target_sparsity": 0.5,
             "ppl": 2.0},
            {"run_id": "b", "mode": "predictor", "predictor": "q4", "target_sparsity": 0.5,
             "ppl": 3.0},
            {"run_id": "b", "mode": "predictor", "predictor": "q4", "gate_up": "q4",
             "target_sparsity": 0.5, "ppl": 4.0}]
    assert sorted(r["ppl"] for r in report.latest_per_mode(rows)) == [1.0, 3.0, 4.0]
    assert _common.mode_label(rows[3]) == "predictor (q4, gate/up q4)"


def test_latest_run_goes_by_time_not_by_the_label():
    rows = [{"run_id": "cb-1", "time": "2026-11-22T08:41:57", "v": 1},
            {"run_id": "20261122T095114Z", "time": "2026-11-22T09:58:00", "v": 2}]
    assert [r["v"] for r in report.latest_run(rows)] == [2]


def test_latest_run_prefers_newest_run_id():
    rows = [{"run_id": "a", "v": 1}, {"run_id": "b", "v": 2}, {"v": 3, "commit": "x"}]
    assert [r["v"] for r in report.latest_run(rows)] == [2]
    assert [r["v"] for r in report.latest_run([{"commit": "x", "v": 1},
                                               {"commit": "y", "v": 2}])] == [2]


def test_registry_lists_every_script():
    scripts = {p.stem for p in (REPO / "experiments").glob("*.py")
               if not p.stem.startswith("_")}
    registered = {e.name for e in run_all.REGISTRY}
    assert registered.isdisjoint(run_all.NOT_RUN)
    assert scripts == registered | set(run_all.NOT_RUN), (
        f"unregistered: {scripts - registered - set(run_all.NOT_RUN)}")
    for e in run_all.REGISTRY:
        assert e.name in report.FILES


def test_run_all_records_a_failing_experiment_and_resumes(tmp_path):
    bad = run_all.Experiment("no_such_experiment", (), (), (1, 1))
    row = run_all.run_experiment(bad, quick=True, out_dir=tmp_path, timeout_s=60)
    assert row["status"] == "failed" and "exit status" in row["error"]
    assert Path(row["log"]).is_file()
    ok = dict(row, status="ok", args=[])
    assert run_all.done_at_commit(bad, True, row["commit"], [ok])
    assert not run_all.done_at_commit(bad, False, row["commit"], [ok])  # other settings
    assert not run_all.done_at_commit(bad, True, "other", [ok])  # other commit
    assert run_all.estimate(bad, True, [dict(ok, seconds=42.0)]) == 42.0


def test_power_law_rows_on_a_planted_distribution():
    f = 100
    counts = np.zeros((2, f), np.int64)
    counts[0, :10] = 90  # 10 neurons carry 900 of 910 activations
    counts[0, 10:20] = 1
    counts[1] = 5  # uniform: 80% of neurons cover 80%
    rows = power_law.layer_rows(counts, n_tokens=100)
    assert rows[0]["neurons_for_80pct"] == pytest.approx(0.09)
    assert rows[1]["neurons_for_80pct"] == pytest.approx(0.80)
    assert rows[0]["curve_frequency"][0] == pytest.approx(0.9)
    assert len(rows[0]["curve_frequency"]) == power_law.CURVE_POINTS
    with pytest.raises(ValueError, match="activation counts: expected"):
        power_law.layer_rows(counts[0], n_tokens=100)


def test_greedy_agreement():
    assert peers.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {"agree_n": 4, "agree_fraction": 0.75,
                                                          "agree_prefix": 2}
    assert peers.agreement([1, 2], [1, 2, 3])["agree_prefix"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "lowrank", "q4", "q4gu"])
def test_cost_breakdown_components_on_a_tiny_model(mode):
    from flax import nnx

    from helpers_models import tiny_llama_config, with_mode
    from powerinfer_jax.config import SparsityConfig
    from powerinfer_jax.models.transformer import Transformer
    from powerinfer_jax.sparsity.predictor import Predictor

    c = tiny_llama_config()
    model = Transformer(c, rngs=nnx.Rngs(0), kernels="xla")
    zeros = (0.0,) * c.n_layers
    if mode == "lowrank":
        with_mode(model, SparsityConfig("predictor", predictor="lowrank"), thresholds=zeros,
                  predictors=[Predictor(c.d_model, 8, c.d_ff, rngs=nnx.Rngs(1))
                              for _ in model.layers])
    elif mode in ("q4", "q4gu"):
        with_mode(model, SparsityConfig("predictor", gate_up="q4" if mode == "q4gu" else "full"),
                  thresholds=zeros)
    x = np.random.default_rng(0).standard_normal((c.n_layers, 1, 1, c.d_model)).astype(np.float32)
    parts = cost_breakdown.components(model, x, position=5, kv_len=16, max_seq_len=32,
                                      repeats=2)
    for key in ("attention_ms", "ffn_cold_ms", "lm_head_ms"):
        assert parts[key] > 0
    assert (parts["predictor_ms"] > 0) == (mode != "dense")
    active = parts["active_per_layer"]
    assert len(active) == c.n_layers and all(0 <= a <= c.d_ff for a in active)
    b = cost_breakdown.bytes_per_token(model, active_per_layer=active, kv_len=16,
                                       predictor=mode != "dense", down_only=mode == "q4gu")
    assert b["ffn_rows"] == sum(active) * (1 if mode == "q4gu" else 3) * c.d_model * 4
    assert b["lm_head"] == c.vocab_size * c.d_model * 4
    assert b["kv_cache"] == 2 * 16 * c.kv_dim * 4 * c.n_layers
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
    if mode == "lowrank":  # weights [R, D] and [F, R] in the model's dtype, f32 biases
        assert b["predictor"] == c.n_layers * 4 * (8 * c.d_model + 8 + c.d_ff * 8 + c.d_ff)
    if mode in ("q4", "q4gu"):  # per neuron: gate and up, each 64 nibble bytes + 8 fp16 scales/minimums
        pairs = -(-c.d_model // 64)
        assert b["predictor"] == c.n_layers * c.d_ff * 2 * (32 * pairs + 2 * 4 * pairs)


def test_gpu_hybrid_section_from_synthetic_rows(tmp_path):
    def gpu_row(mode, budget, tok_s, time, **extra):
        return {"experiment": "gpu_hybrid_decode", "time": time, "commit": "abc1234",
                "machine": {**MACHINE, "gpu": "Test GPU"}, "threads": 12, "dtype": "bfloat16",
                "model": "m (synthetic)", "config": {"profile_target": "0.50"}, "mode": mode,
                "budget_ffn_fraction": budget, "decode_tok_s": tok_s, "served_fraction": 0.3,
                **extra}
    rows = [gpu_row("hybrid", 0.25, 1.0, "t0", superseded_by="later fix"),  # left out
            gpu_row("hybrid", 0.25, 30.0, "t1", overlap={
                "full_us": 100.0, "hot_only_us": 40.0, "cold_only_us": 90.0, "none_us": 20.0,
                "sum_of_parts_us": 110.0, "overlap_saved_us": 10.0}),
            gpu_row("layers", 0.25, 12.0, "t1"), gpu_row("layers_dense", 0.25, 5.0, "t0"),
            gpu_row("layers_dense", 0.25, 10.0, "t2"),  # the newest row of its cell wins
            gpu_row("all_gpu", None, 100.0, "t1"), gpu_row("error", 0.1, None, "t1")]
    rows[-1].pop("decode_tok_s")
    _common.append_rows(tmp_path / "g.jsonl", rows)
    text = report.section_gpu_hybrid(tmp_path / "g.jsonl")
    assert "### m (synthetic), activation profile target 0.50" in text
    assert "| 25% | 30.0 | 12.0 | 10.0 | 2.50x | 3.00x | 0.30 |" in text
    assert "sparse kernels 100.0 tok/s, dense XLA n/a" in text
    assert "| 25% | 100.0 | 40.0 | 90.0 | 20.0 | 110.0 | 10.0 |" in text
    assert report.section_gpu_hybrid(tmp_path / "missing.jsonl") == ""


def test_gpu_hybrid_experiment_says_why_it_cannot_run_here(tmp_path):
    from experiments import gpu_hybrid

    out = tmp_path / "gpu_hybrid.jsonl"
    gpu_hybrid.main(["--quick", "--out", str(out)])
    rows = _common.read_rows(out)
    if rows[0].get("status") == "not available":  # the CI machines: no GPU
        (row,) = rows
        assert "GPU" in row["reason"] or "PIJ_CUDA" in row["reason"]
        text = report.section_gpu_hybrid(out)
        assert "not available" in text and row["reason"] in text
    else:  # a GPU machine with the CUDA build: measured rows, each consistent with its runs
        for r in rows:
            assert_our_decode_row(r, repeats=1, new_tokens=8, runs_key="decode_runs")  # QUICK
        assert {r["mode"] for r in rows} >= {"hybrid", "layers"}


def test_head_to_head_interleaves_and_takes_the_median_of_round_ratios():
    class FakeEngine:
        def __init__(self, speeds):
            self.speeds, self.calls = list(speeds), 0

        def generate(self, ids, max_new_tokens):
            self.calls += 1
            tok_s = self.speeds.pop(0) if max_new_tokens > 4 else 0.0  # 4: the warm-up call
            return type("R", (), {"decode_tok_s": tok_s})()

    peer = iter([10.0, 20.0, 40.0])  # llama.cpp tok/s per round (decode of 9 tokens)
    order = []

    def llama_run(n):
        order.append("llama")
        return 0.0, (n - 1) / next(peer), []

    eng = FakeEngine([11.0, 20.0, 20.0])  # per-round ratios 1.1, 1.0, 0.5 -> median 1.0
    real_generate = eng.generate
    eng.generate = lambda ids, max_new_tokens: (order.append("ours"),
                                                real_generate(ids, max_new_tokens))[1]
    out = peers.head_to_head({"predictor_q4gu": eng}, llama_run, [1, 2, 3], new_tokens=10,
                             rounds=3)
    assert order == ["ours"] + ["llama", "ours"] * 3  # warm-up, then interleaved rounds
    assert out["llama_cpp_bf16_tok_s"] == pytest.approx(20.0)
    m = out["modes"]["predictor_q4gu"]
    assert m["tok_s"] == 20.0 and m["ratio"] == pytest.approx(1.0)


def test_report_shows_the_interleaved_head_to_head():
    rows = [_row("peers", "r", threads=2, system="head_to_head", weights="BF16",
                 sparsity="interleaved", status="ok", rounds=5, llama_cpp_bf16_tok_s=90.0,
                 modes={"predictor_q4gu": {"tok_s": 93.0, "ratio": 1.03, "runs": []},
                        "dense": {"tok_s": 70.0, "ratio": 0.78, "runs": []}}),
            _row("peers", "r", threads=2, system="llama.cpp", weights="BF16", sparsity="dense",
                 status="ok", decode_tok_s=90.0, prefill_tok_s=500.0)]
    quality = [{"mode": "dense", "ppl": 10.0, "target_sparsity": 0.0},
               {"mode": "predictor", "predictor": "q4", "gate_up": "q4", "target_sparsity": 0.5,
                "ppl": 10.3}]
    text = report.section_peers(rows, "", quality=quality)
    assert "| 2 | predictor_q4gu | 93.0 | 90.0 | 1.03 | 1.030 | yes | 5 |" in text  # was @0.5
    assert "| 2 | dense | 70.0 | 90.0 | 0.78 | 1.00 | n/a | 5 |" in text
    # without a quality row for the mode the target cannot be called met
    assert "| 2 | predictor_q4gu | 93.0 | 90.0 | 1.03 | n/a | no | 5 |" in report.section_peers(
        rows, "")
    assert "head_to_head" not in text  # not a row of the per-system table


def test_peers_plot_skips_the_head_to_head_summary(tmp_path):
    from experiments import plots

    rows = [_row("peers", "r", threads=2, system=s, weights=w, sparsity=sp, status="ok",
                 decode_tok_s=v, prefill_tok_s=1.0)
            for s, w, sp, v in (("llama.cpp", "BF16", "dense", 90.0),
                                ("powerinfer_jax", "bfloat16", "predictor_q4gu@0.6", 100.0))]
    rows.append(_row("peers", "r", threads=2, system="head_to_head", weights="BF16",
                     sparsity="interleaved", status="ok", rounds=5, llama_cpp_bf16_tok_s=90.0,
                     modes={}))
    path = plots.plot_peers(rows, tmp_path / "peers.png")
    png = path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]  # a whole PNG: signature ... IEND chunk
    assert png[-12:-4] == b"\x00\x00\x00\x00IEND", png[-12:]


def test_powerinfer_peer_exports_are_named_by_their_model(tmp_path):
    """Exports of two models never share a file (the stem hashes the model's files), and a
    directory without a sparsify.json naming a registry teacher has no GGUF tokenizer to export:
    a clear exit, not another model's vocabulary."""
    from experiments import peers_powerinfer
    from helpers_models import tiny_llama_config, write_tiny_gguf
    from powerinfer_jax.checkpoint import load_checkpoint

    paths = []
    for seed in (0, 1):
        paths.append(tmp_path / f"tiny{seed}.gguf")
        write_tiny_gguf(paths[-1], tiny_llama_config(activation="relu"), seed=seed)
    configs = [load_checkpoint(p).config for p in paths]
    stems = [peers_powerinfer.export_stem(str(p), p, c) for p, c in zip(paths, configs)]
    assert stems[0] != stems[1] and all(s.startswith("tiny") for s in stems), stems
    assert peers_powerinfer.export_stem(str(paths[0]), paths[0], configs[0]) == stems[0]  # stable
    assert peers_powerinfer.export_stem("smollm2-135m", paths[0], configs[0]) == "smollm2-relu"
    tok = load_checkpoint(paths[0]).tokenizer
    meta = peers_powerinfer.gguf_tokenizer_meta(paths[0], tok)
    assert meta["tokens"] == peers.tokenizer_meta(paths[0])["tokens"]
    d = tmp_path / "plain-dir"
    d.mkdir()
    with pytest.raises(SystemExit, match="sparsify.json names a registry teacher"):
        peers_powerinfer.gguf_tokenizer_meta(d, tok)
    (d / "sparsify.json").write_text(json.dumps({"fingerprint": {"id": "files:abc"}}))
    with pytest.raises(SystemExit, match="got teacher 'files:abc'"):
        peers_powerinfer.gguf_tokenizer_meta(d, tok)


def test_powerinfer_peer_summary_compares_our_exact_mode_with_its_predictor_mode():
    """Our predictor-free mode ("exact") has no PowerInfer twin: its ratios and perplexity are
    taken against PowerInfer's sparse (predictor) mode of the same round and threads."""
    import argparse

    from experiments import peers_powerinfer as pp

    rows = []
    for rnd, (theirs, ours) in enumerate([(50.0, 80.0), (40.0, 80.0), (50.0, 90.0)]):
        rows.append({"system": "powerinfer", "mode": "predictor", "threads": 2, "round": rnd,
                     "decode_tok_s": theirs, "prefill_tok_s": 100.0,
                     **({"ppl": 110.0} if rnd == 0 else {})})
        rows.append({"system": "powerinfer", "mode": "dense", "threads": 2, "round": rnd,
                     "decode_tok_s": 1.0, "prefill_tok_s": 1.0})
        rows.append({"system": "powerinfer_jax", "mode": "exact", "dtype": "bfloat16",
                     "threads": 2, "round": rnd, "decode_tok_s": ours, "prefill_tok_s": 150.0,
                     **({"ppl": 60.0} if rnd == 0 else {})})
    args = argparse.Namespace(rounds=3, model="tiny", quick=False)
    (row,) = pp.summary(rows, args, {}, "abc")
    assert row["mode"] == "exact" and row["powerinfer_mode"] == "predictor"
    assert row["decode_ratios"] == [1.6, 2.0, 1.8] and row["decode_ratio_median"] == 1.8
    assert row["ppl_ours"] == 60.0 and row["ppl_powerinfer"] == 110.0
    assert row["ppl_powerinfer_runs"] == [110.0]


def test_powerinfer_peer_rejects_a_repeat_count_below_one():
    """--ppl-repeats 0 would compare a median of nothing: a one-line exit before any build."""
    from experiments import peers_powerinfer

    with pytest.raises(SystemExit, match=r"--ppl-repeats: expected >= 0 / >= 1, got 0 / 0"):
        peers_powerinfer.main(["--ppl-repeats", "0", "--powerinfer-src", "/nonexistent"])
