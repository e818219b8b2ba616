"""Experts split over two processes (runtime/mesh.py over jax.distributed: two processes on
127.0.0.1, one CPU device each, gloo collectives): the logits equal one process's.

Each process builds the same seeded tiny MoE, shards it over the two-device mesh (heads and
experts, 4 of the 8 experts on each process) and runs one jitted forward; process 0 saves the
logits. The test's own process computes them unsharded."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers_tolerances import assert_close

TESTS = Path(__file__).resolve().parent
CONFIG = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=24,
              n_experts=8, n_experts_used=2, max_seq_len=32)
TOKENS = [[5, 17, 42, 7, 99, 3, 11, 64]]

# one process of the pair: argv = coordinator address, process id, kernels, output .npy
SCRIPT = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
import numpy as np
sys.path.insert(0, {tests!r})
from test_moe_distributed import forward
from powerinfer_jax.runtime import mesh
assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
np.save(sys.argv[4], forward(sys.argv[3], shard=lambda m: mesh.shard_model(m, 2)))
"""


def forward(kernels: str, shard=None) -> np.ndarray:
    """Logits of the seeded tiny MoE (sharded by `shard(model)` first when given)."""
    import jax
    from flax import nnx

    from helpers_models import tiny_llama_config
    from powerinfer_jax.models.transformer import Transformer

    model = Transformer(tiny_llama_config(**CONFIG), rngs=nnx.Rngs(0), kernels=kernels)
    if shard is not None:
        shard(model)
    graphdef, state = nnx.split(model)
    tokens = np.asarray(TOKENS, np.int32)
    logits = jax.jit(lambda st: nnx.merge(graphdef, st)(tokens))(state)
    return np.asarray(logits.addressable_data(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_two_processes_give_one_process_logits(tmp_path, kernels):
    address = f"127.0.0.1:{_free_port()}"
    script = SCRIPT.format(tests=str(TESTS))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", script, address, str(i), kernels,
                               str(tmp_path / f"logits{i}.npy")], env=env, cwd=TESTS.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    want = forward(kernels)
    for i in range(2):  # both processes hold the whole (replicated) logits
        assert_close(np.load(tmp_path / f"logits{i}.npy"), want, "sharded_float32")
