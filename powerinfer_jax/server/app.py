"""The HTTP app (FastAPI): OpenAI-compatible completions and chat, models, health and metrics.

Handlers run on the event loop. A generation request is validated (protocol.py), tokenized, checked
against the context, then queued as a Job for the engine thread (worker.py); its text comes back
as events, streamed as server-sent events or gathered into one response. A client that goes away
cancels its job, which frees its slot before the next decode step.

Statuses: 400 bad request (every field error names the field, the rule and the value), 401 a /v1
route without the server's API key (when it has one), 404 unknown route, 405 wrong method, 413
body too large, 429 slots and queue full, 503 loading or shutting down, 500 engine failure (the
request fails with a message; the engine is reset and keeps serving). 499 in the metrics: the
client disconnected.

Access: with an API key (`serve --api-key`, or $POWERINFER_JAX_API_KEY) every /v1 route wants
`Authorization: Bearer <key>`, checked before the body is read; /health and /metrics stay open,
as vLLM leaves them, for load balancers and Prometheus (they say whether the server is ready
and how busy, never a prompt or a completion). A request's `model` is only compared, as a
string, with the names of the one model the server runs: it never opens a path.
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

from powerinfer_jax.config import DEFAULT_MAX_BODY_BYTES, MAX_SEED, SamplingParams
from powerinfer_jax.errors import UserError
from powerinfer_jax.server import protocol as P
from powerinfer_jax.server.metrics import Metrics
from powerinfer_jax.server.offload_metrics import OffloadCollector
from powerinfer_jax.server.worker import (Job, Overloaded, Unavailable, Warmth, Worker,
                                          warm_plan)
from powerinfer_jax.tokenizer import check_text

log = logging.getLogger("powerinfer_jax.server")

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
              "/v1/models": "models", "/health": "health", "/metrics": "metrics"}


class ServerState:
    """What the handlers share: the loaded model (None while loading), its worker and metrics."""

    def __init__(self, loader, *, slots: int, model_name: str | None, queue_size: int,
                 warmup: bool, max_body: int, api_key: str | None = None):
        self.loader = loader
        self.api_key = api_key
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
        """Build the model (the loader), warm the first tier of its steps, start the engine
        thread (/health says 200), then warm the rest beside it (worker.warm_plan)."""
        try:
            session = self.loader() if callable(self.loader) else self.loader
            engine = session.engine
            engine.one_kind = True  # one step per shape for greedy and sampled batches
            self.warmth = Warmth(engine, warm_plan(engine, (engine.kind_of(()),))
                                 if self.warmup else ())
            self.metrics.watch_warmth(self.warmth)
            self.warmth.warm(0, self.warmth.first)
            if not all(engine.stored(k) for k in self.warmth.plan):
                engine.make_compilable()  # before the engine thread runs beside the compiles
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
            return
        try:
            self.warmth.warm(self.warmth.first)
        except Exception:  # a request that needs the step compiles it (or fails with a 500)
            log.exception("warming the remaining compiled steps failed")

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

    def authorize(self, request: Request) -> None:
        """401 unless the request carries `Authorization: Bearer <the API key>` (when the server
        has one). The key given is never echoed."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization")
        scheme, _, token = (header or "").partition(" ")
        if header is None:
            got = "no Authorization header"
        elif scheme.lower() != "bearer" or not token.strip():
            got = "an Authorization header that is not \"Bearer <key>\""
        elif secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            return
        else:
            got = "another key"
        raise P.ApiError(401, f"Authorization: expected \"Bearer <the server's API key>\", got "
                         f"{got}", code="invalid_api_key")

    def count(self, path: str, status: int | str) -> None:
        self.metrics.requests.labels(_ENDPOINTS.get(path, "other"), str(status)).inc()


def create_app(loader, *, slots: int = 1, model_name: str | None = None, queue_size: int = 16,
               warmup: bool = True,
               max_body: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None) -> FastAPI:
    """The server's ASGI app. loader: a built Session (runtime.session.build), or a callable
    returning one, run in a thread at start-up while /health answers 503. slots: the Session's
    max_batch (shown before it is built). warmup: compile (or load) every prefill and decode
    step a request can need, the short prompts' before /health answers 200 and the rest beside
    the engine (worker.warm_plan); without it steps compile when a request first needs them.
    max_body: bytes a request body may have (more: 413). api_key: the key every /v1 route wants
    as `Authorization: Bearer <key>` (None: open; the module docstring says what stays open)."""
    state = ServerState(loader, slots=slots, model_name=model_name, queue_size=queue_size,
                        warmup=bool(warmup), max_body=max_body, api_key=api_key)

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
        retry = max(1, min(60, round(e.retry_after or 1)))
        headers = ({"Retry-After": str(retry)} if e.status in (429, 503) else
                   {"WWW-Authenticate": "Bearer"} if e.status == 401 else None)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        if request.url.path.startswith("/v1"):  # an unknown /v1 route says nothing to a stranger
            try:
                state.authorize(request)
            except P.ApiError as denied:
                return await api_error(request, denied)
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
    async def models(request: Request):
        state.authorize(request)
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
    state.authorize(request)  # before the body is read
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
    _check_warm(state, len(ids), chat)
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
        messages = P.chat_messages(req)
        for i, m in enumerate(messages):
            _check_text(m["content"], f"messages.{i}.content")
        if tok.chat_template is None:
            raise P.ApiError(400, "messages: expected a model with a chat template, got a model "
                             "without one (a base model: send its text to /v1/completions, or "
                             "start the server with --chat-template chatml or a jinja file)",
                             param="messages", code="chat_template")
        try:
            text = tok.apply_chat(messages)
        except Exception as e:  # the model's jinja template refused the conversation
            raise P.ApiError(400, f"messages: expected a conversation the model's chat template "
                             f"accepts, got an error from it: {e}", param="messages",
                             code="chat_template") from None
        return tok.encode(text)
    if isinstance(req.prompt, str):
        return tok.encode(_check_text(req.prompt, "prompt"))
    v = session.config.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < v]
    if bad:
        raise P.ApiError(400, f"prompt: expected token ids in [0, {v}), got {bad[0]}",
                         param="prompt", code="invalid_value")
    return list(req.prompt)


def _check_warm(state: ServerState, n_prompt: int, chat: bool) -> None:
    """503 while the steps this request starts with are still being warmed (the server answers
    /health 200 once short prompts can run; longer ones wait for their tier)."""
    warm = state.warmth
    missing = warm.missing(n_prompt, warm.engine.kind_of(())) if warm is not None else []
    if missing:
        what = "messages" if chat else "prompt"
        eta = warm.eta_s(missing)
        raise P.ApiError(503, f"{what}: the compiled steps for a {n_prompt}-token prompt are "
                         f"being prepared ({warm.ready()} of {len(warm.plan)} steps ready, about "
                         f"{eta:.0f} s to go); retry then", param=what, code="warming",
                         retry_after=eta)


def _check_text(text: str, param: str) -> str:
    """A 400 naming the field for text the tokenizer cannot take (invalid UTF-8 that reached a
    str: JSON's parser refuses most of it first, as invalid JSON)."""
    try:
        return check_text(text, param)
    except UserError as e:
        raise P.ApiError(400, str(e), param=param, code="invalid_value") from None


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
