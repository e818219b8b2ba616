"""The server warms every step it can need (server/worker.py warm_plan), short prompts' first:
/health answers 200 once those are ready, the rest warm beside the running engine, a request
whose first steps are not ready yet gets 503 with Retry-After, and once warm no request of any
prompt length, batch size or sampling kind waits for a compile; /health and /metrics say how warm
it is. One step per shape serves greedy and sampled batches (sampling kind "any")."""
import threading

import httpx
import pytest

import powerinfer_jax as pij
from helpers_models import save_hf_llama, tiny_llama_config, write_tiny_gguf
from helpers_serve import MODEL, health, load, metric, serving, wait_for
from powerinfer_jax.server.worker import Warmth, first_tier, warm_plan


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_warm")
    save_hf_llama(d)
    return load(d, max_batch=2).session


def test_the_plan_covers_every_bucket(session):
    engine = session.engine  # max_seq_len 128, 2 slots
    plan = warm_plan(engine)
    b = engine.buckets()
    assert b == {"prefill": [4, 8, 16, 32, 64, 128], "kv": [128], "batch": [1, 2]}
    assert plan == [("decode", 1, 128, "any", 1), ("decode", 2, 128, "any", 1)] + [
        ("prefill", t, "any") for t in (4, 8, 16, 32, 64, 128)]
    assert first_tier(plan) == len(plan)


def test_short_prompts_come_first_and_a_request_waits_only_for_its_own_steps():
    """On a longer context the plan goes cache bucket by cache bucket; `missing` names what a
    request's start needs that is not ready (nothing is compiled here)."""
    from powerinfer_jax.runtime.decode import Engine

    class Buckets:  # an engine's bucket arithmetic, without a model
        max_seq_len, max_batch = 512, 4
        buckets, kv_bucket, batch_bucket = Engine.buckets, Engine.kv_bucket, Engine.batch_bucket

    engine = Buckets()
    plan = warm_plan(engine)
    dec = [("decode", n, kv, "any", 1) for kv in (128, 256, 512) for n in (1, 2, 4)]
    pre = [("prefill", t, "any") for t in (4, 8, 16, 32, 64, 128, 256, 512)]
    assert plan == dec[:3] + pre[:6] + dec[3:6] + pre[6:7] + dec[6:] + pre[7:]
    warm = Warmth(engine, plan)
    assert warm.first == 9
    ready = set(plan[:warm.first])
    engine.is_ready = lambda k: k in ready
    assert warm.missing(100, "any") == []  # prefill 128, first token at position 100
    assert warm.missing(127, "any") == []
    assert warm.missing(128, "any") == dec[3:6]  # its first new token is in the 256 bucket
    assert warm.missing(200, "any") == [pre[6]] + dec[3:6]
    ready.update(plan[warm.first:])
    assert warm.missing(500, "any") == [] and warm.complete()


@pytest.mark.slow
def test_health_turns_200_warm_and_requests_compile_nothing(session, monkeypatch):
    """While warming /health is 503 and says how far it got; once 200, requests of every
    bucket, greedy and sampled, one and two at a time, need no step outside the plan."""
    gate = threading.Event()
    real = Warmth.warm

    def held_warm(self, *a, **kw):
        gate.wait(60)
        return real(self, *a, **kw)

    monkeypatch.setattr(Warmth, "warm", held_warm)
    session.engine.reset_cache()  # as a fresh server's: made by the warm-up, checked below
    with serving(lambda: session, slots=2, warmup=True, wait_ready=False) as srv:
        wait_for(lambda: "warming" in httpx.get(srv.url + "/health").text, 60, "warming")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "of 8 ready" in r.json()["error"]["message"]
        gate.set()
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 120, "ready")
        wait_for(lambda: health(srv.url)["warm"]["complete"], 120, "the rest warmed")
        warm = health(srv.url)["warm"]
        assert warm["steps_planned"] == warm["steps_ready"] == 8
        assert metric(srv.url, "pij_warm_steps_ready") == 8
        # the KV cache is made before /health says 200, not by the first request
        assert session.engine._cache is not None
        cache_before = session.engine._cache
        bodies = [{"model": MODEL, "prompt": [5] * n, "max_tokens": 3, "temperature": t}
                  for n in (3, 20, 40, 100) for t in (0, 1.0)]  # prompt buckets 4 .. 128

        def post(body):
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text

        assert session.engine._cache is cache_before  # nothing replaced it while idle
        for body in bodies:
            post(body)
        pair = [threading.Thread(target=post, args=(b,)) for b in bodies[:2]]
        for t in pair:
            t.start()
        for t in pair:
            t.join(60)
        assert health(srv.url)["warm"]["steps_outside_plan"] == 0
        assert metric(srv.url, "pij_steps_outside_plan") == 0


@pytest.mark.slow
def test_health_says_200_after_the_first_tier_and_longer_prompts_wait_for_theirs(
        tmp_path, monkeypatch):
    """A 256-token context: /health 200 once the 128-token tier is ready; a 200-token prompt
    meanwhile gets 503 with Retry-After (its steps are not ready), and 200 once they are."""
    gguf = tmp_path / "tiny256.gguf"
    write_tiny_gguf(gguf, tiny_llama_config(max_seq_len=256))
    s = pij.load(str(gguf), max_batch=1, max_seq_len=256, progress=False).session
    gate = threading.Event()
    real = Warmth.warm

    def held_rest(self, start=0, stop=None, **kw):
        if start > 0:
            gate.wait(120)
        return real(self, start, stop, **kw)

    monkeypatch.setattr(Warmth, "warm", held_rest)
    long = {"model": MODEL, "prompt": [7] * 200, "max_tokens": 2, "temperature": 0}
    with serving(lambda: s, slots=1, warmup=True, wait_ready=True) as srv:
        warm = health(srv.url)["warm"]
        assert warm["steps_ready"] == 7 and warm["steps_planned"] == 9 and not warm["complete"]
        short = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [7] * 20, "max_tokens": 3, "temperature": 0.7})
        assert short.status_code == 200, short.text
        r = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "warming" and err["message"].startswith(
            "prompt: the compiled steps for a 200-token prompt are being prepared (7 of 9")
        gate.set()
        wait_for(lambda: health(srv.url)["warm"]["complete"], 120, "the rest warmed")
        r = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 200, r.text
        assert health(srv.url)["warm"]["steps_outside_plan"] == 0
