"""Calibration text: the user's files, or the project's default training corpus.

Default: `<repo>/../shared/data/wiki.train.txt` when that folder exists; otherwise the same source
(the shortened enwiki dump that the gensim wheel ships as test data) is fetched from PyPI once,
converted to plain text and cached under `<cache>/corpus/` (through powerinfer_jax.cache: locked,
atomic, verified on reuse). The validation text (wiki.valid.txt) is refused as a training
corpus by its content: a copy, a renamed file, a link or a file containing a passage of it.
"""
from __future__ import annotations

import bz2
import functools
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
    """The concatenated text of `files` (at least one, none empty, never the validation text)."""
    files = [Path(f) for f in files]
    if not files:
        errors.fail("corpus", "at least one text file", "none")
    texts = []
    for f in files:
        if not f.is_file():
            errors.fail("corpus", "an existing file", str(f))
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            errors.fail("corpus", "UTF-8 text files", str(f),
                        f"byte {e.start} is not UTF-8: a binary file?")
        if not text.strip():
            errors.fail("corpus", "non-empty text", str(f), "the file is empty")
        if f.name == VALIDATION_NAME or _holds_validation_text(f, text):
            errors.fail("corpus", "training text", str(f), "it is or holds the validation "
                        f"file's text ({VALIDATION_NAME}): never calibrate or train on the text "
                        "you evaluate on")
        texts.append(text)
    return "\n\n".join(texts)


VALIDATION_SAMPLE_CHARS = 2000  # a passage this long from the validation text gives a copy away


def _holds_validation_text(path: Path, text: str) -> bool:
    """Whether a corpus file is, or contains, the project's validation text: the same file (a
    symlink or hard link), the same bytes under another name, or a passage of it (a copy
    pasted into a larger file). Compared by content, never by name alone."""
    valid = SHARED_DATA / VALIDATION_NAME
    if not valid.is_file():
        return False
    try:
        if path.resolve() == valid.resolve() or path.samefile(valid):
            return True
    except OSError:
        pass
    reference = _validation_text(str(valid))
    if text == reference:
        return True
    middle = len(reference) // 2
    passage = reference[middle:middle + VALIDATION_SAMPLE_CHARS]
    return len(passage) == VALIDATION_SAMPLE_CHARS and passage in text


@functools.lru_cache(maxsize=1)
def _validation_text(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


def corpus_chunks(ids, ctx: int, max_tokens: int | None = None) -> np.ndarray:
    """Non-overlapping [n, ctx] chunks of the token stream, at most max_tokens tokens in all."""
    errors.check(ctx >= 2, "ctx", "an integer >= 2", ctx)
    n = len(ids) // ctx
    errors.check(n > 0, "corpus", f"at least one context of {ctx} tokens",
                 errors.raw(f"{len(ids)} tokens"), "pass a longer corpus or a smaller ctx")
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
