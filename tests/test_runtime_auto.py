"""--sparsity auto decides on evidence (runtime/auto.py): with injected timings a tie keeps dense
and says so, a clear win picks the sparse mode, a clear loss dense; the bytes estimate skips
building a candidate that cannot win; a decision is cached per machine facts and reused; fresh
decisions on noisy timings of equal modes never pick the sparse mode."""
import random

import numpy as np
import pytest
from flax import nnx

from powerinfer_jax.config import ModelConfig
from powerinfer_jax.errors import UserError
from powerinfer_jax.models.transformer import Transformer
from powerinfer_jax.runtime import auto


class FakeTokenizer:
    def encode(self, text, add_bos=True):
        return [1, 2, 3]


class FakeSession:
    def __init__(self, label, root):
        self.label, self.root = label, root
        self.tokenizer = FakeTokenizer()
        self.model = None


class Builds:
    """build_one for choose(): records what was built (mode label, artifacts root)."""

    def __init__(self, fail_sparse=False):
        self.calls = []
        self.fail_sparse = fail_sparse

    def __call__(self, cfg, artifacts_root=None):
        label = "dense" if cfg.mode == "dense" else "predictor_q4gu"
        if label != "dense" and self.fail_sparse:
            raise UserError("sparsity artifacts: expected DIR, got none")
        self.calls.append((label, artifacts_root))
        return FakeSession(label, artifacts_root)


def timer_for(ratio, noise, seed=0):
    """tokens/s: dense ~100, the candidate ~100 * ratio, each with relative noise."""
    rng = random.Random(seed)

    def timer(session, prompt):
        base = 100.0 * (ratio if session.label == "predictor_q4gu" else 1.0)
        return base * (1.0 + rng.uniform(-noise, noise))
    return timer


def bound(b):
    return lambda model, target: {"dense_bytes": 100, "sparse_bytes": int(100 / b), "bound": b}


KEY = {"model": "m.gguf", "cpu": "x", "cpu_flags": "f", "threads": 2}


def choose(tmp_path, ratio, noise, *, builds=None, key=KEY, b=1.5, seed=0, trial=None):
    builds = builds or Builds()
    session, report = auto.choose(builds, key=key, target=0.5, cache_dir=tmp_path,
                                  progress=False, timer=timer_for(ratio, noise, seed),
                                  estimator=bound(b), trial=trial)
    return session, report, builds


def test_a_clear_win_picks_the_sparse_mode(tmp_path):
    session, report, _ = choose(tmp_path, 1.25, 0.02)
    assert report["verdict"] == "win" and report["chosen"] == "predictor_q4gu"
    assert session.label == "predictor_q4gu" and report["rounds"] == auto.MIN_ROUNDS
    assert report["interval"][0] >= auto.MARGIN and "chosen" in report["why"]


def test_a_clear_loss_keeps_dense(tmp_path):
    session, report, _ = choose(tmp_path, 0.90, 0.02)
    assert (report["verdict"], report["chosen"], session.label) == ("loss", "dense", "dense")
    assert report["interval"][1] < auto.MARGIN


def scripted(ratios):
    """dense at 100 tokens/s; the candidate at 100 * ratios[k] in its k-th timing (the first,
    the untimed warm-up, included)."""
    calls = {"predictor_q4gu": 0}

    def timer(session, prompt):
        if session.label == "dense":
            return 100.0
        k = calls["predictor_q4gu"]
        calls["predictor_q4gu"] += 1
        return 100.0 * ratios[k % len(ratios)]
    return timer


def test_a_tie_keeps_dense_and_says_tie(tmp_path):
    """Round ratios alternating 0.97x and 1.09x (a 3% faster candidate on a noisy machine): the
    interval straddles the margin after every round, so the rounds run out and the verdict is a
    tie, never a cached win."""
    session, report = auto.choose(Builds(), key=KEY, target=0.5, cache_dir=tmp_path,
                                  progress=False, timer=scripted([0.97, 1.09]),
                                  estimator=bound(1.5))
    assert (report["verdict"], report["chosen"], session.label) == ("tie", "dense", "dense")
    assert report["rounds"] == auto.MAX_ROUNDS and "tie" in report["why"]
    low, high = report["interval"]
    assert low < auto.MARGIN <= high
    cached = auto._read(auto.choice_file(tmp_path, KEY))
    assert cached["verdict"] == "tie" and cached["chosen"] == "dense"


