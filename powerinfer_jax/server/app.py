"""The HTTP app (FastAPI): OpenAI-compatible completions and chat, models, health and metrics.

Handlers run on the event loop. A generation request is validated (protocol.py), tokenized, checked
against the context, then queued as a Job for the engine thread (worker.py); its text comes back
as events, streamed as server-sent events or gathered into one response. A client that goes away
cancels its job, which frees its slot before the next decode step.

Statuses: 400 bad request (every field error names the field, the rule and the value), 404 unknown
route, 405 wrong method, 413 body too large, 429 slots and queue full, 503 loading or shutting
down, 500 engine failure (the request fails with a message; the engine is reset and keeps
serving). 499 in the metrics: the client disconnected.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from powerinfer_jax.config import MAX_SEED, SamplingParams
from powerinfer_jax.server import protocol as P
from powerinfer_jax.server.metrics import Metrics
from powerinfer_jax.server.offload_metrics import OffloadCollector
from powerinfer_jax.server.worker import (Job, Overloaded, Unavailable, Warmth, Worker,
                                          warm_plan)

log = logging.getLogger("powerinfer_jax.server")

DEFAULT_MAX_BODY = 4 << 20  # bytes of a request body (a prompt of ~1M tokens is past any context)
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
              "/v1/models": "models", "/health": "health", "/metrics": "metrics"}


class ServerState:
    """What the handlers share: the loaded model (None while loading), its worker and metrics."""

    def __init__(self, loader, *, slots: int, model_name: str | None, queue_size: int,
                 warmup: tuple[str, ...], max_body: int):
        self.loader = loader
        self.metrics = Metrics(slots)
        self.model_name = model_name
        self.queue_size = queue_size
        self.warmup = warmup
        self.max_body = max_body
        self.session = None
        self.worker: Worker | None = None
        self.warmth: Warmth | None = None  # set once the model is built, before warming
        self.load_error: BaseException | None = None
        self.stop_server: Callable[[], None] | None = None  # set by runner.Server
        self.names: set[str] = set()

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        """Build the model (the loader), warm it up and start the engine thread."""
        try:
            session = self.loader() if callable(self.loader) else self.loader
            engine = session.engine
            self.warmth = Warmth(engine, warm_plan(engine, self.warmup) if self.warmup else ())
            self.metrics.watch_warmth(self.warmth)
            self.warmth.warm()
            arg = str(session.model_arg)
            self.model_name = self.model_name or arg
            self.names = {self.model_name, arg, Path(arg).name}
            if getattr(session, "offload", None) is not None and session.offload.store:
                self.metrics.registry.register(OffloadCollector(session.offload))
            worker = Worker(engine, self.metrics, queue_size=self.queue_size)
            worker.start()
            self.metrics.slots_total.set(engine.max_batch)
            self.worker, self.session = worker, session
            log.info("model %s ready: %d slots, queue %d", self.model_name, engine.max_batch,
                     self.queue_size)
        except BaseException as e:  # reported by /health and by the CLI, which then exits
            self.load_error = e
            log.error("loading the model failed: %s", e)
            if self.stop_server is not None:
                self.stop_server()

    def begin_shutdown(self, grace_s: float) -> None:
        if self.worker is not None:
            self.worker.shutdown(grace_s)

    def ready(self):
        if self.session is None:
            if self.load_error is not None:
                raise P.ApiError(503, f"the model failed to load: {self.load_error}",
                                 code="load_failed")
            warm = self.warmth
            doing = ("loading" if warm is None else
                     f"warming its compiled steps: {warm.ready()} of {len(warm.plan)} ready")
            raise P.ApiError(503, f"the model is {doing}; retry when GET /health answers 200",
                             code="loading")
        return self.session

    def count(self, path: str, status: int | str) -> None:
        self.metrics.requests.labels(_ENDPOINTS.get(path, "other"), str(status)).inc()


def create_app(loader, *, slots: int = 1, model_name: str | None = None, queue_size: int = 16,
               warmup: tuple[str, ...] = ("greedy", "sample"),
               max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The server's ASGI app. loader: a built Session (runtime.session.build), or a callable
    returning one, run in a thread at start-up while /health answers 503. slots: the Session's
    max_batch (shown before it is built). warmup: the sampling kinds whose every prefill and
    decode step is compiled (or loaded) before /health answers 200 (worker.warm_plan)."""
    state = ServerState(loader, slots=slots, model_name=model_name, queue_size=queue_size,
                        warmup=tuple(warmup), max_body=max_body)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loading = threading.Thread(target=state.load, name="pij-load", daemon=True)
        loading.start()
        yield
        state.begin_shutdown(0.0)
        if state.worker is not None:
            await asyncio.to_thread(state.worker.join, 30.0)

    app = FastAPI(title="powerinfer_jax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pij = state

    # ------------------------------------------------------------------ errors
    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        state.count(request.url.path, e.status)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        msg = (f"route: expected one of {sorted(_ENDPOINTS)}, got {request.url.path!r}"
               if e.status_code == 404 else
               f"method: expected another method for {request.url.path}, got {request.method}"
               if e.status_code == 405 else str(e.detail))
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        return await api_error(request, P.ApiError(e.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return await api_error(request, P.ApiError(500, f"internal error: {type(e).__name__}: "
                                                        f"{e}"))

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        state.ready()
        w = state.worker
        state.count("/health", 200)
        return {"status": "ok", "slots_idle": w.engine.max_batch - w.busy,
                "slots_processing": w.busy, "queued": w.waiting,
                "warm": state.warmth.describe()}

    @app.get("/metrics")
    async def metrics():
        state.count("/metrics", 200)
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        s = state.ready()
        state.count("/v1/models", 200)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": 0, "owned_by": "powerinfer_jax",
            "meta": {k: v for k, v in s.describe().items() if k != "placement"}}]}

    @app.post("/v1/completions", openapi_extra=P.openapi_body(P.CompletionRequest))
    async def completions(request: Request):
        return await _guarded(_generate(state, request, chat=False))

    @app.post("/v1/chat/completions", openapi_extra=P.openapi_body(P.ChatRequest))
    async def chat(request: Request):
        return await _guarded(_generate(state, request, chat=True))

    return app


