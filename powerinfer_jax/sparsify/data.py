"""Training batches: corpus chunks and teacher samples, in an order that is a pure function of
(seed, step), so a resumed run sees exactly the batches an uninterrupted one would have.

Each batch holds `samples_per_batch` teacher-sample sequences and the rest corpus chunks. Corpus
chunks are consumed in a fresh seeded permutation per pass over the corpus (so none repeats before
all were used); samples likewise over their smaller pool.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from powerinfer_jax.errors import fail
from powerinfer_jax.sparsity import corpus as corpus_mod


def corpus_ids(tokenizer, files=None) -> list[int]:
    """Token ids of the training corpus (default: the project's wiki.train.txt). The validation
    file and empty files are refused (sparsity/corpus.py)."""
    files = corpus_mod.default_corpus_files() if files is None else list(files)
    return tokenizer.encode(corpus_mod.read_corpus(files), add_bos=False)


def corpus_chunks(ids, seq_len: int, *, min_chunks: int = 1) -> np.ndarray:
    """Non-overlapping [n, seq_len] chunks; at least `min_chunks` of them, else a clear error."""
    n = len(ids) // seq_len
    if n < min_chunks:
        fail("--corpus", f"at least {min_chunks * seq_len} tokens ({min_chunks} chunk(s) of "
             f"--seq-len {seq_len})", f"{len(ids)} tokens", "pass a longer --corpus or a "
             "smaller --seq-len")
    return np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len)


def _pick(pool_size: int, index: int, seed: int, stream: int) -> int:
    """Element `index` of the concatenation of seeded per-pass permutations of range(pool_size)."""
    epoch, pos = divmod(index, pool_size)
    perm = np.random.default_rng([seed, stream, epoch]).permutation(pool_size)
    return int(perm[pos])


@dataclasses.dataclass
class BatchSource:
    """Deterministic batches [B, T] of corpus chunks and teacher samples."""

    corpus: np.ndarray  # [n_corpus, T] int32
    samples: np.ndarray  # [n_samples, T] int32 (may be empty)
    batch: int
    samples_per_batch: int
    seed: int

    def __post_init__(self):
        if self.samples_per_batch and len(self.samples) == 0:
            fail("teacher samples", "at least one sample for a batch share > 0", 0)
        if self.corpus.ndim != 2 or len(self.corpus) == 0:
            fail("corpus chunks", "a non-empty [n, seq_len] array", self.corpus.shape)

    @property
    def corpus_per_batch(self) -> int:
        return self.batch - self.samples_per_batch

    def indices(self, step: int) -> tuple[list[int], list[int]]:
        """(rows of `corpus`, rows of `samples`) that make up batch `step`, in batch order."""
        c = [_pick(len(self.corpus), step * self.corpus_per_batch + j, self.seed, 0)
             for j in range(self.corpus_per_batch)]
        s = [_pick(len(self.samples), step * self.samples_per_batch + j, self.seed, 1)
             for j in range(self.samples_per_batch)]
        return c, s

    def __call__(self, step: int) -> np.ndarray:
        c, s = self.indices(step)
        return np.concatenate([self.corpus[c], self.samples[s]]).astype(np.int32)

    def corpus_passes(self, steps: int) -> float:
        """How many times the run goes through the corpus in `steps` steps."""
        return steps * self.corpus_per_batch / len(self.corpus)
