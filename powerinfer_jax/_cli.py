"""Flags and start-up shared by every CLI (generate, evaluate, bench, calibrate, serve).

Imports nothing heavy at module level: `--threads` must pin the process before XLA's CPU client
starts its thread pool (XLA sizes the pool from the CPUs the process may run on). Flags map one to
one onto config fields (config.py holds the defaults and the validation); `build_from_args` is the
one place a parsed command line becomes a built model.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import sys

from powerinfer_jax import _interrupt
from powerinfer_jax._machine import git_commit, machine_info  # noqa: F401  (re-exported)
from powerinfer_jax.config import (DEFAULT_CONTEXT_CAP, DEFAULT_MODEL, DEFAULT_TARGET_SPARSITY,
                                   DTYPES, GATE_UP_SOURCES, IMPLS, KERNELS, MAX_SEED,
                                   NEURON_CACHES, OFFLOADS, WEIGHTS,
                                   PREDICTOR_KINDS, PlacementConfig, RuntimeConfig, SamplingParams,
                                   SparsityConfig, check_threads, sparsity_modes)
from powerinfer_jax.errors import UserError, check, fail
from powerinfer_jax.runtime.session import build


def add_model_flags(p: argparse.ArgumentParser, *, json: bool = True,
                    decode_block: bool = True) -> None:
    """--model, --dtype, --threads, --kernels, --max-seq-len, ...: what every CLI takes (--json
    and --decode-block where the command uses them)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="registry name, .gguf file or Hugging Face directory (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="compute dtype: activations, the KV cache and float weights; a "
                        "quantized GGUF's matrices keep their 4/8-bit blocks unless --weights "
                        "dtype dequantizes them to it (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for XLA and the kernels' pool (default: all available)")
    p.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="who runs the dense matmuls: XLA, or the project's custom calls on the C++ "
                        "thread pool (auto: the custom calls on CPU) (default: %(default)s)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="auto: a quantized GGUF's matrices stay in its block format and the "
                        "kernels compute on them (CPU); dtype: dequantize them to --dtype at load "
                        "(default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"KV cache length (default: min(model context, {DEFAULT_CONTEXT_CAP}))")
    if decode_block:
        p.add_argument("--decode-block", type=int, default=RuntimeConfig.decode_block,
                       metavar="N", help="decode steps per executable call: the call's fixed "
                       "host cost is paid once per N tokens (1: a call per token) (default: "
                       "%(default)s)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="tensor parallel over the first N devices: attention heads and FFN "
                        "neurons split across them (default: one device; on a CPU, "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)")
    p.add_argument("--artifacts", default=None, metavar="DIR",
                   help="sparsity artifacts root, as written by calibrate --out (default: next to "
                        "the model; for a registry model in its cache directory)")
    if json:
        p.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                       help="print one JSON object as the last line of stdout")


def add_sparsity_flags(p: argparse.ArgumentParser, *, predictor_choice: bool = True) -> None:
    """--sparsity and its options, --vram-budget, --offload."""
    p.add_argument("--sparsity", default="dense", choices=sparsity_modes(),
                   help="how the FFN's active neurons are found: dense; oracle (true activations); "
                        "threshold (calibrated |act(gate)|, CATS-style); predictor (see --predictor) "
                        "(default: %(default)s)")
    if predictor_choice:
        p.add_argument("--predictor", default="q4", choices=PREDICTOR_KINDS,
                       help="predictor mode's predictor: q4 (|a_i| estimated from 4-bit gate/up "
                            "rows; default) or lowrank (trained D->R->F MLPs, built by calibrate "
                            "--predictor)")
    p.add_argument("--gate-up", default="full", choices=GATE_UP_SOURCES,
                   help="predictor mode with --predictor q4: where the active neurons' gate/up "
                        "dots come from: full (their rows at --dtype) or q4 (the predictor's own "
                        "4-bit estimate, so only down rows are read at --dtype; for a Q4_1 "
                        "checkpoint these are its own gate/up weights, with 8-bit activations) "
                        "(default: %(default)s)")
    p.add_argument("--predictors", default=None, metavar="GGUF",
                   help="--sparsity powerinfer: read the predictors (blk.i.fc1/fc2, PowerInfer's "
                        "form) from this GGUF, e.g. the *.powerinfer.gguf of the same model, "
                        "instead of the model file")
    p.add_argument("--threshold", type=float, default=0.0,
                   help="oracle: a neuron is active when |a_i| > threshold (default: 0)")
    p.add_argument("--target-sparsity", type=float, default=None,
                   help="calibrated FFN sparsity to run at (threshold/predictor: default "
                        f"{DEFAULT_TARGET_SPARSITY}; oracle: use calibrated per-layer thresholds "
                        "instead of --threshold); artifacts are built by python -m "
                        "powerinfer_jax.calibrate, for the default model on first use")
    p.add_argument("--impl", default="ffi", choices=IMPLS,
                   help="sparse FFN implementation: the compiled custom call or its pure-jnp "
                        "reference (default: %(default)s)")
    p.add_argument("--vram-budget", type=float, default=None, metavar="GIB",
                   help="accelerator memory for the model in GiB (dense parts, KV cache, hot FFN "
                        "rows); default: a GPU's free memory minus a margin; on a CPU-only machine "
                        "no placement unless given (then it is the notional accelerator of the "
                        "CPU hybrid: hot rows through XLA, cold rows through the FFI pool); an "
                        "MoE model places whole experts, the most often routed first")
    p.add_argument("--ram-budget", type=float, default=None, metavar="GIB",
                   help="host memory for the model in GiB (dense parts, KV cache, resident FFN "
                        "neurons; not the process's own runtime): FFN neurons beyond it are read "
                        "per token from a neuron bundle file written once next to the model "
                        "(quantized GGUF; --sparsity dense, oracle or powerinfer); a "
                        "mixture-of-experts model keeps its most routed experts and a cache, "
                        "and reads the other routed experts from an expert file written once "
                        "next to it (--sparsity dense). A model that fits loads as without the "
                        "flag (default: no limit)")
    p.add_argument("--neuron-cache", default="frequency", choices=NEURON_CACHES,
                   help="--ram-budget: eviction policy of the neuron or expert cache's dynamic "
                        "part (score: the router's decayed probabilities, MoE models only) "
                        "(default: %(default)s)")
    p.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                   help="--ram-budget with --sparsity powerinfer: read ahead the neurons the next "
                        "layer's predictor picks on this layer's input; on an MoE model the "
                        "experts the next layer's router picks on it (default: on)")
    p.add_argument("--offload", default="hybrid", choices=OFFLOADS,
                   help="what stays off the accelerator: hybrid (cold FFN neurons, by activation "
                        "frequency) or layers (whole trailing layers, llama.cpp -ngl style) "
                        "(default: %(default)s)")


