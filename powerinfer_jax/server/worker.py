"""The engine thread: one Scheduler (continuous batching) driven by one thread, fed by the event loop.

Request handlers, on the asyncio event loop, `submit` a Job. The engine thread moves waiting jobs
into free slots between decode steps (`Scheduler.add` prefills them), advances every live sequence
by one token per step, and sends each job's text pieces and its end back to the loop with
`loop.call_soon_threadsafe`. A handler whose client went away `cancel`s its job: the engine thread
frees the slot before its next step. The queue is bounded: `submit` refuses a job when every slot
is busy and `queue_size` jobs already wait (the handler answers 429).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Sequence

from powerinfer_jax.api import _StopText
from powerinfer_jax.config import SamplingParams
from powerinfer_jax.errors import UserError
from powerinfer_jax.runtime.decode import prefill_bucket
from powerinfer_jax.runtime.scheduler import GenerationResult, Request, Scheduler

log = logging.getLogger("powerinfer_jax.server")


class Overloaded(Exception):
    """Every slot is busy and the queue is full (HTTP 429)."""


class Unavailable(Exception):
    """The server is shutting down (HTTP 503)."""


@dataclasses.dataclass
class Outcome:
    """A finished job: its text, tokens and timings."""

    text: str
    result: GenerationResult
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens)
    queued_s: float  # arrival to the prefill's start


class Job:
    """One request's generation. Its events, in order, on `events` (an asyncio.Queue read on the
    loop): ("text", piece)* (streaming only) then ("done", Outcome) or ("error", status, message).
    Created on the event loop's thread."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], *, max_tokens: int,
                 sampling: SamplingParams, seed: int, stop: Sequence[str], ignore_eos: bool,
                 stream: bool, metrics=None):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.metrics = metrics
        self.text = _StopText(tokenizer, stop, self._post_text if stream else None)
        eos = () if ignore_eos else tokenizer.eos_ids
        self.request = Request(list(prompt_ids), max_tokens, sampling, seed, eos, self._on_token)
        self.arrived = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.cancelled = False  # set by the loop (client gone), read by the engine thread
        self.slot: int | None = None

    # ------------------------------------------------------------------ engine thread
    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _post_text(self, piece: str) -> None:
        self._post(("text", piece))

    def _on_token(self, token: int) -> bool:
        if self.first_token is None:
            self.first_token = time.perf_counter()
            if self.metrics is not None:
                self.metrics.ttft.observe(self.first_token - self.arrived)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc()
        if self.cancelled:
            return True
        return self.text.feed(token)

    def finish(self, result: GenerationResult) -> None:
        self.text.finish()
        reason = "stop" if self.text.stopped or result.stop_reason == "eos" else "length"
        queued = (self.admitted or self.arrived) - self.arrived
        self._post(("done", Outcome(self.text.text, result, reason, queued)))

    def fail(self, status: int, message: str) -> None:
        self._post(("error", status, message))


