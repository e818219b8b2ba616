"""The GPU tests' shared gate: a GPU backend and the PIJ_CUDA=ON build, else they skip."""
import jax
import pytest


def cuda_device():
    """The first GPU device when jax runs on a GPU and the CUDA module is built, else None."""
    try:
        from powerinfer_jax.ops import _ffi
    except ImportError:
        return None
    if jax.default_backend() != "gpu" or _ffi._pij_cuda is None:
        return None
    return jax.devices()[0]


needs_cuda = pytest.mark.skipif(cuda_device() is None,
                                reason="needs a GPU and the PIJ_CUDA=ON build")
