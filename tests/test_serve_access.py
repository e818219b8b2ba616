"""Who may use the server and what a request can reach (issue 53): the API key (401 in OpenAI's
error shape on every /v1 route, /health and /metrics open), the body size limit (413, set by
--max-body-bytes), a request's model name that never opens a path, invalid UTF-8 and a chat
request to a model without a chat template (400s naming the field)."""
import os
import sys

import httpx
import pytest

from helpers_models import gpt2_tokenizer_meta, save_hf_llama, write_tiny_gguf
from helpers_serve import MODEL, load, openai_client, serving
from powerinfer_jax import serve
from powerinfer_jax.errors import UserError

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_access")
    save_hf_llama(d)
    return d


@pytest.fixture(scope="module")
def session(tiny_dir):
    return load(tiny_dir, max_batch=1).session


@pytest.fixture(scope="module")
def locked(session):
    with serving(session, slots=1, api_key=KEY, max_body=2048) as srv:
        yield srv


def _completion(url, headers=None, **body):
    return httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 2,
                            "temperature": 0, **body})


def _is_openai_error(r, status, code, param=None):
    err = r.json()["error"]
    assert r.status_code == status, r.text
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param and err["type"] == \
        "invalid_request_error"
    return err["message"]


@pytest.mark.parametrize("headers,got", [
    (None, "no Authorization header"),
    ({"Authorization": "Bearer wrong-key"}, "another key"),
    ({"Authorization": f"Basic {KEY}"}, 'an Authorization header that is not "Bearer <key>"'),
    ({"Authorization": "Bearer"}, 'an Authorization header that is not "Bearer <key>"'),
])
def test_a_v1_request_without_the_key_gets_401(locked, headers, got):
    for r in (_completion(locked.url, headers),
              httpx.get(locked.url + "/v1/models", headers=headers),
              httpx.get(locked.url + "/v1/no-such-route", headers=headers),
              httpx.post(locked.url + "/v1/chat/completions", headers=headers,
                         content=b"x" * 10_000)):  # refused before the body is read: not 413
        msg = _is_openai_error(r, 401, "invalid_api_key")
        assert msg == f"Authorization: expected \"Bearer <the server's API key>\", got {got}"
        assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text


def test_the_key_opens_the_api_and_health_and_metrics_stay_open(locked):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _completion(locked.url, auth).status_code == 200
    assert httpx.get(locked.url + "/v1/models", headers=auth).status_code == 200
    assert httpx.get(locked.url + "/health").status_code == 200
    assert httpx.get(locked.url + "/metrics").status_code == 200
    assert _completion(locked.url).status_code == 401  # counted in the metrics
    assert 'pij_requests_total{endpoint="completions",status="401"}' in httpx.get(
        locked.url + "/metrics").text
    out = openai_client(locked.url).with_options(api_key=KEY).completions.create(
        model=MODEL, prompt="hello", max_tokens=2, temperature=0)  # as the openai client sends it
    assert out.choices[0].finish_reason in ("length", "stop")


def test_a_body_over_the_limit_gets_413(locked):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = _completion(locked.url, auth, prompt="x" * 4000)
    msg = _is_openai_error(r, 413, "body_too_large", "body")
    assert msg.startswith("body: expected at most 2048 bytes, got ")


@pytest.fixture
def opened():
    """Every path this process opens while the test runs (an audit hook: it sees open() and
    os.open wherever they are called, the server's threads included)."""
    seen, on = [], [True]

    def hook(event, args):
        if on[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            seen.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)  # hooks cannot be removed: this one stops recording
    yield seen
    on[0] = False


def test_a_model_name_never_opens_a_path(session, tiny_dir, tmp_path, opened):
    """The request's model is compared with the one model's names, as a string: `../`,
    absolute paths and symlinks to the real model or to files outside it are refused (400)
    without anything being opened."""
    outside = tmp_path / "outside.gguf"
    write_tiny_gguf(outside)
    link = tmp_path / "link-to-model"
    link.symlink_to(tiny_dir)
    link_out = tmp_path / "link-out.gguf"
    link_out.symlink_to(outside)
    names = ["../" + MODEL, f"{MODEL}/../../etc/passwd", "/etc/passwd", str(outside),
             str(link), str(link_out), str(tiny_dir / ".." / tiny_dir.name), "~/" + MODEL]
    with serving(session, slots=1) as srv:
        opened.clear()
        for name in names:
            r = _completion(srv.url, model=name)
            msg = _is_openai_error(r, 400, "model_not_found", "model")
            assert msg.startswith(f"model: expected '{MODEL}' (the model this server runs), ")
        assert _completion(srv.url).status_code == 200  # the configured name still serves
    touched = [p for p in opened if any(n.lstrip("~/.") in p for n in names[3:])
               or "passwd" in p]
    assert touched == []


def test_invalid_utf8_and_a_base_models_chat_are_400s(tmp_path):
    meta = gpt2_tokenizer_meta()
    del meta["chat_template"]
    gguf = tmp_path / "base.gguf"
    write_tiny_gguf(gguf, tokenizer_meta=meta)
    with serving(load(gguf, max_batch=1).session, slots=1) as srv:
        for raw in (b'{"model": "tiny", "prompt": "ab\xff\xfecd"}',  # bytes that are not UTF-8
                    b'{"model": "tiny", "prompt": "ab\\udcffcd"}'):  # an escaped lone surrogate
            r = httpx.post(srv.url + "/v1/completions", content=raw,
                           headers={"Content-Type": "application/json"})
            assert _is_openai_error(r, 400, "invalid_json", "body").startswith(
                "body: expected a JSON object, got invalid JSON")
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        msg = _is_openai_error(r, 400, "chat_template", "messages")
        assert msg.startswith("messages: expected a model with a chat template, got a model "
                              "without one (a base model: send its text to /v1/completions")


def test_the_key_comes_from_the_flag_or_the_environment():
    assert serve.api_key_from("k1", "k2") == "k1" and serve.api_key_from(None, "k2") == "k2"
    assert serve.api_key_from(None, None) is None
    with pytest.raises(UserError, match=r"^--api-key: expected a non-empty key of printable "
                       r"ASCII without spaces, got 0 characters$"):
        serve.api_key_from("", None)
    with pytest.raises(UserError, match=r"^POWERINFER_JAX_API_KEY: expected a non-empty key .*"
                       r"got 7 characters \(not all printable ASCII\)$"):
        serve.api_key_from(None, "has key")
    with pytest.raises(UserError, match=r"^--max-body-bytes: expected a positive integer"):
        serve.main(["--max-body-bytes", "0"])
    with pytest.raises(UserError, match=r"^--chat-template: expected \"chatml\" or an existing "
                       r"jinja file, got '/no/such.jinja'$"):  # before the model loads
        serve.main(["--chat-template", "/no/such.jinja"])
