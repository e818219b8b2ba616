"""The user's path on a GPU: `runtime.session.build` (the one build every CLI and `pij.load` use)
builds on the host, places hot/cold and moves what stays to the GPU; its greedy tokens must equal
the same model's on the CPU backend. Needs a GPU and the PIJ_CUDA=ON build; skips otherwise (run
benchmarks/gpu/build_and_test.sh on a GPU machine). The CPU stand-in of the same path is
tests/test_runtime_vram_budget.py::test_accelerator_path_builds_on_the_host_then_moves_what_stays."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from helpers_cuda import cuda_device, needs_cuda
from helpers_models import save_hf_llama, write_tiny_gguf


pytestmark = needs_cuda

PROMPT = [5, 9, 14, 3, 22]
GIB = 1 << 30


@pytest.fixture(scope="module")
def relu_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("relu_llama")
    save_hf_llama(d, hidden_act="relu")
    return d


def _session(model, mode, budget_frac, tmp_path, *, cpu=False, monkeypatch=None, **runtime):
    from powerinfer_jax.config import PlacementConfig, RuntimeConfig, SparsityConfig
    from powerinfer_jax.runtime import host, session

    rt = RuntimeConfig(max_seq_len=32, **runtime)
    sp = SparsityConfig(mode=mode)
    if cpu:  # the same build with the CPU backend as the only device
        with monkeypatch.context() as mp, jax.default_device(jax.devices("cpu")[0]):
            mp.setattr(host, "accelerator", lambda: None)
            return session.build(str(model), rt, sp, artifacts_root=tmp_path / "cpu",
                                 progress=False)
    cfg = PlacementConfig()
    if budget_frac is not None:
        cfg = PlacementConfig(vram_budget_gib=_budget_gib(model, rt, sp, budget_frac, tmp_path))
    return session.build(str(model), rt, sp, placement=cfg, artifacts_root=tmp_path / "gpu",
                         progress=False)


def _budget_gib(model, rt, sp, frac, tmp_path) -> float:
    """A budget holding the dense parts and `frac` of the FFN's bytes (sized on a probe build)."""
    from powerinfer_jax.runtime import session
    from powerinfer_jax.sparsity import placement as pl

    probe = session.build(str(model), rt, sp, artifacts_root=tmp_path / "probe", progress=False)
    sizes = pl.model_bytes(probe.model, kv_len=32)
    return (sizes.dense + frac * sizes.ffn) / GIB


def _tokens(s, cpu=False):
    ctx = jax.default_device(jax.devices("cpu")[0]) if cpu else jax.default_device(cuda_device())
    with ctx:
        return s.engine.generate(PROMPT, max_new_tokens=8).tokens


def _platforms(m):
    from flax import nnx

    return {d.platform for a in jax.tree.leaves(nnx.state(m)) for d in a.devices()}


@pytest.mark.parametrize("mode", ["dense", "oracle"])
@pytest.mark.parametrize("budget_frac", [None, 0.3])
def test_gpu_session_tokens_equal_the_cpu_backends(relu_dir, tmp_path, monkeypatch, mode,
                                                   budget_frac):
    want = _tokens(_session(relu_dir, mode, None, tmp_path, cpu=True, monkeypatch=monkeypatch),
                   cpu=True)
    s = _session(relu_dir, mode, budget_frac, tmp_path)
    assert s.placement is not None  # on a GPU every session is placed (default budget or given)
    assert _platforms(s.model) == {"gpu"}  # the model's arrays all moved; cold rows are a handle
    if budget_frac is not None:
        hot = sum(s.placement.hot)
        assert 0 < hot < 2 * 96, s.placement.hot  # some rows hot on the GPU, some cold on the host
        for layer, h in zip(s.model.layers, s.placement.hot):  # cold rows: in the host store
            assert (layer.ffn.cold_handle is None) == (h == 96), (h, layer.ffn.cold_handle)
    assert _tokens(s) == want


def test_gpu_quantized_gguf_dequantizes_and_matches_the_cpu_backend(tmp_path, monkeypatch):
    """On a GPU a quantized file is dequantized at load (placement moves float rows); its tokens
    equal the CPU backend's on the same dequantized weights (--weights dtype there)."""
    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, tensor_types={"layers.0.ffn.up.weight": "Q4_1",
                                        "layers.1.ffn.gate.weight": "Q4_0",
                                        "layers.0.attn.q.weight": "Q8_0"})
    want = _tokens(_session(path, "dense", None, tmp_path, cpu=True, monkeypatch=monkeypatch,
                            weights="dtype"), cpu=True)
    s = _session(path, "dense", 0.5, tmp_path)
    assert _platforms(s.model) == {"gpu"}
    assert _tokens(s) == want


def test_gpu_generate_cli_with_a_budget(relu_dir, tmp_path):
    """`python -m powerinfer_jax.generate` on the GPU with a budget that splits the FFN: exit 0,
    no traceback, a JSON row naming a hybrid placement within the budget."""
    from powerinfer_jax.config import RuntimeConfig, SparsityConfig

    budget = _budget_gib(relu_dir, RuntimeConfig(max_seq_len=32), SparsityConfig(mode="oracle"),
                         0.3, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "powerinfer_jax.generate", "--model", str(relu_dir),
                        "--prompt", "hello world", "--max-new-tokens", "6", "--sparsity", "oracle",
                        "--vram-budget", repr(budget), "--max-seq-len", "32", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["placement"]["mode"] == "hybrid", row
    assert 0 < row["placement"]["device_bytes"] <= int(budget * GIB), row