def test_fresh_decisions_on_equal_modes_never_pick_the_sparse_mode(tmp_path):
    """20 fresh caches, equal speeds under +-8% noise (a drifting VM): dense every time, as a
    loss or a tie; a 25% faster candidate under the same noise wins every time."""
    equal = [choose(tmp_path / f"e{i}", 1.0, 0.08, seed=i)[1] for i in range(20)]
    assert {r["chosen"] for r in equal} == {"dense"}
    assert {r["verdict"] for r in equal} <= {"loss", "tie"}
    faster = [choose(tmp_path / f"f{i}", 1.25, 0.08, seed=i)[1] for i in range(20)]
    assert {r["chosen"] for r in faster} == {"predictor_q4gu"}


def test_the_estimate_skips_building_a_candidate_that_cannot_win(tmp_path):
    def no_timing(session, prompt):
        raise AssertionError("timed a candidate the estimate ruled out")

    builds = Builds()
    session, report = auto.choose(builds, key=KEY, target=0.5, cache_dir=tmp_path,
                                  progress=False, timer=no_timing, estimator=bound(1.01),
                                  trial=lambda dense: pytest.fail("trial artifacts built"))
    assert builds.calls == [("dense", None)] and session.label == "dense"
    assert report["verdict"] == "estimate" and "not built" in report["why"]


def test_a_trial_win_builds_the_full_artifacts_once(tmp_path):
    builds = Builds()
    _, report, _ = choose(tmp_path, 1.25, 0.02, builds=builds, trial=lambda dense: "trial-dir")
    assert report["trial"] and builds.calls == [("dense", None), ("predictor_q4gu", "trial-dir"),
                                                ("predictor_q4gu", None)]
    builds = Builds()
    _, report, _ = choose(tmp_path / "b", 0.9, 0.02, builds=builds, trial=lambda d: "trial-dir")
    assert builds.calls == [("dense", None), ("predictor_q4gu", "trial-dir")]


def test_a_candidate_that_cannot_be_built_is_dense_with_the_reason(tmp_path):
    session, report, _ = choose(tmp_path, 1.25, 0.02, builds=Builds(fail_sparse=True))
    assert session.label == "dense" and report["verdict"] == "unavailable"
    assert "could not be built" in report["why"]


def test_a_decision_is_reused_until_the_machine_facts_change(tmp_path):
    _, first, _ = choose(tmp_path, 1.25, 0.02)
    session, again, builds = choose(tmp_path, 0.5, 0.02)  # timings would now say loss
    assert again["cached"] and again["chosen"] == "predictor_q4gu"
    assert builds.calls == [("predictor_q4gu", None)]  # only the chosen mode is built
    moved = {**KEY, "cpu_flags": "other"}  # another CPU: timed again
    _, other, _ = choose(tmp_path, 0.5, 0.02, key=moved)
    assert not other["cached"] and other["chosen"] == "dense"
    auto.choice_file(tmp_path, KEY).write_text("{not json")
    _, redo, _ = choose(tmp_path, 0.5, 0.02)
    assert not redo["cached"] and redo["chosen"] == "dense"


def test_interval_and_verdict():
    low, mid, high = auto.interval([1.1, 1.1, 1.1])
    assert low == pytest.approx(1.1) and high == pytest.approx(1.1)
    r = [1.0, 1.1]  # t(1 df) = 12.706 on the log ratios
    logs = np.log(r)
    half = 12.706 * np.std(logs, ddof=1) / np.sqrt(2)
    assert auto.interval(r)[0] == pytest.approx(np.exp(logs.mean() - half))
    assert auto.verdict([1.2] * 5) == "win" and auto.verdict([0.9] * 5) == "loss"
    assert auto.verdict([0.9, 1.2, 0.95, 1.15, 1.0]) == "tie"


def test_the_estimate_counts_the_bytes_a_token_reads():
    """Tiny float32 model: every matrix once, the embedding only when tied, the candidate's
    gate/up as 4-bit estimates and half its down rows at target 0.5."""
    c = ModelConfig(arch="llama", vocab_size=53, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=6, d_ff=37, max_seq_len=64)
    m = Transformer(c, rngs=nnx.Rngs(0))
    e = auto.estimate(m, 0.5)
    f, d, l = c.d_ff, c.d_model, c.n_layers
    down = l * f * d * 4
    gate_up = 2 * down
    assert e["dense_bytes"] - e["sparse_bytes"] == pytest.approx(
        gate_up - 2 * l * f * d * auto.Q4_BYTES_PER_WEIGHT + 0.5 * down, abs=1)
    assert e["bound"] == pytest.approx(e["dense_bytes"] / e["sparse_bytes"], rel=1e-6)
    assert auto.estimate(m, 0.9)["bound"] > e["bound"] > auto.estimate(m, 0.1)["bound"] > 1
