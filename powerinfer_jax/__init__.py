"""powerinfer_jax: fast LLM inference in JAX/XLA exploiting FFN activation sparsity."""
from powerinfer_jax import _interrupt

# Before anything imports jax: Ctrl-C must interrupt even when it lands in jax's gc callback,
# where Python would swallow it (see _interrupt.py). Leaves an application's own handler alone.
_interrupt.install()
