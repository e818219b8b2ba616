"""Put this folder on PYTHONPATH to run as the GPU machine does, without the compiled extension
(benchmarks/gpu/dry_run_burst.sh): importing powerinfer_jax._pij_ext or _pij_cuda fails."""
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name in ("powerinfer_jax._pij_ext", "powerinfer_jax._pij_cuda"):
            raise ImportError(f"{name} blocked (benchmarks/gpu/noext: no compiled extension)")
        return None


sys.meta_path.insert(0, _Block())