# ---------------------------------------------------------------------------- generation
async def _guarded(handler):
    """A handler's response; a bug in it becomes a 500 ApiError with a message (Starlette's
    catch-all handler would answer too, but then re-raise into the server's log as a crash)."""
    try:
        return await handler
    except (P.ApiError, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("internal error")
        raise P.ApiError(500, f"internal error: {type(e).__name__}: {e}",
                         code="internal_error") from None


async def _generate(state: ServerState, request: Request, *, chat: bool):
    arrived = time.perf_counter()
    path = request.url.path
    try:
        raw = await _read_body(request, state.max_body)
    except ClientDisconnect:
        state.count(path, 499)
        return Response(status_code=499)
    req = P.parse(P.ChatRequest if chat else P.CompletionRequest, raw)
    session = state.ready()
    if req.model not in state.names:
        raise P.ApiError(400, f"model: expected {state.model_name!r} (the model this server "
                         f"runs), got {req.model!r}", param="model", code="model_not_found")
    s = P.sampling(req)
    ids = await run_in_threadpool(_prompt_ids, session, req, chat)
    max_tokens = _max_tokens(session.engine, req, len(ids), chat)
    job = Job(session.tokenizer, ids, max_tokens=max_tokens,
              sampling=_sampling_params(s), stream=s.stream,
              seed=secrets.randbelow(MAX_SEED + 1) if s.seed is None else s.seed, stop=s.stop,
              ignore_eos=s.ignore_eos)
    try:
        state.worker.submit(job)
    except Overloaded as e:
        raise P.ApiError(429, str(e), code="overloaded") from None
    except Unavailable as e:
        raise P.ApiError(503, str(e), code="shutting_down") from None
    reply = P.Reply(chat, state.model_name)
    watch = asyncio.ensure_future(_disconnected(request))
    if s.stream:
        end = {"status": 499}  # set to 200 (or an engine error's status) by the stream

        def cleanup():
            watch.cancel()
            state.worker.cancel(job)  # a no-op for a finished job; frees the slot otherwise
            state.count(path, end["status"])
            if end["status"] == 200:
                state.metrics.latency.labels(_ENDPOINTS[path]).observe(
                    time.perf_counter() - arrived)

        return _EventStream(_stream(job, reply, s, watch, end), cleanup)
    try:
        while True:
            ev = await _next(job, watch)
            if ev is None:
                state.count(path, 499)
                return Response(status_code=499)
            if ev[0] == "error":
                raise P.ApiError(ev[1], ev[2], code="engine_error" if ev[1] == 500 else None)
            if ev[0] == "done":
                state.count(path, 200)
                state.metrics.latency.labels(_ENDPOINTS[path]).observe(
                    time.perf_counter() - arrived)
                return JSONResponse(reply.whole(ev[1]))
    finally:
        watch.cancel()
        state.worker.cancel(job)  # a no-op for a finished job; frees the slot otherwise


class _EventStream(StreamingResponse):
    """Server-sent events whose cleanup runs however the response ends: completed, the client
    gone mid-stream, or cancelled before the first chunk (when the generator never starts)."""

    def __init__(self, events, cleanup: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _stream(job, reply, s: P.Sampling, watch, end: dict):
    held = None  # an event read ahead while merging text pieces
    if reply.chat:
        yield _sse(reply.chunk(first=True))
    while True:
        ev, held = (held, None) if held is not None else (await _next(job, watch), None)
        if ev is None:  # the client went away
            return
        if ev[0] == "text":
            text = ev[1]
            while held is None and not job.events.empty():  # a slow reader: merge pieces
                nxt = job.events.get_nowait()
                if nxt[0] == "text":
                    text += nxt[1]
                else:
                    held = nxt
            yield _sse(reply.chunk(text))
            continue
        if ev[0] == "done":
            yield _sse(reply.chunk(outcome=ev[1]))
            if s.include_usage:
                yield _sse(reply.usage_chunk(ev[1]))
            end["status"] = 200
        else:  # the headers are sent: the error goes in the stream, as OpenAI does
            end["status"] = ev[1]
            yield _sse(P.ApiError(ev[1], ev[2]).body())
        yield "data: [DONE]\n\n"
        return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _next(job: Job, watch: asyncio.Future):
    """The job's next event, or None when the client disconnected first."""
    if not job.events.empty():
        return job.events.get_nowait()
    get = asyncio.ensure_future(job.events.get())
    try:
        done, _ = await asyncio.wait((get, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine is cancelled (the client gone mid-stream): a pending
        if not get.done():  # task dropped unfinished is logged as "Task was destroyed"
            get.cancel()
    if get in done:
        return get.result()
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise P.ApiError(413, f"body: expected at most {limit} bytes, got {declared}",
                         param="body", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.ApiError(413, f"body: expected at most {limit} bytes, got more",
                             param="body", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_ids(session, req, chat: bool) -> list[int]:
    tok = session.tokenizer
    if chat:
        try:
            text = tok.apply_chat(P.chat_messages(req))
        except Exception as e:  # the model's jinja template refused the conversation
            raise P.ApiError(400, f"messages: expected a conversation the model's chat template "
                             f"accepts, got an error from it: {e}", param="messages",
                             code="chat_template") from None
        return tok.encode(text)
    if isinstance(req.prompt, str):
        return tok.encode(req.prompt)
    v = session.config.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < v]
    if bad:
        raise P.ApiError(400, f"prompt: expected token ids in [0, {v}), got {bad[0]}",
                         param="prompt", code="invalid_value")
    return list(req.prompt)


def _max_tokens(engine, req, n_prompt: int, chat: bool) -> int:
    """The request's max_tokens (defaults: 16 for completions, the rest of the context for chat),
    checked with the prompt against the context."""
    what = "messages" if chat else "prompt"
    # max_completion_tokens is a chat field; on a completions request it is an unknown extra
    # (kept unvalidated by extra="allow"), never a number to trust
    asked = req.max_tokens if req.max_tokens is not None or not chat else \
        req.max_completion_tokens
    ctx = engine.max_seq_len
    room = ctx - n_prompt
    if n_prompt == 0:
        raise P.ApiError(400, f"{what}: expected at least one token, got none", param=what,
                         code="invalid_value")
    if room < 1:
        raise P.ApiError(400, f"{what}: expected fewer than {ctx} tokens (the context length, "
                         f"--max-seq-len), got {n_prompt} tokens", param=what,
                         code="context_length_exceeded")
    n = asked if asked is not None else room if chat else min(P.COMPLETION_DEFAULT_MAX_TOKENS,
                                                              room)
    if n > room:
        raise P.ApiError(400, f"max_tokens: expected at most {room} (the context length {ctx} "
                         f"minus the prompt's {n_prompt} tokens), got {n}", param="max_tokens",
                         code="context_length_exceeded")
    return n


def _sampling_params(s: P.Sampling):
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
