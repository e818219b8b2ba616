"""Hostile input to the tokenizer and to the CLIs' arguments: hypothesis strategies and checks.

Tokenizer: any text (control characters, long runs, special-token look-alikes, every Unicode
plane except lone surrogates, which are not text a str from a terminal or a UTF-8 file can hold)
through encode / decode / the chat template. The result is token ids in the vocabulary, a
decode that gives the text back, and a rendered conversation; anything else is a finding.

CLIs (generate, evaluate, calibrate, bench, serve, sparsify): argument lists drawn from each
command's own parser (every flag, values of its type and of the wrong type: negative, huge,
NaN, unknown choices, junk paths, unknown flags). `check_cli_args` runs the command's real
`main(argv)` in this process up to the point where it would load a model or start work (that
call is replaced by one that stops the run); what it must give is argparse's usage error
(SystemExit 2), a one-line UserError/ValueError, or reach the load. `check_cli_process` runs
an argument list that must be refused as the real command in a child process and checks exit
status 2 and one line on stderr without a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]

CLIS = {  # command -> module with build_parser / main
    "generate": "powerinfer_jax.generate", "evaluate": "powerinfer_jax.evaluate",
    "calibrate": "powerinfer_jax.calibrate", "bench": "powerinfer_jax.bench",
    "serve": "powerinfer_jax.serve", "sparsify": "powerinfer_jax.sparsify.cli",
}
# where each command's run begins its real work: replaced by a stop in check_cli_args
STOPS = ("powerinfer_jax._cli.build_from_args", "powerinfer_jax._bench_ops.bench_sparse_ffn",
         "powerinfer_jax.server.Server", "powerinfer_jax.sparsify.cli.distill",
         "powerinfer_jax.sparsify.cli.fill_teacher_cache",
         "powerinfer_jax.sparsify.burst_import.main")
PATH_FLAGS = {"--model", "--text", "--out", "--artifacts", "--predictors", "--corpus", "--curve",
              "--eval-text"}
JUNK_PATHS = ["", ".", "/", "missing.gguf", "no/such/dir/x", "/proc/self/status", "..", "-",
              "nul\u00e9.gguf", "a" * 300, "dir/", "smollm2-135m-nope"]


class ReachedWork(Exception):
    """The arguments passed every check: the command would now load a model or start work."""


# ------------------------------------------------------------------------------------ tokenizer
def texts():
    chars = st.characters(exclude_categories=("Cs",))  # no lone surrogates (see the docstring)
    special = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>",
                               "<|im_start|", "\x00", "\ufffd", "\u200b", "\r\n", "\t" * 9,
                               "🙂" * 5, " " * 64, "a" * 500])
    return st.lists(st.text(chars, max_size=40) | special, max_size=6).map("".join)


def messages():
    role = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
    return st.lists(st.fixed_dictionaries({"role": role, "content": texts()}), min_size=1,
                    max_size=3)


def check_tokenizer(tok, text: str, msgs, *, round_trip: bool = True) -> tuple[str, str]:
    """("ok", "") | ("error", one-line message) | ("finding", what went wrong). round_trip:
    decode(encode(text)) must give the text back: true of a byte-level BPE whose vocabulary
    holds all 256 bytes (the tests' tiny one), not of every real vocabulary (SmolLM2's lacks
    some control bytes, which no tokenizer of it can encode) nor of SentencePiece's leading
    space."""
    try:
        ids = tok.encode(text, add_bos=False)
        if not all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids):
            return "finding", f"ids outside [0, {tok.vocab_size}) for {text[:60]!r}"
        back = tok.decode(ids)
        if round_trip and back != text:
            return "finding", f"decode(encode(text)) != text for {text[:60]!r}: {back[:60]!r}"
        rendered = tok.apply_chat(msgs)
        if not isinstance(rendered, str):
            return "finding", f"apply_chat gave {type(rendered).__name__}"
        tok.encode(rendered)
        return "ok", ""
    except ValueError as e:
        msg = str(e)
        if msg and "\n" not in msg:
            return "error", msg
        return "finding", f"{type(e).__name__} of {msg.count(chr(10)) + 1} lines: {msg[:200]}"
    except Exception as e:  # noqa: BLE001 (what the fuzzer looks for)
        return "finding", f"{type(e).__name__}: {str(e)[:200]}"


# ------------------------------------------------------------------------------------ CLIs
def _parser(cli: str) -> argparse.ArgumentParser:
    return importlib.import_module(CLIS[cli]).build_parser()


_NUM_TEXT = ["nan", "inf", "-inf", "1e309", "-0", "0x10", "1_000", "", " 3", "3.5", "١٢"]


def _value(action: argparse.Action):
    """A strategy of the text a user might give this option."""
    flag = max(action.option_strings, key=len)
    if flag in PATH_FLAGS:
        return st.sampled_from(JUNK_PATHS)
    if action.choices:
        return st.sampled_from([str(c) for c in action.choices]) | st.text(max_size=8)
    if action.type is int:
        return (st.integers(-3, 4) | st.integers(-2 ** 70, 2 ** 70)).map(str) \
            | st.sampled_from(_NUM_TEXT)
    if action.type is float:
        return (st.floats(allow_nan=True, allow_infinity=True) | st.floats(-2, 2)).map(repr) \
            | st.sampled_from(_NUM_TEXT)
    if flag == "--host":
        return st.sampled_from(["127.0.0.1", "localhost", "::1", "", "not a host"])
    if action.type is not None and callable(action.type):  # e.g. sparsify's parse_stages
        return st.text(max_size=12) | st.sampled_from(["0:1e-3", "1:2,3:4", "a:b", "1:", ":"])
    return st.text(max_size=20)


def argv(cli: str):
    """A strategy of argument lists for `cli` built from its parser."""
    options = [a for a in _parser(cli)._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]

    def one(action):
        flag = st.sampled_from(action.option_strings)
        if action.nargs == 0:  # store_true / BooleanOptionalAction's --x / --no-x
            return st.tuples(flag)
        if action.nargs in ("+", "*"):
            return st.tuples(flag).flatmap(lambda f: st.lists(_value(action), min_size=0,
                                                              max_size=2).map(lambda v: f + tuple(v)))
        return st.tuples(flag, _value(action))

    known = st.sampled_from(options).flatmap(one)
    unknown = st.tuples(st.sampled_from(["--nope", "-x", "--model=", "--", "extra"]))
    items = st.lists(known | known | known | unknown, max_size=6)
    # generate needs --prompt; give it mostly
    # (and evaluate --text), so that the checks after parsing are reached
    base = st.just({"generate": ("--prompt", "hi"),
                    "evaluate": ("--text", str(REPO / "README.md"))}.get(cli, ()))
    return st.tuples(base, items).map(lambda t: [*t[0], *(x for item in t[1] for x in item)])


@contextlib.contextmanager
def _stopped_before_work():
    def stop(*args, **kwargs):
        raise ReachedWork()

    with contextlib.ExitStack() as stack:
        for target in STOPS:
            try:
                stack.enter_context(mock.patch(target, stop))
            except (ImportError, AttributeError):  # a command this version does not have
                continue
        stack.enter_context(mock.patch("os.sched_setaffinity", lambda *a: None))
        yield


def check_cli_args(cli: str, args: list[str]) -> tuple[str, str]:
    """Run `cli`'s main(args) in this process until it would load or work.
    ("ok", "reached the load") | ("error", message) | ("finding", what went wrong)."""
    module = importlib.import_module(CLIS[cli])
    err = io.StringIO()
    try:
        with _stopped_before_work(), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            module.main(list(args))
        return "finding", "main returned without reaching the load"
    except ReachedWork:
        return "ok", "reached the load"
    except SystemExit as e:  # argparse: usage and "error: ..." on stderr, status 2
        if e.code == 2 and "error:" in err.getvalue():
            return "error", err.getvalue().strip().splitlines()[-1]
        if e.code == 0 and args and any(a in ("-h", "--help") for a in args):
            return "ok", "help"
        return "finding", f"SystemExit({e.code!r}) with stderr {err.getvalue()[-200:]!r}"
    except (ValueError, FileNotFoundError) as e:  # what run_main prints as one line
        msg = str(e)
        if msg and "\n" not in msg:
            return "error", msg
        return "finding", f"{type(e).__name__} of {msg.count(chr(10)) + 1} lines: {msg[:200]}"
    except Exception as e:  # noqa: BLE001 (what the fuzzer looks for)
        return "finding", f"{type(e).__name__}: {str(e)[:200]}"


def check_cli_process(cli: str, args: list[str], cwd: Path, timeout: float = 120
                      ) -> tuple[str, str]:
    """The real command with arguments it must refuse: exit 2, one line, no traceback.
    ("error", the line) | ("finding", what went wrong) | ("hang", "")."""
    module = CLIS[cli].removesuffix(".cli")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    try:
        r = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang", f"{cli} {args!r}: no exit after {timeout} s"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if "Traceback" in r.stderr or r.returncode != 2 or not lines:
        return "finding", f"{cli} {args!r}: exit {r.returncode}, stderr {r.stderr[-300:]!r}"
    return "error", lines[-1]
