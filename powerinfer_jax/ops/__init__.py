"""Custom-call ops (sparse FFN, dense linear, q4 neuron estimates, the q4 FFN, decode attention;
quantized linear, sparse FFN and embedding lookup on GGUF blocks) and their pure-jnp references."""
from powerinfer_jax.ops.api import (decode_attention, linear, linear_many, moe_ffn, q4_scores,
                                    q4_sparse_ffn, qembedding, qlinear, qlinear_many, qsparse_ffn,
                                    set_num_threads, sparse_ffn)

__all__ = ["decode_attention", "linear", "linear_many", "moe_ffn", "q4_scores", "q4_sparse_ffn", "qembedding",
           "qlinear", "qlinear_many", "qsparse_ffn", "set_num_threads", "sparse_ffn"]
