"""Checkpoint loading: GGUF files, Hugging Face directories and named models -> `Checkpoint`."""
from powerinfer_jax.checkpoint.base import Checkpoint, QuantTensor, expected_shapes
from powerinfer_jax.checkpoint.loader import load_checkpoint
from powerinfer_jax.checkpoint.registry import KNOWN_MODELS, cache_dir, resolve_model

__all__ = ["Checkpoint", "KNOWN_MODELS", "QuantTensor", "cache_dir", "expected_shapes",
           "load_checkpoint", "resolve_model"]
