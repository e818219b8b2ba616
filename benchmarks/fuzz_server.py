"""Requests generated from the server's own OpenAPI schema (schemathesis), and the check of
each answer.

`operations(url)` reads GET /openapi.json and gives, per endpoint (health, metrics, models,
completions, chat), hypothesis strategies of schemathesis cases that fit the schema (positive)
and that break it (negative: wrong types, missing required fields, values out of range). Half
of the generated bodies get the served model's name, so that valid ones reach generation
rather than stopping at "unknown model".

`classify(response)`: "ok" for a well-formed success (JSON, or server-sent events ending in
[DONE] with no error event) or a 4xx in OpenAI's error shape ({"error": {"message", "type",
"param", "code"}} with a one-line message); "crash" for any 5xx; "finding" for anything else
(a malformed answer). Used by tests/test_serve_fuzz.py (bounded) and benchmarks/fuzz.py.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

ALLOWED_4XX = (400, 404, 405, 413, 429)


def operations(url: str, model_name: str):
    """[(label, positive strategy, negative strategy)] for every operation of the schema."""
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    out = []
    for result in schema.get_all_operations():
        op = result.ok()

        def named(case, use_model):
            if use_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = model_name
            return case

        label = f"{op.method.upper()} {op.path}"
        strategies = [st.tuples(op.as_strategy(mode), st.booleans()).map(lambda t: named(*t))
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        out.append((label, *strategies))
    return out


def send(client: httpx.Client, case) -> httpx.Response:
    """Send a schemathesis case (serialized by schemathesis, as its own runner would) with
    `client` (an httpx.Client whose base_url is the server)."""
    kw = case.as_transport_kwargs(base_url=str(client.base_url).rstrip("/"))
    content = kw.get("data")
    if "json" in kw:
        content = json.dumps(kw["json"]).encode()
    headers = {k: str(v) for k, v in (kw.get("headers") or {}).items()
               if k.lower() not in ("content-length", "host")}
    if "json" in kw:
        headers.setdefault("Content-Type", "application/json")
    if kw.get("cookies"):
        headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in kw["cookies"].items())
    return client.request(kw["method"], kw["url"], params=kw.get("params"), content=content,
                          headers=headers)


def classify(r: httpx.Response) -> tuple[str, str]:
    if r.status_code >= 500:
        return "crash", f"HTTP {r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        if r.status_code not in ALLOWED_4XX:
            return "finding", f"HTTP {r.status_code}: {r.text[:200]}"
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return "finding", f"HTTP {r.status_code} without OpenAI's error shape: {r.text[:200]}"
        if not (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
                and isinstance(err["message"], str) and err["message"]
                and "\n" not in err["message"]):
            return "finding", f"HTTP {r.status_code} error object {err!r:.200}"
        return "ok", f"{r.status_code}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]" or \
                not all(e.startswith("data: ") for e in events):
            return "finding", f"a stream not ending in [DONE]: {r.text[-200:]!r}"
        for e in events[:-1]:
            if "error" in json.loads(e[len("data: "):]):
                return "crash", f"an error event in a stream: {e[:200]}"
        return "ok", "200 stream"
    if r.headers.get("content-type", "").startswith("application/json"):
        try:
            r.json()
        except ValueError:
            return "finding", f"HTTP 200 with a body that is not JSON: {r.text[:200]!r}"
    return "ok", f"{r.status_code}"


# ---------------------------------------------------------------------------- benchmarks/fuzz.py
def requests_strategy(url: str, model_name: str):
    """Every kind of request: schemathesis cases of every operation (fitting and breaking the
    schema), tests/test_serve_fuzz.py's mutated OpenAI bodies and any JSON, and random bytes."""
    from hypothesis import strategies as st

    sys.path.insert(0, str(REPO / "tests"))
    import test_serve_fuzz as T  # its strategies: valid bodies, mutations, any JSON

    schema_cases = [s for _, pos, neg in operations(url, model_name) for s in (pos, neg)]
    paths = st.sampled_from(sorted(T.BODIES))

    def mutated(path):
        return st.tuples(T.BODIES[path], T.MUTATIONS).map(lambda t: ("json", path, _mutate(*t)))

    return st.one_of(st.one_of(*schema_cases).map(lambda c: ("case", c)),
                     paths.flatmap(mutated),
                     st.tuples(st.just("json"), paths, T.JSON),
                     st.tuples(st.just("bytes"), paths, st.binary(max_size=300)))


