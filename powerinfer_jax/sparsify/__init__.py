"""Make a dense model sparse by self-distillation: `python -m powerinfer_jax.sparsify`."""
from powerinfer_jax.sparsify.recipe import VARIANTS, DistillConfig
from powerinfer_jax.sparsify.run import build_artifacts, default_out, distill

__all__ = ["VARIANTS", "DistillConfig", "build_artifacts", "default_out", "distill"]
