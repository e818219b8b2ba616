"""Custom-call ops (sparse FFN, dense linear, RMSNorm) and their pure-jnp references."""
from powerinfer_jax.ops.api import linear, rms_norm, set_num_threads, sparse_ffn

__all__ = ["linear", "rms_norm", "set_num_threads", "sparse_ffn"]
