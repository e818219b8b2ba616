"""What the synthetic generators share: the text a model is calibrated and verified on (the
project's corpus, ../shared/data/wiki.train.txt, and its held-out wiki.valid.txt, through the
default model's tokenizer, SmolLM2's, whose vocabulary llama.cpp and PowerInfer both read), and
their shape flags."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from powerinfer_jax.checkpoint import resolve_model
from powerinfer_jax.checkpoint.gguf import _open, read_metadata
from powerinfer_jax.errors import fail
from powerinfer_jax.sparsity.corpus import (SHARED_DATA, VALIDATION_NAME, default_corpus_files,
                                            read_corpus)
from powerinfer_jax.tokenizer import Tokenizer

CALIB_SEQ = 256  # tokens per calibration / verification sequence
TOKENIZER_MODEL = "smollm2-135m"


def load_tokenizer(name: str = TOKENIZER_MODEL) -> tuple[Tokenizer, Path]:
    """(the tokenizer, the GGUF it came from) of a registry name or GGUF path."""
    path = Path(resolve_model(name))
    return Tokenizer.from_gguf_metadata(read_metadata(_open(path))), path


def token_ids(text_path: Path, tokenizer, n: int, what: str) -> np.ndarray:
    """[n // CALIB_SEQ, CALIB_SEQ] token ids of the file's text."""
    if n < CALIB_SEQ or n % CALIB_SEQ:
        fail(what, f"a positive multiple of {CALIB_SEQ}", n)
    ids = tokenizer.encode(text_path.read_text(encoding="utf-8"), add_bos=False)
    if len(ids) < n:
        fail(what, f"at most the {len(ids)} tokens of {text_path}", n)
    return np.asarray(ids[:n], np.int32).reshape(-1, CALIB_SEQ)


def calibration_file(path: str | None) -> Path:
    """The training text (default: the project's corpus), checked by the corpus rules (an
    existing, non-empty, non-validation file)."""
    calib = Path(path) if path else default_corpus_files()[0]
    read_corpus([calib])
    return calib


def calibration_and_held_out(args, tokenizer) -> tuple[np.ndarray, np.ndarray | None]:
    """A generator's token ids from its flags: the calibration text's (--calib-text,
    --calib-tokens) and the held-out text's (--verify-tokens; None for 0)."""
    calib = token_ids(calibration_file(args.calib_text), tokenizer, args.calib_tokens,
                      "--calib-tokens")
    held = (token_ids(eval_file(), tokenizer, args.verify_tokens, "--verify-tokens")
            if args.verify_tokens else None)
    return calib, held


def eval_file() -> Path:
    """The held-out text the engine measures a built model on."""
    path = SHARED_DATA / VALIDATION_NAME
    if not path.is_file():
        fail("--verify-tokens", "0 without the held-out text", str(path),
             "pass --verify-tokens 0, or run where ../shared/data/wiki.valid.txt exists")
    return path


def add_shape_flags(p: argparse.ArgumentParser, shapes: dict, fields: tuple[str, ...],
                    default: str) -> None:
    """--shape (a name of `shapes`) and one int flag per field that overrides it."""
    p.add_argument("--shape", default=default, choices=sorted(shapes),
                   help="a named shape; --d-model etc. override its fields")
    for name in fields:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)


def shape_fields(args, shapes: dict, fields: tuple[str, ...]) -> dict:
    """The named shape's fields with the flags given on the command line."""
    out = dict(shapes[args.shape])
    out.update({k: getattr(args, k) for k in fields if getattr(args, k) is not None})
    return out