def add_common_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_sparsity_flags(p)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate, an integer >= 1 (fewer when a stop token or "
                        "--stop text comes first) (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    p.add_argument("--seed", type=int, default=0, help=f"in [0, {MAX_SEED}]")


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="chatml|FILE",
                   help="the chat template for chat on a model that ships none (a base model; "
                        "without one chat is refused) or in place of the model's own: chatml, "
                        "or a jinja file")


def chat_template_from_args(args) -> str | None:
    """--chat-template's text (checked before the model loads), or None."""
    if args.chat_template is None:
        return None
    from powerinfer_jax.tokenizer import resolve_chat_template  # lazy: start-up

    return resolve_chat_template(args.chat_template)


def check_sampling_flags(args) -> None:
    """add_sampling_flags' errors before the model loads (the engine checks each request again)."""
    check(args.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1", args.max_new_tokens)
    SamplingParams(args.temperature, args.top_k, args.top_p)  # checks its fields
    check(0 <= args.seed <= MAX_SEED, "seed", f"an integer in [0, {MAX_SEED}]", args.seed)


def configure_threads(threads: int | None) -> int:
    """Pin the process to `threads` CPUs (before XLA starts) and return the thread count in use."""
    available = sorted(os.sched_getaffinity(0))
    if threads is None:
        return len(available)
    check_threads(threads)  # the API's rule and message (flag_words names the flag)
    os.sched_setaffinity(0, available[:threads])
    return threads


def setup(args) -> int:
    """Pin --threads before anything starts XLA; returns the thread count."""
    return configure_threads(args.threads)


def configs_from_args(args, **runtime_fields) -> tuple[RuntimeConfig, SparsityConfig]:
    runtime = RuntimeConfig(dtype=args.dtype, threads=args.threads, max_seq_len=args.max_seq_len,
                            kernels=args.kernels, weights=args.weights,
                            devices=getattr(args, "devices", None),
                            decode_block=getattr(args, "decode_block", RuntimeConfig.decode_block),
                            **runtime_fields)
    target = args.target_sparsity
    sparsity = SparsityConfig(mode=args.sparsity, threshold=args.threshold, impl=args.impl,
                              predictor=getattr(args, "predictor", "q4"), gate_up=args.gate_up,
                              target_sparsity=None if target is None else float(target),
                              predictor_file=getattr(args, "predictors", None))
    from powerinfer_jax.sparsity import modes  # lazy: start-up (modes import the model code)

    return runtime, modes.with_default_target(sparsity)


def placement_from_args(args) -> PlacementConfig:
    return PlacementConfig(vram_budget_gib=args.vram_budget, offload=args.offload,
                           ram_budget_gib=getattr(args, "ram_budget", None),
                           neuron_cache=getattr(args, "neuron_cache", "frequency"),
                           lookahead=getattr(args, "lookahead", True))


def build_from_args(args, *, progress: bool = True, max_batch: int = 1, **runtime_fields):
    """The parsed command line -> a built model (runtime.session.build)."""
    runtime, sparsity = configs_from_args(args, **runtime_fields)
    return build(args.model, runtime, sparsity, placement=placement_from_args(args),
                 artifacts_root=args.artifacts, max_batch=max_batch, progress=progress)


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of a file a flag names; a missing, unreadable or binary file is a user
    error naming the flag and the file."""
    if not os.path.isfile(path):
        fail(what, "an existing file", path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        fail(what, "a UTF-8 text file", path, f"byte {e.start} is not UTF-8: a binary file?")
    except OSError as e:
        fail(what, "a readable file", path, e.strerror or str(e))


def check_writable(path: str, what: str) -> None:
    """Fail before the work when an output file cannot be written (an existing directory, a
    missing parent), so a long benchmark never loses its result at the end."""
    if os.path.isdir(path):
        fail(what, "a file path to append to", path, "it is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        fail(what, "a file in an existing directory", path, f"create {parent} first")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        fail(what, "a writable file", path)


_HEAD = re.compile(r"^([a-z][a-z0-9_]*)(=[^:]*)?:")
_ASSIGN = re.compile(r"(?<![\w./-])([a-z][a-z0-9_]*)=([^\s,;)]+)")
# parameters whose flag is not their name in kebab case
_FLAG_NAMES = {"predictor_file": "--predictors"}
_NAME = re.compile(r"(?<![\w./-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w/])")


def flag_words(message: str, flags) -> str:
    """A user error in the command line's words: the library names a value after the Python
    API's parameter (target_sparsity, max_seq_len); where the command has the flag
    (--target-sparsity), the message's subject, and every snake_case name in it, become the
    flag. "devices=4: ..." becomes "--devices 4: ..."."""
    def flag(name: str) -> str | None:
        f = _FLAG_NAMES.get(name) or "--" + name.replace("_", "-")
        return f if f in flags else None

    head = _HEAD.match(message)
    if head and flag(head.group(1)):
        value = head.group(2)
        subject = flag(head.group(1)) + (" " + value[1:] if value else "")
        message = subject + message[head.end() - 1:]
    message = _ASSIGN.sub(lambda m: f"{flag(m.group(1))} {m.group(2)}" if flag(m.group(1))
                          else m.group(0), message)
    return _NAME.sub(lambda m: flag(m.group(1)) or m.group(1), message)


def speaks_flags(build_parser):
    """Decorate a CLI's main(argv): its UserErrors name the parser's flags (flag_words), whether
    main runs from the command line or from a test."""
    def decorate(main):
        @functools.wraps(main)
        def wrapped(argv=None):
            try:
                return main(argv)
            except UserError as e:
                flags = {o for a in build_parser()._actions for o in a.option_strings}
                e.args = (flag_words(str(e), flags),) + e.args[1:]
                raise
        return wrapped
    return decorate


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`'s writer


def run_main(main, *, pause_collector: bool = False) -> None:
    """Call main(); a user error (bad flag value, bad file, bad state) prints one line on stderr
    and exits with status 2, Ctrl-C exits with 130, a reader that closed stdout early (`| head`)
    ends the command with 141, all without a traceback. A command that finished exits at once
    (`_exit_now`).

    pause_collector: Python's cycle collector stays off until main calls `resume_collector`
    (a short command, after its start-up). jax's and flax's imports, the load and the build make
    ~1M objects, which set off full collections that traverse all of them: 2 full and ~30
    middle ones in `generate`, 0.1-0.3 s of a run on 2 busy cores (counted with gc.callbacks),
    while start-up leaves little cyclic garbage."""
    global _collector_paused
    if pause_collector:
        gc.disable()
        _collector_paused = True
    try:
        main()
        _exit_now()
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush
        # does not raise again, and stop quietly, as a Unix filter does on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except KeyboardInterrupt:
        # The exception has unwound every finally block and context manager (temp files gone,
        # cache locks released); the interpreter's own teardown is skipped: after an interrupt
        # mid-compile jaxlib's teardown segfaulted (exit -11 instead of 130, seen in CI).
        print("interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(_interrupt.EXIT_INTERRUPTED)


def _exit_now() -> None:
    """End a finished command without the interpreter's teardown: with jax loaded it took
    0.7-1.0 s of a 1-3 s `generate` run here (freeing XLA's executables and client, collecting
    every object), while nothing in it is needed: files are written and closed by then, and the
    streams and logs are flushed here."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def print_json(obj) -> None:
    print(json.dumps(obj), flush=True)


# run_main(..., pause_collector=True) holds the cycle collector off until resume_collector()
_collector_paused = False


def resume_collector() -> None:
    """End run_main's pause of the cycle collector (see run_main), once start-up is over: what
    exists now (modules, the model) moves to the collector's permanent generation, which it never
    traverses (gc.freeze; start-up's few garbage cycles stay unfreed), and it runs again over
    what the command makes from here on. Nothing to do where nothing paused it (a test calling
    main() in its own process)."""
    global _collector_paused
    if _collector_paused:
        _collector_paused = False
        gc.freeze()
        gc.enable()


def process_age() -> float:
    """Seconds since this process started (the kernel's start time, so the interpreter's own
    start-up and imports are included); 0.0 where /proc is not available."""
    import time

    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # clock ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
