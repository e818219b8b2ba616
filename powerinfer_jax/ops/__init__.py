"""Custom-call ops (sparse FFN, RMSNorm) and their pure-jnp references."""
from powerinfer_jax.ops.api import rms_norm, set_num_threads, sparse_ffn

__all__ = ["rms_norm", "set_num_threads", "sparse_ffn"]
