"""Calibration text: the user's files, or the project's default training corpus.

Default: `<repo>/../shared/data/wiki.train.txt` when that folder exists; otherwise the same source
(the shortened enwiki dump that the gensim wheel ships as test data) is fetched from PyPI once,
converted to plain text and cached under `<cache>/corpus/` (through powerinfer_jax.cache: locked,
atomic, verified on reuse). The validation file (wiki.valid.txt)
is refused as a training corpus.
"""
from __future__ import annotations

import bz2
import re
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import numpy as np

from powerinfer_jax import _pypi, cache, errors

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VALIDATION_NAME = "wiki.valid.txt"
GENSIM = "gensim==4.4.0"
GENSIM_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
HELD_OUT_ARTICLES = 8  # the dump's last articles are left out of the fallback training text
MIN_LINE_CHARS = 40  # shorter lines are headings, list stubs or table debris


def default_corpus_files() -> list[Path]:
    shared = SHARED_DATA / "wiki.train.txt"
    if shared.is_file():
        return [shared]
    cached = cache.cache_dir() / "corpus" / "wiki.train.txt"
    if cache.check_file(cached) is None:
        return [cached]
    with cache.lock(cached, what="the default corpus"):
        reason = cache.check_file(cached)  # another process may have built it meanwhile
        if reason is not None:
            if cached.exists():
                cache.note(f"cached {cached} is {reason}; building it again")
            _fetch_gensim_text(cached)
    return [cached]


def read_corpus(files) -> str:
    """The concatenated text of `files` (at least one, none empty, never the validation file)."""
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("--corpus: expected at least one text file, got none")
    texts = []
    for f in files:
        if f.name == VALIDATION_NAME:
            raise ValueError(f"--corpus: expected training text, got the validation file {str(f)!r} "
                             "(never calibrate or train on the text you evaluate on)")
        if not f.is_file():
            raise FileNotFoundError(f"--corpus: expected an existing file, got {str(f)!r}")
        text = f.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"--corpus: expected non-empty text, got an empty file {str(f)!r}")
        texts.append(text)
    return "\n\n".join(texts)


def corpus_chunks(ids, ctx: int, max_tokens: int | None = None) -> np.ndarray:
    """Non-overlapping [n, ctx] chunks of the token stream, at most max_tokens tokens in all."""
    if ctx < 2:
        raise ValueError(f"ctx: expected an integer >= 2, got {ctx}")
    n = len(ids) // ctx
    if n == 0:
        raise ValueError(f"corpus: expected at least one context of {ctx} tokens, got {len(ids)} "
                         "tokens (pass a longer --corpus or a smaller --ctx)")
    if max_tokens is not None:
        n = max(1, min(n, max_tokens // ctx))
    return np.asarray(ids[: n * ctx], np.int32).reshape(n, ctx)


def wiki_xml_to_text(xml_bytes: bytes, *, skip_last: int = 0) -> str:
    """Plain text of a MediaWiki XML dump: one `= Title =` line, then the article's prose lines."""
    root = ElementTree.fromstring(xml_bytes)
    pages = [el for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "page"]
    articles = []
    for page in pages[: len(pages) - skip_last if skip_last else None]:
        title = text = None
        for el in page.iter():
            tag = el.tag.rsplit("}", 1)[-1]
            if tag == "title":
                title = el.text
            elif tag == "text":
                text = el.text
        if title and text and not text.lstrip().lower().startswith("#redirect"):
            body = strip_wiki_markup(text)
            if body:
                articles.append(f"= {title} =\n{body}")
    return "\n\n".join(articles) + "\n"


def strip_wiki_markup(text: str) -> str:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>|<ref.*?</ref>", "", text, flags=re.S)
    for _ in range(4):  # nested templates and tables, innermost first
        text = re.sub(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}", "", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]|\[https?://\S+\]", r"\1", text)
    text = re.sub(r"<[^>]+>|'{2,}", "", text)
    lines = [ln.strip() for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if len(ln) >= MIN_LINE_CHARS and not ln.startswith(
        ("=", "|", "!", "{", "}", "*", "#", ":")))


def _fetch_gensim_text(dest: Path) -> None:
    cache.note(f"no {SHARED_DATA / 'wiki.train.txt'}; fetching the default corpus from PyPI "
               f"({GENSIM}, its enwiki test dump) ...")
    with tempfile.TemporaryDirectory(prefix="pij-gensim-") as tmp:
        dump = Path(tmp) / GENSIM_DUMP
        _pypi.fetch_member(GENSIM, GENSIM_DUMP, dump, what="default corpus",
                           hint="Pass --corpus FILE instead")
        try:
            xml = bz2.decompress(dump.read_bytes())
        except (OSError, ValueError, EOFError) as e:
            raise errors.UserError(f"default corpus: expected {GENSIM_DUMP} from {GENSIM} to be "
                                   f"valid bz2, got {type(e).__name__}: {e} (run again, or pass "
                                   "--corpus FILE)") from None
    with cache.atomic_file(dest) as out:
        out.write_text(wiki_xml_to_text(xml, skip_last=HELD_OUT_ARTICLES), encoding="utf-8")
    cache.write_record(dest)
