"""Test helpers for the server: a tiny model's server on a free port, a slowed-down engine, and
polling the server's own view (/health, /metrics)."""
from __future__ import annotations

import contextlib
import re
import time

import httpx

import powerinfer_jax as pij
from powerinfer_jax.server import ServerThread, create_app

MODEL = "tiny"
MAX_SEQ_LEN = 128  # the tiny model's whole context (helpers_models.save_hf_llama)


def load(model_dir, *, max_batch: int):
    return pij.load(str(model_dir), max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, progress=False)


@contextlib.contextmanager
def serving(session_or_loader, *, slots: int, queue_size: int = 64, grace_s: float = 5.0,
            warmup=(), wait_ready: bool = True, **app_kw):
    """A running server (ServerThread) for a Session or a loader (app_kw: create_app's other
    arguments, e.g. api_key, max_body); stopped (and checked to stop within 30 s) on exit."""
    app = create_app(session_or_loader, slots=slots, model_name=MODEL, queue_size=queue_size,
                     warmup=warmup, **app_kw)
    srv = ServerThread(app, grace_s=grace_s).start()
    try:
        if wait_ready:
            wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200, 120,
                     "the server to answer /health 200")
        yield srv
    finally:
        assert srv.stop(30), "the server thread did not exit within 30 s of stop()"


def wait_for(cond, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def metric(url: str, name: str, **labels) -> float:
    """One sample of /metrics (0 when absent)."""
    text = httpx.get(url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pat = re.compile(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", re.M)
    for m in pat.finditer(text):
        got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
        if got == want:
            return float(m.group(3))
    return 0.0


def health(url: str) -> dict:
    return httpx.get(url + "/health").json()


def slow_engine(monkeypatch, engine, seconds: float) -> None:
    """Every decode step takes at least `seconds` more (requests stay in flight long enough to
    disconnect, overload or shut down while they run)."""
    step = engine.decode_step

    def slow(*a, **k):
        time.sleep(seconds)
        return step(*a, **k)

    monkeypatch.setattr(engine, "decode_step", slow)


def openai_client(url: str, **kw):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)
