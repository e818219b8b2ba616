"""Requests and continuous batching over an Engine's slots (runtime/decode.py has the engine).

A `Request` is one sequence to generate; the `Scheduler` puts requests into free slots (prefill),
advances every live sequence by one decode call (a block of steps), and reports tokens and
finished sequences. While the host reads block k's tokens, block k+1 is already dispatched on the
device with k's last tokens; a block dispatched past a sequence's end is discarded for it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from powerinfer_jax.config import SamplingParams, check_decode_block


@dataclasses.dataclass
class Request:
    """One sequence to generate. on_token(token) is called for every generated id as soon as it is
    known; returning True stops the sequence there (stop strings, a client that went away)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop_ids: Sequence[int] = ()
    on_token: Callable[[int], bool | None] | None = None


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (stop token included when one was hit)
    prompt_tokens: int
    prefill_s: float  # wall time of the first token (prefill + sampling), compile excluded
    decode_s: float  # wall time of the remaining tokens, compile excluded
    stop_reason: str  # "eos" (a stop id) | "length" (max_new_tokens) | "stop" (on_token said so)
    compile_s: float = 0.0  # compilation done by this call before timing started

    @property
    def first_token_s(self) -> float:
        """What a user waits for the first token: compilation (when cold) plus prefill."""
        return self.compile_s + self.prefill_s

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclasses.dataclass
class _Live:
    """A sequence in a slot."""

    request: Request
    slot: int
    position: int  # position of the token the next decode step consumes
    tokens: list[int]
    started: float
    first_token: object = None  # the prefill's device token, read by the next step
    tag: object = None  # the caller's name for this sequence
    first_at: float = 0.0
    ended: float = 0.0
    compile_s: float = 0.0
    waited_s: float = 0.0  # decode calls' wait for their steps (compiled or loaded)
    done: str | None = None


_IDLE = SamplingParams()


class Scheduler:
    """Continuous batching over an Engine's slots: `add` a request (prefilled at once into a free
    slot), `step` advances every live sequence by up to `block` tokens (one decode call) and
    returns the ones that finished. The server drives it from one thread (block 1); `Engine.run`
    drives it for a list of requests (the engine's decode_block)."""

    def __init__(self, engine, block: int = 1):  # a runtime.decode.Engine (which imports this)
        check_decode_block("Scheduler block", block)
        self.engine = engine
        self.block = block
        self.slots: list[_Live | None] = [None] * engine.max_batch
        # (device tokens [k, b], positions, bucket, k) of a call dispatched ahead
        self._pending = None

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.slots)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def add(self, r: Request, tag=None) -> int:
        """Prefill `r` into the lowest free slot; its first token is reported by the next step."""
        self.engine._check_request(r)
        slot = self.slots.index(None)
        c0 = self.engine.compile_s
        started = time.perf_counter()
        tok = self.engine.prefill_slot(slot, r)
        compile_s = self.engine.compile_s - c0
        self.slots[slot] = _Live(r, slot, len(r.prompt_ids), [], started + compile_s,
                                 first_token=tok, tag=tag, compile_s=compile_s)
        return slot

    def cancel(self, slot: int) -> None:
        """Free a slot now (a client went away); its sequence reports nothing more."""
        self.slots[slot] = None

    def step(self) -> list[tuple[object, GenerationResult]]:
        """Advance every live sequence by one decode call (up to `block` tokens each): report
        each new token (on_token), and return (tag, result) for the sequences that finished."""
        finished = []
        fresh = [s for s in self.slots if s is not None and not s.tokens]
        for s in fresh:  # prompts prefilled since the last step: their first token is known now
            self._accept(s, int(np.asarray(s.first_token)), first=True)
        live = [s for s in self.slots if s is not None and s.done is None]
        if live:
            toks = self._dispatch(live, fresh)
            host = np.asarray(toks)  # the sync: streaming and stop checks need the values
            for row in host:  # a sequence that stops mid-block ignores the rest
                for s in live:
                    if s.done is None and self.slots[s.slot] is s:
                        self._accept(s, int(row[s.slot]))
        for i, s in enumerate(self.slots):
            if s is not None and s.done is not None:
                self.slots[i] = None
                finished.append((s.tag, self._result(s)))
        return finished

    def _dispatch(self, live, fresh):
        """The device tokens [k, b] of this call: the call dispatched ahead last time when it
        still covers every live slot, else one dispatched now; then the next is dispatched ahead."""
        eng = self.engine
        b = eng.batch_bucket(max(s.slot for s in live) + 1)
        furthest = max(s.position for s in live)
        k = eng.block_at(furthest, self.block)
        positions = np.zeros(b, np.int32)
        seeds = np.zeros(b, np.uint32)
        params = [_IDLE] * b
        for s in live:
            positions[s.slot] = s.position
            seeds[s.slot] = s.request.seed
            params[s.slot] = s.request.sampling
        pending, self._pending = self._pending, None
        c0 = eng.compile_s  # a step got ready here: its wait is not decode time
        if pending is not None and not fresh and pending[2] == b and pending[3] == k and all(
                pending[1][s.slot] == s.position for s in live):
            toks, last = pending[0]  # rows of slots that finished since are junk, never read
        else:
            base = np.zeros(b, np.int32)
            for s in live:
                base[s.slot] = s.tokens[-1]
            toks, last = eng.decode_step(base, positions, seeds, params, k)
        # The next call on this one's last device tokens, before the host reads them, when every
        # live sequence needs tokens past this call (a sequence that stops meanwhile just wastes
        # its row; free rows write junk at position 0, which a later prefill of the slot
        # overwrites).
        if all(len(s.tokens) + k < s.request.max_new_tokens for s in live):
            nxt = positions.copy()
            for s in live:
                nxt[s.slot] = s.position + k
            k2 = eng.block_at(furthest + k, self.block)
            self._pending = (eng.decode_step(last, nxt, seeds, params, k2), nxt, b, k2)
        for s in live:
            s.waited_s += eng.compile_s - c0
        return toks

    def _accept(self, s: _Live, tok: int, first: bool = False) -> None:
        now = time.perf_counter()
        if first:
            s.first_at = now
        else:
            s.position += 1
        s.tokens.append(tok)
        r = s.request
        stop = r.on_token(tok) if r.on_token is not None else None
        if tok in r.stop_ids:
            s.done = "eos"
        elif stop:
            s.done = "stop"
        elif len(s.tokens) >= r.max_new_tokens:
            s.done = "length"
        if s.done is not None:
            s.ended = now

    def _result(self, s: _Live) -> GenerationResult:
        return GenerationResult(tokens=s.tokens, prompt_tokens=len(s.request.prompt_ids),
                                prefill_s=s.first_at - s.started,
                                decode_s=s.ended - s.first_at - s.waited_s,
                                stop_reason=s.done, compile_s=s.compile_s)
