"""The OpenAI wire format: request bodies (validated with pydantic v2, strict types) and the
response, chunk and error objects the server sends.

Fields follow OpenAI's /v1/completions and /v1/chat/completions; `top_k` and `ignore_eos` are
llama-server's extensions, and responses carry llama-server's `timings` object. Fields this server
cannot honour (logprobs, penalties, n > 1, tools, ...) are accepted only at their no-op values and
otherwise refused with a 400 naming the field, never silently ignored. Unknown fields are ignored,
as clients send many.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from powerinfer_jax.config import MAX_SEED

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request without temperature samples

# Fields we do not implement, with the values that mean "off" (any other value is a 400).
_NO_OP_VALUES: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
             404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, for a 429 or 503's Retry-After (default 1)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Generation(_Strict):
    """What both endpoints take."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None  # 0: off
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Any = None
    ignore_eos: bool | None = None

    @field_validator("n", mode="plain")
    @classmethod
    def _n(cls, v):
        if v is None or (type(v) is int and v == 1):
            return v
        raise ValueError("1 (one choice per request; send several requests for more)")

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if (not isinstance(items, list) or len(items) > MAX_STOP
                or not all(isinstance(s, str) and s for s in items)):
            raise ValueError(f"a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        return items


class CompletionRequest(_Generation):
    prompt: Any

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v):
        """One prompt: text or token ids (a one-element list of either is accepted too)."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str) and v:
            return v
        if (isinstance(v, list) and v
                and all(isinstance(t, int) and not isinstance(t, bool) for t in v)):
            return v
        raise ValueError("one prompt: a non-empty string or a non-empty list of token ids "
                         "(several prompts per request are not supported)")


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # text, or a list of text parts joined
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, v):
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError('a string or a list of text parts ({"type": "text", "text": "..."})')


class ChatRequest(_Generation):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name


def openapi_body(model: type[BaseModel]) -> dict:
    """The OpenAPI `requestBody` of a request model (its JSON schema with the nested models
    written in place), for the routes that read their body themselves: the server's own
    /openapi.json documents what they take, and schema-driven fuzzers generate from it."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref[len("#/$defs/"):]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's generation settings, defaults filled in."""

    temperature: float
    top_k: int
    top_p: float
    seed: int | None  # None: the server draws one
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool


def parse(cls: type[_Generation], raw: bytes) -> _Generation:
    """Validate a JSON body as `cls`, or raise a 400 ApiError naming the first bad field."""
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as e:
        message, param, code = _describe(e.errors(include_url=False)[0])
        raise ApiError(400, message, param=param, code=code) from None
    for name, value in (req.model_extra or {}).items():
        if name in _NO_OP_VALUES and not any(_same(value, ok) for ok in _NO_OP_VALUES[name]):
            raise ApiError(400, f"{name}: expected one of {list(_NO_OP_VALUES[name])} (this "
                           f"server does not implement it), got {_short(value)}", param=name,
                           code="unsupported_parameter")
    return req


def sampling(req: _Generation) -> Sampling:
    opts = req.stream_options
    return Sampling(temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
                    top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                    seed=req.seed, stop=req.stop or [], stream=bool(req.stream),
                    include_usage=bool(opts and opts.include_usage),
                    ignore_eos=bool(req.ignore_eos))


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as the chat template takes them ({"role", "content": str})."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
            for m in req.messages]


def _same(a, b) -> bool:
    """a == b without JSON's true == 1 (0 and 0.0 are the same number)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    return a == b if number(a) and number(b) else type(a) is type(b) and a == b


def _short(value, limit: int = 80) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


def _describe(err: dict) -> tuple[str, str, str]:
    """(message, param, code) of one pydantic error."""
    loc = [str(p) for p in err["loc"]]
    param = ".".join(loc) or "body"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"{param}: expected a value (the field is required), got nothing", param, "missing"
    if err["type"] == "json_invalid":
        return f"body: expected a JSON object, got invalid JSON ({msg})", "body", "invalid_json"
    if err["type"] == "model_type":
        return f"{param}: expected a JSON object, got {_short(err['input'])}", param, "invalid_type"
    ctx = err.get("ctx") or {}
    if err["type"] == "too_short":
        rule = f"at least {ctx.get('min_length')} item(s)"
    elif err["type"] == "too_long":
        rule = f"at most {ctx.get('max_length')} item(s)"
    else:
        rule = msg.removeprefix("Input should be ")
        rule = rule[0].lower() + rule[1:] if rule else rule
    return f"{param}: expected {rule}, got {_short(err['input'])}", param, "invalid_value"


# ---------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timings(outcome) -> dict:
    """llama-server's `timings`: prompt = prefill (and first-time compilation) up to the first
    token, predicted = the tokens after it; queued_ms (ours): waiting for a slot."""
    r = outcome.result
    n = len(r.tokens)
    prompt_s = r.first_token_s
    return {"prompt_n": r.prompt_tokens, "prompt_ms": prompt_s * 1e3,
            "prompt_per_token_ms": prompt_s * 1e3 / max(r.prompt_tokens, 1),
            "prompt_per_second": r.prompt_tokens / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": n, "predicted_ms": r.decode_s * 1e3,
            "predicted_per_token_ms": r.decode_s * 1e3 / (n - 1) if n > 1 else 0.0,
            "predicted_per_second": r.decode_tok_s, "queued_ms": outcome.queued_s * 1e3}


class Reply:
    """Builds one request's response objects (completion or chat, whole or chunked)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _obj(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def whole(self, outcome) -> dict:
        r = outcome.result
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text},
                      "logprobs": None, "finish_reason": outcome.finish_reason}
        else:
            choice = {"index": 0, "text": outcome.text, "logprobs": None,
                      "finish_reason": outcome.finish_reason}
        body = self._obj("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(r.prompt_tokens, len(r.tokens))
        body["timings"] = timings(outcome)
        return body

    def chunk(self, text: str | None = None, *, first: bool = False, outcome=None) -> dict:
        """A streamed piece of text, the chat stream's opening role chunk (first), or the last
        chunk (outcome: finish_reason and timings)."""
        reason = None if outcome is None else outcome.finish_reason
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = self._obj("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if outcome is not None:
            body["timings"] = timings(outcome)
        return body

    def usage_chunk(self, outcome) -> dict:
        r = outcome.result
        body = self._obj("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(r.prompt_tokens, len(r.tokens))
        return body
