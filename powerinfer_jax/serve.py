"""An OpenAI-compatible HTTP server with continuous batching.

    python -m powerinfer_jax.serve --model smollm2-135m --dtype bfloat16 --threads 2 --parallel 8

Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI's request and response shapes,
server-sent events with "stream": true, llama-server's `timings`), GET /v1/models, GET /health
(503 while the model loads, then 200) and GET /metrics (Prometheus). --parallel sequences share
each decode step; up to --queue more wait for a slot, beyond that requests get 429. SIGINT/SIGTERM:
queued requests get 503, running ones --shutdown-grace seconds to finish, then the server exits.
--api-key (or $POWERINFER_JAX_API_KEY) makes every /v1 route want `Authorization: Bearer <key>`
(401 otherwise; /health and /metrics stay open); a body over --max-body-bytes gets 413.
The app lives in powerinfer_jax/server/.
"""
from __future__ import annotations

import argparse
import logging
import os

from powerinfer_jax import _cli
from powerinfer_jax.config import DEFAULT_MAX_BODY_BYTES
from powerinfer_jax.errors import check_positive_int, fail, raw

API_KEY_ENV = "POWERINFER_JAX_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # no --json (the server prints no result) and no --decode-block (it steps one token a call)
    _cli.add_model_flags(p, json=False, decode_block=False)
    _cli.add_sparsity_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="(default: %(default)s)")
    p.add_argument("--parallel", type=int, default=4,
                   help="sequence slots decoded together (the engine's max_batch; each holds a "
                        "KV cache of --max-seq-len) (default: %(default)s)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a free slot; more get 429 (default: "
                        "%(default)s)")
    p.add_argument("--alias", default=None,
                   help="the model's name in the API (default: --model as given)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the key every /v1 request must send as `Authorization: Bearer KEY` "
                        f"(401 otherwise; /health and /metrics stay open) (default: "
                        f"${API_KEY_ENV} where set, else none: open to whoever reaches the "
                        f"port). The variable keeps the key out of the process list")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="bytes a request body may have; more get 413 (default: %(default)s)")
    _cli.add_chat_template_flag(p)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile (or load, when an earlier start compiled them) the prefill "
                        "step of every prompt-length bucket and the decode step of every batch "
                        "size and cache-length bucket: those of short prompts before /health "
                        "answers 200, the rest beside the running server (a request whose "
                        "steps are not ready yet gets 503 with Retry-After), so that no request "
                        "waits for a compile (default: on)")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds running requests may take to finish before "
                        "they are cancelled (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def api_key_from(flag: str | None, env: str | None) -> str | None:
    """The server's API key: --api-key, else $POWERINFER_JAX_API_KEY, else None (open). A key is
    printable ASCII without spaces, as a Bearer token travels."""
    key, what = (flag, "--api-key") if flag is not None else (env, API_KEY_ENV)
    if key is None:
        return None
    if not key or not all("!" <= c <= "~" for c in key):
        fail(what, "a non-empty key of printable ASCII without spaces",
             raw(f"{len(key)} characters" + (" (not all printable ASCII)" if key else "")))
    return key


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@_cli.speaks_flags(build_parser)
def main(argv=None) -> None:
    args = parse_args(argv)
    check_positive_int("--parallel", args.parallel, maximum=256)
    if not isinstance(args.queue, int) or args.queue < 0:
        fail("--queue", "an integer >= 0", args.queue)
    if not 0 < args.port < 65536:
        fail("--port", "an integer in [1, 65535]", args.port)
    if args.shutdown_grace < 0:
        fail("--shutdown-grace", "seconds >= 0", args.shutdown_grace)
    check_positive_int("--max-body-bytes", args.max_body_bytes)
    api_key = api_key_from(args.api_key, os.environ.get(API_KEY_ENV))
    template = _cli.chat_template_from_args(args)
    _cli.setup(args)  # pin --threads before anything starts XLA
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")

    from powerinfer_jax.server import Server, create_app  # lazy: start-up (serve CLI)

    def load():
        session = _cli.build_from_args(args, max_batch=args.parallel)
        if template is not None:
            session.tokenizer.chat_template = template
        return session

    app = create_app(load, slots=args.parallel, model_name=args.alias, queue_size=args.queue,
                     warmup=args.warmup,
                     max_body=args.max_body_bytes, api_key=api_key)
    Server(app, host=args.host, port=args.port, grace_s=args.shutdown_grace,
           log_level=args.log_level).run()
    if app.state.pij.load_error is not None:  # a bad --model: one line on stderr, status 2
        raise app.state.pij.load_error


if __name__ == "__main__":
    _cli.run_main(main)