def _mutate(body: dict, mutations) -> dict:
    body = dict(body)
    for name, drop, value in mutations:
        if drop:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def run(cases: int, work: Path, hang_s: float, findings: list) -> dict:
    """`cases` generated requests against the real server on 127.0.0.1 (benchmarks/fuzz.py)."""
    from hypothesis import HealthCheck, Phase, given, settings

    from benchmarks.serve_load import Child, free_port

    sys.path.insert(0, str(REPO / "tests"))
    from helpers_models import save_hf_llama

    model = work / "model"
    if not (model / "config.json").is_file():
        save_hf_llama(model)
    port = free_port()
    argv = [sys.executable, "-m", "powerinfer_jax.serve", "--model", str(model), "--alias",
            "tiny", "--parallel", "4", "--queue", "64", "--max-seq-len", "64", "--port",
            str(port), "--log-level", "warning"]
    server = Child("powerinfer_jax", argv, port, work / "server.log")
    counts = {"cases": 0, "crashes": 0, "hangs": 0, "rule": 0}
    statuses: dict[str, int] = {}  # answers by status (and "stream"), for the run row
    try:
        server.wait_ready(1800)
        client = httpx.Client(base_url=server.url, timeout=hang_s)
        t0 = time.monotonic()

        @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(requests_strategy(server.url, "tiny"))
        def fuzz(req):
            if counts["cases"] >= cases or server.proc.poll() is not None:
                return
            counts["cases"] += 1
            try:
                if req[0] == "case":
                    r = send(client, req[1])
                elif req[0] == "json":
                    r = client.post(req[1], content=json.dumps(req[2]),
                                    headers={"content-type": "application/json"})
                else:
                    r = client.post(req[1], content=req[2])
            except httpx.TimeoutException:
                counts["hangs"] += 1
                findings.append({"target": "server", "what": "hang", "input": repr(req)[:2000],
                                 "detail": f"no answer in {hang_s} s"})
                return
            except httpx.TransportError as e:
                counts["crashes"] += 1
                findings.append({"target": "server", "what": "crash", "input": repr(req)[:2000],
                                 "detail": f"{type(e).__name__}: {e}"})
                return
            kind, detail = classify(r)
            status = "200 stream" if detail == "200 stream" else str(r.status_code)
            statuses[status] = statuses.get(status, 0) + 1
            if kind != "ok":
                counts["crashes" if kind == "crash" else "rule"] += 1
                findings.append({"target": "server", "what": kind, "input": repr(req)[:2000],
                                 "detail": detail})
            if counts["cases"] % 1000 == 0:
                print(f"  server: {counts} after {time.monotonic() - t0:.0f} s", flush=True)

        fuzz()
        if server.proc.poll() is not None:
            counts["crashes"] += 1
            findings.append({"target": "server", "what": "crash", "input": None,
                             "detail": f"the server exited with {server.proc.returncode}"})
    finally:
        server.close()
    log = (work / "server.log").read_text(errors="replace")
    tracebacks = log.count("Traceback (most recent call last)")
    if tracebacks:
        counts["crashes"] += tracebacks
        findings.append({"target": "server", "what": "traceback in the log", "input": None,
                         "detail": log[log.index("Traceback"):][:3000]})
    return {**counts, "statuses": dict(sorted(statuses.items()))}
