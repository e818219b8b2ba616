"""The server warms every step it can need before /health answers 200 (server/worker.py
warm_plan): after that no request of any prompt length, batch size or sampling kind waits for a
compile, and /health and /metrics say how warm it is."""
import threading

import httpx
import pytest

from helpers_models import save_hf_llama
from helpers_serve import MODEL, health, load, metric, serving, wait_for
from powerinfer_jax.server.worker import Warmth, warm_plan


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_warm")
    save_hf_llama(d)
    return load(d, max_batch=2).session


def test_the_plan_covers_every_bucket(session):
    engine = session.engine  # max_seq_len 128, 2 slots
    plan = warm_plan(engine, ("greedy", "sample"))
    b = engine.buckets()
    assert b == {"prefill": [4, 8, 16, 32, 64, 128], "kv": [128], "batch": [1, 2]}
    assert sorted(k for k in plan if k[0] == "prefill") == sorted(
        ("prefill", t, kind) for t in (4, 8, 16, 32, 64, 128) for kind in ("greedy", "sample"))
    assert sorted(k for k in plan if k[0] == "decode") == sorted(
        ("decode", n, 128, kind, 1) for n in (1, 2) for kind in ("greedy", "sample"))


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
    with serving(lambda: session, slots=2, warmup=("greedy", "sample"),
                 wait_ready=False) as srv:
        wait_for(lambda: "warming" in httpx.get(srv.url + "/health").text, 60, "warming")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "of 16 ready" in r.json()["error"]["message"]
        gate.set()
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 120, "ready")
        warm = health(srv.url)["warm"]
        assert warm["steps_planned"] == warm["steps_ready"] == 16
        assert metric(srv.url, "pij_warm_steps_ready") == 16
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
