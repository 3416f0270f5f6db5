"""Continuous batching: one thread runs ``engine.step()`` over the active batch.

Requests join through a thread-safe inbox and are handed to the engine between steps;
after every step each request's newly committed tokens go to its asyncio queue (on the
event loop that owns it, via ``call_soon_threadsafe``), and finished or aborted requests
leave at once. Only this thread touches the engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..sequence import Sequence
from .metrics import ServerMetrics

log = logging.getLogger("specdec.server")


@dataclass
class Update:
    """What one engine step produced for one request."""

    token_ids: list[int]  # newly committed output tokens
    logprobs: list = field(default_factory=list)  # their TokenLogprobs (logprob, rank, top), when asked for
    finish_reason: str | None = None  # set on the request's last update
    text: str | None = None  # final text where the engine cut it (a stop string; a stop token or EOS left out; else decode the ids)
    error: str | None = None  # the engine failed: the request ends without output
    failure: Exception | None = None  # what the request's own code raised (a logits processor), if that was it


async def merged_updates(reqs: list["ServerRequest"]):
    """``(i, update)`` for the updates of ``reqs[i]``, all of them in the order they come,
    until each request has had its last (a finish reason or an error). Close it early with
    ``contextlib.aclosing``, so that its readers stop at once."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: ServerRequest) -> None:
        while True:
            u = await req.queue.get()
            merged.put_nowait((i, u))
            if u.finish_reason or u.error:
                return

    pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        left = len(reqs)
        while left:
            i, u = await merged.get()
            left -= bool(u.finish_reason or u.error)
            yield i, u
    finally:
        for task in pumps:
            task.cancel()


class QueueFull(Exception):
    pass


class Closing(Exception):
    """The server is shutting down (``Scheduler.close``): no new requests."""


