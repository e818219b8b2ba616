"""A loaded model ready to run: checkpoint + Transformer + tokenizer + engine, built from CLI args."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from powerinfer_jax._cli import DEFAULT_CONTEXT_CAP
from powerinfer_jax.config import ModelConfig, RuntimeConfig, SparsityConfig
from powerinfer_jax.models.transformer import Transformer, from_params
from powerinfer_jax.runtime.decode import Engine


@dataclasses.dataclass
class Session:
    config: ModelConfig
    model: Transformer
    tokenizer: object  # powerinfer_jax.tokenizer.Tokenizer
    runtime: RuntimeConfig
    sparsity: SparsityConfig
    source: str
    _engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            max_len = self.runtime.max_seq_len or min(self.config.max_seq_len, DEFAULT_CONTEXT_CAP)
            self._engine = Engine(self.model, max_seq_len=max_len, sparsity=self.sparsity)
        return self._engine


def open_session(model: str, runtime: RuntimeConfig, sparsity: SparsityConfig) -> Session:
    from powerinfer_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model)
    if runtime.max_seq_len is not None and runtime.max_seq_len > ckpt.config.max_seq_len:
        raise ValueError(f"--max-seq-len: expected at most {ckpt.config.max_seq_len} (the model's "
                         f"context), got {runtime.max_seq_len}")
    dtype = jnp.dtype(runtime.dtype)
    m = from_params(ckpt.config, ckpt.params, dtype=dtype)
    return Session(config=ckpt.config, model=m, tokenizer=ckpt.tokenizer, runtime=runtime,
                   sparsity=sparsity, source=str(ckpt.source))


def configs_from_args(args, **runtime_fields) -> tuple[RuntimeConfig, SparsityConfig]:
    runtime = RuntimeConfig(dtype=args.dtype, threads=args.threads, max_seq_len=args.max_seq_len,
                            **runtime_fields)
    sparsity = SparsityConfig(mode=args.sparsity, threshold=args.threshold)
    return runtime, sparsity
