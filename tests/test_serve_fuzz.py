"""Fuzzing the server's request handling with hypothesis: valid bodies with random mutations (wrong
types, sizes, unicode, missing and extra fields, NaN), any JSON value, and random bytes never get
a 500 or take the server down; every answer is a well-formed success (streamed or not) or a 400 in
OpenAI's error shape. Bounded: 320 requests."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_models import save_hf_llama
from helpers_serve import MODEL, load, serving

LEAF = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
        | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


VALID = {  # a value of each field the server accepts
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 400), "seed": st.integers(0, 2 ** 32 - 1), "stream": st.booleans(),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3),
                                                        max_size=4),
    "n": st.just(1), "ignore_eos": st.booleans(), "user": st.text(max_size=10),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.none(), "presence_penalty": st.just(0), "echo": st.just(False),
}
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
     "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1, max_size=3)}),
    min_size=1, max_size=3)
PROMPT = (st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 299), min_size=1, max_size=20)
          | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=1))
BODIES = {
    "/v1/completions": st.fixed_dictionaries({"model": st.just(MODEL), "prompt": PROMPT},
                                             optional=VALID),
    # chat's default max_tokens is the rest of the context: given here unless a mutation drops it
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": MESSAGES, "max_tokens": VALID["max_tokens"]},
        optional={**{k: v for k, v in VALID.items() if k != "max_tokens"},
                  "max_completion_tokens": st.integers(1, 6)}),
}
FIELDS = sorted({"model", "prompt", "messages", "max_completion_tokens", *VALID})
# Up to three mutations of a valid body: drop a field, or give it any JSON value.
MUTATIONS = st.lists(st.tuples(st.sampled_from(FIELDS), st.booleans(), JSON), max_size=3)
FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_serve_fuzz")
    save_hf_llama(d)
    with serving(load(d, max_batch=4).session, slots=4) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            yield client
        assert httpx.get(srv.url + "/health").status_code == 200  # still up after the fuzzing


def check(r: httpx.Response, *, stream: bool = False) -> None:
    assert r.status_code in (200, 400), (r.status_code, r.text[:500])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        assert err["type"] == "invalid_request_error" and err["message"]
    elif stream:
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        for e in events[:-1]:
            assert "error" not in json.loads(e[len("data: "):])
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(BODIES))
def test_random_json_bodies_never_500(server, path):
    @FUZZ
    @given(body=BODIES[path], mutations=MUTATIONS,
           extra=st.dictionaries(st.text(max_size=10), JSON, max_size=3),
           anything=st.none() | JSON)
    def fuzz(body, mutations, extra, anything):
        body = {**extra, **body}
        for name, drop, value in mutations:
            if drop:
                body.pop(name, None)
            else:
                body[name] = value
        if anything is not None and not mutations:  # sometimes the body is any JSON value
            body = anything
        r = server.post(path, content=json.dumps(body))
        check(r, stream=r.headers.get("content-type", "").startswith("text/event-stream"))

    fuzz()


def test_random_bytes_are_400(server):
    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(raw=st.binary(max_size=200), path=st.sampled_from(sorted(BODIES)))
    def fuzz(raw, path):
        r = server.post(path, content=raw)
        assert r.status_code == 400
        check(r)

    fuzz()


@pytest.mark.slow
def test_openapi_schema_fuzz_every_endpoint(server):
    """schemathesis: cases that fit and that break the server's own /openapi.json, for every
    endpoint (benchmarks/fuzz_server.py); each answer a well-formed success or a 4xx in
    OpenAI's error shape, never a 5xx. Bounded: 6 cases per endpoint."""
    from benchmarks import fuzz_server as FS

    url = str(server.base_url).rstrip("/")
    ops = FS.operations(url, MODEL)
    assert {label for label, *_ in ops} == {
        "GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
        "POST /v1/chat/completions"}
    for label, positive, negative in ops:
        @settings(FUZZ, max_examples=6)
        @given(case=st.one_of(positive, negative))
        def fuzz(case):
            kind, detail = FS.classify(FS.send(server, case))
            assert kind == "ok", (label, case.body, detail)

        fuzz()