class Worker:
    """Owns the Scheduler and the thread that drives it."""

    def __init__(self, engine, metrics, *, queue_size: int):
        self.engine = engine
        self.metrics = metrics
        self.queue_size = queue_size
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}  # slot -> job; written by the engine thread, locked
        self._starting = 0  # jobs taken from the queue whose prefill has not finished
        self._closing = False
        self._deadline = 0.0
        self._sched = Scheduler(engine)
        self._thread = threading.Thread(target=self._loop, name="pij-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> int:
        with self._cv:
            return len(self._running)

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue `job` for the next free slot; Overloaded when slots and queue are full."""
        with self._cv:
            if self._closing:
                raise Unavailable("the server is shutting down")
            held = len(self._running) + self._starting + len(self._waiting)
            if held >= self.engine.max_batch + self.queue_size:
                raise Overloaded(f"all {self.engine.max_batch} slots are busy and "
                                 f"{len(self._waiting)} requests are waiting (--queue "
                                 f"{self.queue_size}); retry later")
            job.metrics = self.metrics
            self._waiting.append(job)
            self.metrics.queue_length.set(len(self._waiting))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The job's client went away: drop it from the queue, or free its slot before the next
        decode step."""
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue_length.set(len(self._waiting))
            self._cv.notify()

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop taking jobs and answer the queued ones 503 now; running sequences may finish
        within `grace_s` seconds, then the rest are cancelled (503) and the thread exits."""
        with self._cv:
            now = time.perf_counter()
            self._deadline = min(self._deadline, now + grace_s) if self._closing else now + grace_s
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self.metrics.queue_length.set(0)
            self._cv.notify()
        for job in waiting:
            job.fail(503, "the server is shutting down")

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to exit; True when it has."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._closing):
                    self._cv.wait()
                if self._closing and (not self._running or time.perf_counter() >= self._deadline):
                    ending = list(self._running.values())
                    self._running.clear()
                    break
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.engine.max_batch:
                    admit.append(self._waiting.popleft())
                self._starting = len(admit)
                self.metrics.queue_length.set(len(self._waiting))
            try:
                self._iterate(admit)
            except Exception as e:  # a bug in the engine: fail what it held, keep serving
                self._engine_failed(e)
            self.metrics.slots_busy.set(len(self._running))
        for job in ending:
            self._sched.cancel(job.slot)
            job.fail(503, "the server shut down before the request finished")
        self.metrics.slots_busy.set(0)

    def _iterate(self, admit: list[Job]) -> None:
        for slot, job in list(self._running.items()):
            if job.cancelled:
                self._sched.cancel(slot)
                self._release(slot)
        for i, job in enumerate(admit):
            if job.cancelled:
                continue
            try:
                job.admitted = time.perf_counter()
                slot = self._sched.add(job.request, tag=job)
                self.metrics.prefill_seconds.observe(time.perf_counter() - job.admitted)
            except UserError as e:  # a request the handler's checks let through
                job.fail(400, str(e))
                continue
            except Exception:
                job.fail(500, "engine error while prefilling the prompt")
                with self._cv:  # the others never started: they wait for the reset engine
                    self._waiting.extendleft(reversed(admit[i + 1:]))
                    self._starting = 0
                raise
            job.slot = slot
            with self._cv:
                self._running[slot] = job
                self._starting -= 1
            self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
        with self._cv:
            self._starting = 0  # the cancelled and the refused ones
        if not self._sched.live:
            return
        self.metrics.step_sequences.observe(self._sched.live)
        t0 = time.perf_counter()
        finished = self._sched.step()
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self.metrics.decode_steps.inc()
        for job, result in finished:
            self._release(job.slot)
            if not job.cancelled:
                job.finish(result)

    def _release(self, slot: int) -> None:
        with self._cv:
            self._running.pop(slot, None)

    def _engine_failed(self, e: Exception) -> None:
        log.exception("engine failure; failing the running requests and resetting the engine")
        with self._cv:
            jobs = list(self._running.values())
            self._running.clear()
        for job in jobs:
            job.fail(500, f"engine error: {type(e).__name__}: {e}")
        self._sched = Scheduler(self.engine)
        self.engine.reset_cache()  # a failed step may have consumed (donated) the cache


def warm_plan(engine, kinds: Sequence[str] = ("any",)) -> list[tuple]:
    """The compiled steps a server warms, in the order requests need them: for each cache-length
    bucket from the shortest, the decode steps (one token a call, the server's Scheduler block)
    of every batch size, then the prefill buckets a prompt starting in that cache bucket can
    have. The first tier (`first_tier`) serves short prompts; /health answers 200 once it is
    ready and the rest warm in the background, each request waiting (503) only while the steps
    of its own start are not ready (`Warmth.missing`). kinds: the server compiles "any" only
    (runtime/sampling.py), one step per shape for greedy and sampled batches."""
    b = engine.buckets()
    plan, prefilled = [], set()
    for kv in b["kv"]:
        plan += [("decode", n, kv, kind, 1) for kind in kinds for n in b["batch"]]
        fits = [t for t in b["prefill"] if t <= kv and t not in prefilled]
        plan += [("prefill", t, kind) for kind in kinds for t in fits]
        prefilled.update(fits)
    return plan


def first_tier(plan: Sequence[tuple]) -> int:
    """How many of `plan`'s steps (warm_plan's order) come before its second cache bucket."""
    kvs = [k[2] for k in plan if k[0] == "decode"]
    if not kvs:
        return len(plan)
    second = [i for i, k in enumerate(plan) if k[0] == "decode" and k[2] > min(kvs)]
    return second[0] if second else len(plan)


class Warmth:
    """The server's warm state: which planned steps are ready (/health and /metrics report it).
    `warm` runs on the loading thread: the first tier before the engine thread starts (and
    /health says 200), the rest after, beside it; any thread may read."""

    def __init__(self, engine, plan: Sequence[tuple]):
        self.engine = engine
        self.plan = list(plan)
        self.first = first_tier(self.plan)
        self.seconds = 0.0  # the first tier's (what a first start waits for /health 200)
        self.seconds_all = 0.0  # every planned step's
        self._started: float | None = None

    def warm(self, start: int = 0, stop: int | None = None, log_every_s: float = 2.0) -> None:
        """Ready planned steps [start, stop) (loaded from the store or compiled), with a log line
        at least every `log_every_s` seconds while it takes. The first call also makes the KV
        cache (every slot's rows at the longest context: hundreds of MB zeroed and placed),
        which the first request would otherwise pay for (0.3 s of a 0.2-s request)."""
        if not self.plan:
            return
        steps = self.plan[start:stop]
        if self._started is None:
            self._started = time.perf_counter()
        t0 = last = time.perf_counter()
        if steps:
            log.info("warming %d of %d compiled steps (%s)", len(steps), len(self.plan),
                     "short prompts first: /health says 200 once they are ready" if start == 0
                     else "longer prompts, in the background: until their steps are ready they "
                     "get 503")
        for i, key in enumerate(steps):
            self.engine.prepare(key)
            if time.perf_counter() - last > log_every_s:
                last = time.perf_counter()
                log.info("warming compiled steps: %d of %d ready", self.ready(), len(self.plan))
        if start == 0:
            self.engine.cache()
            self.seconds = time.perf_counter() - t0
        if self.complete():
            self.seconds_all = time.perf_counter() - self._started
        if steps:
            log.info("warm: %d of %d compiled steps ready after %.1f s (%d loaded, %d compiled)",
                     self.ready(), len(self.plan), time.perf_counter() - self._started,
                     self.engine.loaded_count, self.engine.compile_count)

    def ready(self) -> int:
        return sum(self.engine.is_ready(k) for k in self.plan)

    def complete(self) -> bool:
        return all(self.engine.is_ready(k) for k in self.plan)

    def missing(self, n_prompt: int, kind: str) -> list[tuple]:
        """The planned steps a request of `n_prompt` tokens needs to start that are not ready:
        its prefill bucket, and the decode steps of every batch size at the cache bucket of its
        first new token (later ones are warmed before it gets there, or compiled then)."""
        e = self.engine
        need = [("prefill", prefill_bucket(n_prompt, e.max_seq_len), kind)] + [
            ("decode", b, e.kv_bucket(n_prompt), kind, 1) for b in e.buckets()["batch"]]
        planned = set(self.plan)
        return [k for k in need if k in planned and not e.is_ready(k)]

    def eta_s(self, keys: Sequence[tuple]) -> float:
        """Seconds until the planned `keys` should be ready, at the pace of the steps so far."""
        if not keys or self._started is None:
            return 0.0
        last = max(self.plan.index(k) for k in keys)
        left = sum(not self.engine.is_ready(k) for k in self.plan[:last + 1])
        done = max(self.ready(), 1)
        return left * (time.perf_counter() - self._started) / done

    def describe(self) -> dict:
        """/health's "warm" object: planned steps, those ready, and steps compiled or loaded
        since for shapes outside the plan."""
        ready = self.ready()
        return {"steps_planned": len(self.plan), "steps_ready": ready,
                "steps_outside_plan": self.engine.ready_steps - ready,
                "complete": ready == len(self.plan),
                "warm_s": round(self.seconds, 3), "warm_all_s": round(self.seconds_all, 3)}
