"""--vram-budget / --offload through the session and the CLIs on a tiny model saved to disk."""
import json

import pytest

from helpers_models import save_hf_llama
from helpers_tolerances import assert_close
from powerinfer_jax import bench
from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
from powerinfer_jax.runtime.session import build
from powerinfer_jax.sparsity import placement as pl

GIB = 1 << 30
RUNTIME = RuntimeConfig(max_seq_len=32)
ORACLE = SparsityConfig(mode="oracle")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    save_hf_llama(d, hidden_act="relu")
    return d


@pytest.fixture(scope="module")
def sizes(tiny_dir):
    s = build(str(tiny_dir), RUNTIME, ORACLE, progress=False)
    return pl.model_bytes(s.model, kv_len=32)


def tokens(session):
    return session.engine.generate([5, 9, 14, 3], max_new_tokens=6).tokens


def test_no_budget_on_cpu_means_no_placement(tiny_dir):
    s = build(str(tiny_dir), RUNTIME, ORACLE, progress=False)
    assert s.placement is None and not s.model.layers[0].ffn.placed


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["hybrid", "layers"])
def test_budget_places_and_keeps_tokens(tiny_dir, sizes, tmp_path, offload):
    want = tokens(build(str(tiny_dir), RUNTIME, ORACLE, progress=False))
    budget = (sizes.dense + 0.6 * sizes.ffn) / GIB
    cfg = PlacementConfig(vram_budget_gib=budget, offload=offload)
    s = build(str(tiny_dir), RUNTIME, ORACLE, placement=cfg, artifacts_root=tmp_path,
                     progress=False)
    p = s.placement
    assert p is not None and p.mode == offload and p.device_bytes <= cfg.budget_bytes
    assert 0 < sum(p.hot) < 2 * 96 if offload == "hybrid" else p.hot == (96, 0)
    assert tokens(s) == want
    assert (tmp_path / "placement.json").is_file()


def test_budget_below_dense_parts_is_a_clear_error(tiny_dir, sizes, tmp_path):
    cfg = PlacementConfig(vram_budget_gib=(sizes.dense - 1) / GIB)
    with pytest.raises(ValueError, match="vram_budget: expected at least"):
        build(str(tiny_dir), RUNTIME, ORACLE, placement=cfg, artifacts_root=tmp_path,
                     progress=False)


def test_placement_config_validates():
    with pytest.raises(ValueError, match="offload"):
        PlacementConfig(offload="gpu")
    with pytest.raises(ValueError, match="vram_budget"):
        PlacementConfig(vram_budget_gib=-1.0)


def test_bench_json_reports_placement(tiny_dir, sizes, capsys):
    budget = (sizes.dense + 0.3 * sizes.ffn) / GIB
    bench.main(["--model", str(tiny_dir), "--sparsity", "oracle", "--prompt-tokens", "4",
                "--new-tokens", "3", "--repeats", "1", "--max-seq-len", "32",
                "--vram-budget", repr(budget), "--json"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    p = row["placement"]
    assert p["mode"] == "hybrid" and len(p["hot_fraction"]) == 2
    assert p["device_bytes"] + p["host_bytes"] == sizes.total
    assert p["device_bytes"] <= int(budget * GIB)
    assert_close(sum(h * 96 for h in p["hot_fraction"]),
                 (p["device_bytes"] - sizes.dense) / sizes.neuron_bytes[0], "hot_bytes")


@pytest.mark.slow
def test_accelerator_path_builds_on_the_host_then_moves_what_stays(tiny_dir, sizes, tmp_path,
                                                                 monkeypatch):
    """The GPU session path, run with the CPU standing in for the accelerator: the default budget
    is read before the model is built, the model is built and placed on the host, then moved."""
    import jax

    from powerinfer_jax.runtime import host, vram_budget

    want = tokens(build(str(tiny_dir), RUNTIME, ORACLE, progress=False))
    calls = []
    budget = sizes.dense + int(0.3 * sizes.ffn)
    monkeypatch.setattr(host, "accelerator", lambda: jax.devices()[0])
    monkeypatch.setattr(vram_budget, "default_budget_bytes", lambda: calls.append(1) or budget)
    moved = []
    real_move = host.to_accelerator
    monkeypatch.setattr(host, "to_accelerator", lambda m, d: (moved.append(d),
                                                              real_move(m, d)))
    s = build(str(tiny_dir), RUNTIME, ORACLE, artifacts_root=tmp_path, progress=False)
    assert calls == [1] and moved == [jax.devices()[0]]  # budget read once, model moved once
    assert s.placement is not None and s.placement.budget_bytes == budget
    assert 0 < sum(s.placement.hot) < 2 * 96
    assert tokens(s) == want
