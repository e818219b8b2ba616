"""The server's Prometheus metrics (GET /metrics), in a registry of their own.

One registry per app, not prometheus_client's global one: a test process starts several servers,
and each must count only its own requests. Every metric is updated from the thread that knows the
value (the event loop for requests and latency, the engine thread for tokens, slots and steps);
prometheus_client's metrics are thread-safe.
"""
from __future__ import annotations

import prometheus_client as prom

# Seconds: a request on a 2-core CPU takes from ~10 ms (a few tokens, tiny model) to minutes.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Request, token, latency and slot metrics, exported in Prometheus' text format."""

    def __init__(self, slots: int):
        self.registry = r = prom.CollectorRegistry(auto_describe=True)
        self.requests = prom.Counter(
            "pij_requests", "HTTP requests by endpoint and status (499: the client went away "
            "before the response was complete)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = prom.Counter("pij_prompt_tokens", "Prompt tokens prefilled",
                                          registry=r)
        self.generated_tokens = prom.Counter("pij_generated_tokens", "Tokens generated",
                                             registry=r)
        self.latency = prom.Histogram(
            "pij_request_latency_seconds", "Generation requests: arrival to last byte",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = prom.Histogram(
            "pij_time_to_first_token_seconds", "Arrival to first generated token (queueing, "
            "prefill and any compilation included)", buckets=_TTFT_BUCKETS, registry=r)
        self.slots_total = prom.Gauge("pij_slots_total", "Sequence slots (--parallel)",
                                      registry=r)
        self.slots_busy = prom.Gauge("pij_slots_busy", "Slots holding a sequence", registry=r)
        self.queue_length = prom.Gauge("pij_queue_length", "Requests waiting for a free slot",
                                       registry=r)
        self.decode_steps = prom.Counter("pij_decode_steps", "Batched decode steps", registry=r)
        self.step_seconds = prom.Histogram(
            "pij_decode_step_seconds", "Wall time of one batched decode step (Scheduler.step: "
            "the device step, reading its tokens, detokenizing)", buckets=_TTFT_BUCKETS,
            registry=r)
        self.prefill_seconds = prom.Histogram(
            "pij_prefill_seconds", "Wall time of prefilling one prompt into a slot (decode steps "
            "wait meanwhile)", buckets=_TTFT_BUCKETS, registry=r)
        self.step_sequences = prom.Histogram(
            "pij_decode_step_sequences", "Sequences advanced together by one decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.steps_planned = prom.Gauge(
            "pij_warm_steps_planned", "Compiled steps the server warms before it answers "
            "/health 200 (every prompt and cache bucket, per sampling kind)", registry=r)
        self.steps_ready = prom.Gauge(
            "pij_warm_steps_ready", "Planned compiled steps ready (loaded or compiled)",
            registry=r)
        self.steps_outside_plan = prom.Gauge(
            "pij_steps_outside_plan", "Compiled steps made for shapes outside the warm plan "
            "(a request waited for each)", registry=r)
        self.slots_total.set(slots)

    def watch_warmth(self, warmth) -> None:
        """Report a server.worker.Warmth (read when /metrics is scraped)."""
        self.steps_planned.set_function(lambda: len(warmth.plan))
        self.steps_ready.set_function(warmth.ready)
        self.steps_outside_plan.set_function(
            lambda: warmth.engine.ready_steps - warmth.ready())

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of GET /metrics."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
