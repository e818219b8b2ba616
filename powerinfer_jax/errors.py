"""The one error type for failures a user can fix, and the helpers that word them.

Every message follows the project rule "<what>: expected <rule>, got <value> (<hint>)": what is
wrong (a flag, a file, a tensor), the rule it broke, the value it had, and how to fix it. The
CLIs print a `UserError` as one line on stderr and exit with status 2 (`_cli.run_main`); library
callers catch it like the `ValueError` it subclasses.
"""
from __future__ import annotations

from typing import NoReturn


class UserError(ValueError):
    """Bad input or bad state the user can fix: a flag, a prompt, a model file, a cached artifact."""


def fail(what: str, rule: str, value, hint: str = "") -> NoReturn:
    """Raise UserError("<what>: expected <rule>, got <value!r> (<hint>)")."""
    msg = f"{what}: expected {rule}, got {value!r}"
    raise UserError(msg + (f" ({hint})" if hint else ""))


def check(ok: bool, what: str, rule: str, value, hint: str = "") -> None:
    if not ok:
        fail(what, rule, value, hint)


def check_choice(what: str, value, choices, hint: str = "") -> None:
    check(value in choices, what, f"one of {list(choices)}", value, hint)


def check_positive_int(what: str, value, *, maximum: int | None = None) -> int:
    """A positive integer (not a bool), at most `maximum` when given."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    rule = "a positive integer" if maximum is None else f"an integer in [1, {maximum}]"
    check(ok and (maximum is None or value <= maximum), what, rule, value)
    return value


class _Shown(str):
    """Text shown as it is where a message would show a repr."""

    def __repr__(self) -> str:
        return str(self)


def raw(text: str) -> str:
    """A message's "got" written out (`got 100 tokens`), not quoted as a repr."""
    return _Shown(text)


def shown(value, limit: int = 60) -> str:
    """A value of the wrong kind for a message's "got": its type and a bounded repr
    (`got int 123`, `got dict {'a': 1}`)."""
    text = repr(value)
    return _Shown(f"{type(value).__name__} {text if len(text) <= limit else text[:limit] + '...'}")
