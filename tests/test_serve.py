"""The OpenAI-compatible server (powerinfer_jax.serve / powerinfer_jax.server) on a tiny model:
the `openai` client against a live server on 127.0.0.1, errors, metrics, disconnects, overload,
shutdown, engine failures, and the CLI."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers_models import save_hf_llama
from helpers_serve import (MODEL, health, load, metric, openai_client, serving, slow_engine,
                           wait_for)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "hello", "it's 2024 and we're testing tokenizers: 3.14"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_serve")
    save_hf_llama(d)
    return d


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """The same model through the Python API, one sequence at a time: the expected outputs."""
    return load(tiny_dir, max_batch=1)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with serving(load(tiny_dir, max_batch=4).session, slots=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def spare(tiny_dir):
    """A 2-slot model for the tests that slow down or break its engine; they take turns (one
    server at a time drives it) and reuse its compiled steps."""
    return load(tiny_dir, max_batch=2).session


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url, timeout=60)


# ---------------------------------------------------------------------------- the openai client
@pytest.mark.slow
def test_completion_equals_llm_generate(client, ref):
    for p in PROMPTS:
        want = ref.generate(p, max_new_tokens=12)
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        c = out.choices[0]
        assert c.text == want.text and c.finish_reason == want.finish_reason
        assert out.usage.prompt_tokens == want.prompt_tokens
        assert out.usage.completion_tokens == len(want.token_ids)
        assert out.usage.total_tokens == want.prompt_tokens + len(want.token_ids)
        assert out.model_extra["timings"]["predicted_n"] == len(want.token_ids)


@pytest.mark.slow
def test_token_id_prompt_equals_text_prompt(client, ref):
    ids = ref.encode(PROMPTS[0])
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert a.choices[0].text == b.choices[0].text == ref.generate(ids, max_new_tokens=8).text


@pytest.mark.slow
def test_chat_uses_the_models_template(client, ref):
    want = ref.generate("hello there", chat=True, max_new_tokens=10)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=10,
        temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert out.usage.prompt_tokens == want.prompt_tokens
    # content parts are joined text
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                {"type": "text", "text": "there"}]}])
    assert parts.choices[0].message.content == want.text


def test_streaming_completion_and_chat(client, ref):
    want = ref.generate(PROMPTS[2], max_new_tokens=16)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == want.finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)

    want = ref.generate("tell me", chat=True, max_new_tokens=12)
    stream = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                            stream=True,
                                            messages=[{"role": "user", "content": "tell me"}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_stop_strings_and_max_tokens(client, ref):
    full = ref.generate(PROMPTS[0], max_new_tokens=20).text
    stop = full[3:5]
    assert len(stop) == 2
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0, stop=[stop, "never-generated"])
    assert out.choices[0].text == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1
    assert one.choices[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_seeded_sampling_matches_the_api_whatever_shares_the_batch(client, ref, server):
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    want = ref.generate(PROMPTS[1], max_new_tokens=16, top_k=40, **kw).text
    alone = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                      extra_body={"top_k": 40}, **kw).choices[0].text
    # the same request while three greedy streams share its decode steps
    others = [threading.Thread(target=lambda p=p: client.completions.create(
        model=MODEL, prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}))
        for p in PROMPTS]
    for t in others:
        t.start()
    busy = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16,
                                     extra_body={"top_k": 40}, **kw).choices[0].text
    for t in others:
        t.join()
    assert alone == busy == want


def test_models_health_and_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = health(server.url)
    assert h["status"] == "ok" and h["slots_idle"] + h["slots_processing"] == 4
    before = metric(server.url, "pij_requests_total", endpoint="completions", status="200")
    gen_before = metric(server.url, "pij_generated_tokens_total")
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    assert metric(server.url, "pij_requests_total", endpoint="completions",
                  status="200") == before + 1
    assert metric(server.url, "pij_generated_tokens_total") >= gen_before + \
        out.usage.completion_tokens
    text = httpx.get(server.url + "/metrics").text
    for name in ("pij_prompt_tokens_total", "pij_request_latency_seconds_bucket",
                 "pij_time_to_first_token_seconds_count", "pij_slots_busy", "pij_slots_total 4.0",
                 "pij_queue_length", "pij_decode_step_sequences_bucket",
                 "pij_decode_step_seconds_count", "pij_prefill_seconds_count"):
        assert name in text


# ---------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x"}, "model"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 400}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 9]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_are_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(param.split(".")[0]) and "expected" in err["message"]


@pytest.mark.slow
def test_a_chat_only_field_on_a_completion_is_ignored(server):
    """max_completion_tokens belongs to chat; on /v1/completions it is an unknown extra, whatever
    its type (the fuzz test found a list reaching the context check: a 500)."""
    for value in ([1, 2], "5", 3):
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 2, "max_completion_tokens": value},
            timeout=60)  # httpx's 5 s default is shorter than a first compile on a busy machine
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_completion_tokens": value}, timeout=60)
        assert r.status_code == 200, r.text


def test_the_openai_client_raises_its_errors(client):
    with pytest.raises(openai.BadRequestError, match="n: expected"):
        client.completions.create(model=MODEL, prompt="x", n=3)
    with pytest.raises(openai.BadRequestError, match="model"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_bodies_that_are_not_json_objects(server):
    for body in (b"", b"nope", b"[1, 2]", b'"text"', b"{\"model\":", "\udc80".encode(
            "utf-8", "surrogatepass"), b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/completions", content=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", (body, r.text)


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v2/everything")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413


# ---------------------------------------------------------------------------- lifecycle
@pytest.mark.slow
def test_health_is_503_while_loading(spare):
    go = threading.Event()

    def loader():
        go.wait(60)
        return spare

    with serving(loader, slots=2, wait_ready=False) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        go.set()
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 60, "ready")
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                         "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


@pytest.mark.slow
def test_disconnects_free_their_slots(spare, monkeypatch):
    slow_engine(monkeypatch, spare.engine, 0.05)  # 100 tokens take >= 5 s
    with serving(spare, slots=2) as srv:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
        # streaming: read a few chunks, then hang up
        client = openai_client(srv.url, timeout=30)
        stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=100,
                                           stream=True, extra_body={"ignore_eos": True})
        for _, _ in zip(range(3), stream):
            pass
        assert health(srv.url)["slots_processing"] == 1
        stream.close()
        wait_for(lambda: health(srv.url)["slots_processing"] == 0, 3, "the slot to free")
        # not streaming: the client closes its socket while the request runs
        raw = json.dumps(body).encode()
        with socket.create_connection((srv.host, srv.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
            wait_for(lambda: health(srv.url)["slots_processing"] == 1, 10, "the request to run")
        wait_for(lambda: health(srv.url)["slots_processing"] == 0, 3, "the slot to free")
        assert metric(srv.url, "pij_requests_total", endpoint="completions", status="499") == 2
        assert metric(srv.url, "pij_slots_busy") == 0
        assert metric(srv.url, "pij_generated_tokens_total") < 2 * 100


@pytest.mark.slow
def test_overload_is_429_and_the_queue_drains(spare, monkeypatch):
    slow_engine(monkeypatch, spare.engine, 0.05)  # a request takes >= 2 s
    with serving(spare, slots=2, queue_size=1) as srv:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}
        results = []
        running = [threading.Thread(target=lambda: results.append(
            httpx.post(srv.url + "/v1/completions", json=body, timeout=60))) for _ in range(3)]
        for t in running:
            t.start()
        wait_for(lambda: {k: v for k, v in health(srv.url).items() if k != "warm"} == {
            "status": "ok", "slots_idle": 0, "slots_processing": 2, "queued": 1}, 20,
            "two running and one queued")
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai_client(srv.url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        for t in running:
            t.join(60)
        assert [x.status_code for x in results] == [200] * 3
        assert len({x.json()["choices"][0]["text"] for x in results}) == 1
        assert metric(srv.url, "pij_requests_total", endpoint="completions", status="429") == 2
        assert metric(srv.url, "pij_queue_length") == 0


@pytest.mark.slow
def test_shutdown_with_requests_in_flight_is_prompt(spare, monkeypatch):
    slow_engine(monkeypatch, spare.engine, 0.05)
    app_srv = serving(spare, slots=2, queue_size=4, grace_s=0.3)
    srv = app_srv.__enter__()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 120, "ignore_eos": True}
    outcomes = []

    def stream():
        try:
            for _ in openai_client(srv.url, timeout=30).completions.create(
                    model=MODEL, prompt="hello", max_tokens=120, stream=True,
                    extra_body={"ignore_eos": True}):
                pass
            outcomes.append("complete")
        except openai.APIError as e:
            outcomes.append(str(e))

    def whole():
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        outcomes.append(r.json()["error"]["message"] if r.status_code == 503 else r.status_code)

    clients = [threading.Thread(target=f) for f in (stream, stream, whole)]
    for t in clients[:2]:  # the streams take the two slots first, then the whole one queues
        t.start()
    wait_for(lambda: health(srv.url)["slots_processing"] == 2, 20, "two streams running")
    clients[2].start()
    wait_for(lambda: health(srv.url)["queued"] == 1, 20, "two running, one queued")
    t0 = time.monotonic()
    app_srv.__exit__(None, None, None)  # stop(): as on SIGTERM
    for t in clients:
        t.join(10)
    assert time.monotonic() - t0 < 10 and not any(t.is_alive() for t in clients)
    assert sorted(outcomes) == sorted(["the server shut down before the request finished"] * 2
                                      + ["the server is shutting down"]), outcomes


@pytest.mark.slow
def test_engine_failure_is_500_and_the_server_keeps_serving(spare, ref, monkeypatch):
    import jax

    eng = spare.engine
    step = eng.decode_step
    calls = {"n": 0}

    def broken(*a, **k):  # one step fails after consuming the (donated) cache, as XLA would
        calls["n"] += 1
        if calls["n"] == 3:
            jax.tree.map(lambda x: x.delete(), eng.cache())
            raise RuntimeError("injected failure")
        return step(*a, **k)

    monkeypatch.setattr(eng, "decode_step", broken)
    with serving(spare, slots=2) as srv:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}
        # the first request may compile its steps (seconds on a busy machine)
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected failure" in err["message"]
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == ref.generate(PROMPTS[0],
                                                                  max_new_tokens=10).text


# ---------------------------------------------------------------------------- the CLI
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "powerinfer_jax.serve", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_cli_serves_and_exits_promptly_on_sigterm(tiny_dir):
    port = _free_port()
    p = _cli("--model", str(tiny_dir), "--port", str(port), "--parallel", "2", "--threads", "1",
             "--alias", MODEL, "--shutdown-grace", "0.5", "--log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            assert p.poll() is None, p.communicate()[1]
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(ready, 120, "the CLI's server to be ready", every=0.2)
        out = openai_client(url).completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert out.usage.completion_tokens >= 1
        with httpx.stream("POST", url + "/v1/completions", json={
                "model": MODEL, "prompt": "hello", "max_tokens": 100, "stream": True,
                "ignore_eos": True}) as r:
            next(r.iter_lines())
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            p.wait(20)
        assert time.monotonic() - t0 < 20
        assert p.returncode in (0, -signal.SIGTERM), p.communicate()[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_cli_bad_model_is_one_line_and_status_2(tmp_path):
    p = _cli("--model", str(tmp_path / "missing"), "--port", str(_free_port()), "--log-level",
             "critical")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing" in lines[0]