class ServerRequest:
    """One HTTP request's generation, shared by its handler and the scheduler thread."""

    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.seq = seq
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.arrival = time.perf_counter()
        # scheduler-side bookkeeping
        self.sent = 0  # output tokens already pushed
        self.admitted = False
        self.last_output_at: float | None = None
        self.drafted = self.accepted = 0
        self.per_pos: list[int] = []
        self.finished = False  # the final update was pushed

    def push(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Scheduler:
    def __init__(self, engine, metrics: ServerMetrics, num_slots: int, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.num_slots = num_slots
        self.capacity = num_slots + max_queue  # running + waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.outstanding = 0  # accepted, not yet finished
        self.active: list[ServerRequest] = []  # scheduler thread only
        self.error: str | None = None  # set when the engine failed beyond recovery
        self.closing = False  # shutting down: no new requests
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)

    # --- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """End the thread (its running and queued requests end with finish reason abort);
        ``timeout``: seconds to wait for a step under way (None: as long as it takes)."""
        self._stop = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, reqs: list[ServerRequest]) -> None:
        """Queue all of ``reqs`` (one HTTP request's completions) or, at capacity, none
        (``QueueFull``: nothing of them is held or counted)."""
        with self.lock:
            if self.closing:
                raise Closing("the server is shutting down")
            if self.outstanding + len(reqs) > self.capacity:
                raise QueueFull(f"the server is at capacity ({self.num_slots} running + "
                                f"{self.capacity - self.num_slots} queued requests); retry later")
            self.outstanding += len(reqs)
        for req in reqs:
            self.inbox.put(("add", req))
        self.wake.set()

    def close(self) -> None:
        """The server is shutting down: refuse new requests (``closing``) and abort every
        one accepted, so that each ends now with finish reason ``abort`` (streams with their
        last chunk) rather than being cut when the server's grace period ends (vLLM's)."""
        with self.lock:
            self.closing = True
        self.inbox.put(("abort_all", None))
        self.wake.set()

    def abort(self, req: ServerRequest) -> None:
        """Remove ``req`` (client gone, stream cancelled); its KV slot is freed at the next step."""
        self.inbox.put(("abort", req))
        self.wake.set()

    # --- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._drain()
            if self.engine.has_work:
                try:
                    self.engine.step()
                except Exception as e:  # a bug, not input (input is validated): fail the batch
                    log.exception("engine step failed; aborting %d requests", len(self.active))
                    self._fail_all(f"internal error in the engine: {type(e).__name__}: {e}")
            self._publish()
            self._gauges()
            if not self.engine.has_work and self.inbox.empty():
                self.wake.wait(timeout=1.0)
                self.wake.clear()
        for req in list(self.active):  # shutting down
            self.engine.abort(req.seq)
        self._publish()
        while True:  # requests that came after the last drain: they end unstarted
            try:
                kind, req = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and not req.finished:
                req.seq.finish_reason = req.seq.finish_reason or "abort"
                req.finished = True
                req.push(Update([], finish_reason="abort"))
                with self.lock:
                    self.outstanding -= 1

    def _drain(self) -> None:
        while True:
            try:
                kind, req = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.active.append(req)
                self.engine.add(req.seq)
            elif kind == "abort_all":
                for r in self.active:
                    if not r.finished:
                        self.engine.abort(r.seq)
            elif not req.finished:
                self.engine.abort(req.seq)

    def _fail_all(self, message: str) -> None:
        for req in self.active:
            req.push(Update([], finish_reason="error", error=message))
        try:
            self.engine.fail([req.seq for req in self.active])  # frees every slot and drafter state
        except Exception:
            log.exception("the engine could not recover; the server stops accepting requests")
            self.error = message
            self._stop = True

    def _publish(self) -> None:
        """Push each request's new tokens; finished ones leave."""
        now = time.perf_counter()
        m = self.metrics
        still = []
        for req in self.active:
            s = req.seq
            if not req.admitted and s.slot >= 0:
                req.admitted = True
                m.prompt_tokens.inc(s.prompt_len)
                m.queue_time.observe(max(0.0, s.admitted.at - req.arrival))
            self._spec_counters(req)
            new = s.ids[s.prompt_len + req.sent:]
            if new:
                m.generation_tokens.inc(len(new))
                if req.last_output_at is None:
                    m.ttft.observe(now - req.arrival)
                else:
                    m.itl.observe(now - req.last_output_at)
                req.last_output_at = now
            lps = s.token_logprobs[req.sent:req.sent + len(new)] if s.logprobs is not None else []
            req.sent += len(new)
            if s.finished:
                req.finished = True
                if s.failure is not None:  # its logits processor raised (the batch went on)
                    req.push(Update([], finish_reason="error", error=f"{type(s.failure).__name__}: {s.failure}",
                                    failure=s.failure))
                elif s.finish_reason != "error":  # (a failed step's requests have their error update)
                    req.push(Update(new, lps, s.finish_reason, s.text))
                m.success(s.finish_reason).inc()
                m.e2e.observe(now - req.arrival)
                with self.lock:
                    self.outstanding -= 1
            else:
                if new:
                    req.push(Update(new, lps))
                still.append(req)
        self.active = still

    def _spec_counters(self, req: ServerRequest) -> None:
        sm, m = req.seq.metrics, self.metrics
        drafted, accepted = sm.drafted_tokens - req.drafted, sm.accepted_tokens - req.accepted
        if drafted:
            m.num_drafts.inc()
            m.num_draft_tokens.inc(drafted)
        if accepted:
            m.num_accepted_tokens.inc(accepted)
        for i, count in enumerate(sm.accepted_per_position):
            delta = count - (req.per_pos[i] if i < len(req.per_pos) else 0)
            if delta:
                m.accepted_at(i).inc(delta)
        req.drafted, req.accepted = sm.drafted_tokens, sm.accepted_tokens
        req.per_pos = list(sm.accepted_per_position)

    def _gauges(self) -> None:
        e, m = self.engine, self.metrics
        running = len(e.running)
        m.running.set(running)
        with self.lock:
            m.waiting.set(max(0, self.outstanding - running))
        m.kv_slots_used.set(self.num_slots - len(e.free_slots))
        m.kv_tokens.set(sum(e.cache.lengths[s.slot] for s in e.running))
        m.prefix_tokens.set(sum(map(len, e.retained.values())))
