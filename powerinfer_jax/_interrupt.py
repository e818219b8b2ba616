"""Ctrl-C that always interrupts: a SIGINT handler that never raises where Python swallows it.

Root cause (measured: SIGINT sent at 1 s steps into `python -m powerinfer_jax.generate`, 2 of 9
during model load printed "Exception ignored in: <function _xla_gc_callback ...>
KeyboardInterrupt" and the run went on to generate and exit 0): JAX registers a Python function
in `gc.callbacks` (`jax/_src/lib/__init__.py`, `_xla_gc_callback`; jax-ml/jax#18246). Python
runs signal handlers at the next bytecode boundary, and allocation-heavy code (dequantizing,
building the model, tracing) collects garbage all the time, so Ctrl-C often lands on the first
instruction of that callback. An exception raised in a gc callback cannot propagate: CPython
reports it as "unraisable" and carries on. The same holds for `__del__` methods.

Fix: our handler checks where it runs. In ordinary code it raises KeyboardInterrupt, exactly as
Python's default handler does. Inside a gc callback or `__del__` (or an extension module's
initialization, see _EXTENSION_INIT) it raises nothing there and re-delivers the signal
(`_thread.interrupt_main`) a moment later from a helper thread, until it lands in ordinary code.

In the project's CLIs (`python -m powerinfer_jax.X`) `_cli.run_main` turns a KeyboardInterrupt
into one line and status 130. One that comes before run_main (while the CLI module imports jax)
is printed the same way by the excepthook installed here, which then ends the process at once
with status 130 (os._exit: nothing of the half-started program needs tearing down; context
managers and finally blocks have run, so temporary files are gone and cache locks released).
"""
from __future__ import annotations

import _thread
import gc
import os
import signal
import sys
import threading

REDELIVER_S = 0.002  # long enough for a gc callback to return, short against a person's patience


# Frames of an extension module's initialization: a KeyboardInterrupt raised in Python code that
# such an init calls (nanobind's imports) leaves a half-built module, and its deallocation
# crashed in jaxlib (SIGSEGV in nanobind::detail::nb_module_free, seen under gdb, and as exit
# status -11 when Ctrl-C came during `import jax`). The interrupt waits until the init returns.
_EXTENSION_INIT = {"ExtensionFileLoader.create_module", "ExtensionFileLoader.exec_module"}


def _must_wait(frame) -> bool:
    """Whether `frame` or a caller is a gc callback or a __del__ (an exception there is lost), or
    an extension module's initialization (an exception there can crash the process)."""
    codes = set()
    for cb in list(gc.callbacks):
        code = getattr(getattr(cb, "__func__", cb), "__code__", None)
        if code is not None:
            codes.add(code)
    while frame is not None:
        code = frame.f_code
        if (code in codes or code.co_name == "__del__"
                or getattr(code, "co_qualname", "") in _EXTENSION_INIT):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame):
    if _must_wait(frame):
        timer = threading.Timer(REDELIVER_S, _thread.interrupt_main, args=(signum,))
        timer.daemon = True
        timer.start()
        return
    raise KeyboardInterrupt


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        print("interrupted", file=sys.stderr, flush=True)  # as _cli.run_main words it
        try:
            sys.stdout.flush()
        finally:
            os._exit(EXIT_INTERRUPTED)

    hook.pij_interrupt = True
    return hook


def _running_our_cli() -> bool:
    """Whether the process is `python -m powerinfer_jax.<cli>`."""
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("powerinfer_jax.")
               for i, a in enumerate(argv))


def install() -> bool:
    """Use the handler above for SIGINT (and, in our CLIs, the one-line exit); returns whether it
    is in use. Only from the main thread, and only over Python's default handler: a handler the
    application set itself (or SIGINT ignored, as in a background job) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint:
        return True
    if current is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _on_sigint)
    if _running_our_cli() and not getattr(sys.excepthook, "pij_interrupt", False):
        sys.excepthook = _excepthook(sys.excepthook)
    return True
