"""The engine loop: one thread steps the engine; the event loop serves HTTP around it.

``LLMEngine.step()`` takes milliseconds to seconds, during which an event loop that called it
could not accept a connection, send a token or notice a client leaving. So the engine gets a
thread of its own, the only one that ever touches it, and two one-way channels:

- **In**: a thread-safe inbox of messages (add, abort, shut down), drained between steps, so
  an abort takes effect before the next step; an idle engine blocks on it, costing nothing.
- **Out**: after every step, ``loop.call_soon_threadsafe`` hands the step's outputs and a stats
  snapshot to the event loop, which puts each output on its HTTP request's asyncio queue.

Each of a request's ``n`` choices is one engine request whose id is a :class:`Choice`, so an
output finds its request and its place in the answer without any id being parsed.

A failed step fails only the requests in its batch, and a request that cannot be admitted fails
alone; the loop goes on with everyone else. Only a bug in the loop itself, or an engine that
can no longer step at all (``EngineDead``: a split model's worker is gone, noticed within a
second even while idle), ends it: every request then gets an error and ``on_crash`` runs (the
server exits non-zero, for a supervisor to restart it). A step that never returns shows in :meth:`AsyncEngine.stalled_for`, for
``/health``.

Every timestamp is ``time.monotonic()``: the handler stamps a request's arrival, the engine its
first scheduling, each token and the finish, and a request's last output carries them back
(``times``), so queue time, TTFT and ITL are measured where the engine made the token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

from minillm.engine.llm_engine import EngineDead, EngineStats, LLMEngine, RequestOutput
from minillm.decoding.sampling import SamplingParams

log = logging.getLogger("server.engine")
IDLE_CHECK_S = 1.0  # how often an idle engine thread asks the engine whether it can still step


class QueueFull(Exception):
    """``max_queue`` requests already wait beyond the batch's free seats: come back later (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


class Rejected(Exception):
    """The engine refused a request that could never run, e.g. too big for the pool (HTTP 400)."""


class EngineFailure(Exception):
    """The engine failed while working on this request (HTTP 500)."""


class Choice(NamedTuple):
    """Choice ``index`` of the ``count`` that HTTP request ``request_id`` asked for: the id of
    the engine request that generates it."""

    request_id: str
    index: int
    count: int

    def __repr__(self) -> str:  # as the engine's messages name a request
        return f"{self.request_id!r} (choice {self.index})"


@dataclass
class Event:
    """One step's output for choice ``index`` of a request."""

    index: int
    output: RequestOutput


@dataclass
class _Add:
    ids: list[Choice]
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival: float


@dataclass
class _Abort:
    ids: list[Choice]


@dataclass
class _Shutdown:
    """End requests because the server is stopping: those never scheduled (``queued_only``),
    or, once the grace period is over, every unfinished one."""

    queued_only: bool = False


_STOP = object()


class RequestStream:
    """One HTTP request's view of the engine: iterate it for :class:`Event` s until every
    choice has finished (the request's error is raised from the iteration). Always ``close()``
    it in a ``finally``, so a handler that stops early, for whatever reason, aborts what has not
    finished and gives its KV blocks back."""

    def __init__(self, engine: AsyncEngine, request_id: str, choices: int) -> None:
        self.request_id = request_id
        self.choices = [Choice(request_id, i, choices) for i in range(choices)]
        self._engine = engine
        self._queue: asyncio.Queue[Event | Exception] = asyncio.Queue()
        self._head: Event | None = None
        self.unfinished = set(self.choices)

    def put(self, item: Event | Exception) -> None:
        self._queue.put_nowait(item)

    async def ready(self) -> None:
        """Wait for the first output, raising the request's error if the engine refused it.
        A handler waits here before it commits to a status code."""
        self._head = await self._next_item()

    async def _next_item(self) -> Event:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._head is None and not self.unfinished:
            raise StopAsyncIteration
        item, self._head = self._head or await self._next_item(), None
        if item.output.finished:
            self.unfinished.discard(item.output.request_id)
        return item

    def close(self) -> int:
        """Stop listening and abort the unfinished choices; returns how many there were."""
        return self._engine._release(self)


class AsyncEngine:
    """An ``LLMEngine`` driven by its own thread, used from asyncio (vLLM's AsyncLLMEngine).
    ``stats``, its latest snapshot, is replaced on the event loop after every step: no lock."""

    def __init__(self, engine: LLMEngine, max_queue: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.clock = clock  # times steps for stalled_for (a test passes a fake one)
        self.max_queue = max_queue
        self.stats: EngineStats = engine.stats()
        self.accepting = True
        self._stats_changed: asyncio.Future | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # by HTTP request id; event-loop side only
        self._outbox: list[tuple[Choice, RequestOutput | Exception]] = []  # engine-thread side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._crashed = False
        self.on_crash: Callable[[], None] = lambda: None  # runs on the event loop if the loop dies
        self._step_started: float | None = None  # monotonic start of the step in progress, if any

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._crashed

    def stalled_for(self) -> float:
        """Seconds the step in progress has run; 0 between steps (an idle engine never stalls)."""
        started = self._step_started  # one read: the engine thread may clear it meanwhile
        return 0.0 if started is None else max(self.clock() - started, 0.0)

    def submit(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
               arrival: float) -> RequestStream:
        """Queue one engine request per choice (a :class:`Choice`) and return their stream."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        stream = self._streams[request_id] = RequestStream(self, request_id, len(prompts))
        self._inbox.put(_Add(stream.choices, prompts, params, arrival))
        return stream

    def _release(self, stream: RequestStream) -> int:
        """Forget ``stream`` and ask the engine thread to abort its unfinished choices."""
        self._streams.pop(stream.request_id, None)
        unfinished = len(stream.unfinished)
        if unfinished:
            self._inbox.put(_Abort(sorted(stream.unfinished)))
            stream.unfinished.clear()
        return unfinished

    async def wait_until(self, predicate: Callable[[EngineStats], bool]) -> EngineStats:
        """The first stats snapshot, now or after a later step, for which ``predicate`` holds:
        e.g. ``lambda s: s.running + s.waiting == 0`` waits until every abort has landed."""
        while not predicate(self.stats):
            if self._stats_changed is None:
                self._stats_changed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._stats_changed)  # a cancelled waiter leaves it to the others
        return self.stats

    async def stop(self) -> None:
        """Refuse new work, abort what is left, and wait for the thread to end."""
        self.accepting = False
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join)

    def deliver(self, items: list, stats: EngineStats) -> None:
        """On the event loop: route each output or error to the stream waiting for it."""
        self.stats = stats
        if self._stats_changed is not None:
            self._stats_changed.set_result(None)
            self._stats_changed = None
        for choice, item in items:
            stream = self._streams.get(choice.request_id)
            if stream is not None:
                stream.put(item if isinstance(item, Exception) else Event(choice.index, item))

    def refuse_queued(self) -> None:
        """Shutting down: every request still queued and never scheduled gets ShuttingDown
        (503) now, rather than wait out the grace period for a slot it may never get. The
        engine thread decides what is still queued, so a request that starts meanwhile runs on."""
        self._inbox.put(_Shutdown(queued_only=True))

    def cut_off(self) -> None:
        """The grace period is over: every unfinished request gets ShuttingDown, so a stream
        ends with an error event and ``[DONE]`` instead of a bare close of its connection."""
        self._inbox.put(_Shutdown())

    def _fail_everyone(self) -> None:
        for stream in list(self._streams.values()):
            stream.put(EngineFailure("the engine loop stopped"))
        self.on_crash()

    # ------------------------------------------------------------------ engine-thread side

    def run(self) -> None:
        """The engine thread's whole life (``start`` runs it): apply the inbox, step, publish,
        until told to stop. Only this thread ever touches the engine."""
        try:
            while self.apply_messages():
                if self.engine.has_unfinished:
                    self._step()
                self.publish()
            self.publish()
        except BaseException as err:  # a bug in the loop itself, or a dead engine: report it, fail every request
            if isinstance(err, EngineDead):
                log.error("the engine cannot go on: %s", err)
            else:
                log.exception("the engine loop crashed")
            self._crashed = True
            self._loop.call_soon_threadsafe(self._fail_everyone)

    def apply_messages(self) -> bool:
        """Apply every message in the inbox, first waiting for one if there is no work (an
        idle engine sleeps here). False once told to stop."""
        block = not self.engine.has_unfinished
        while True:
            try:
                message = self._inbox.get(block=block, timeout=IDLE_CHECK_S if block else None)
            except queue.Empty:
                if not block:
                    return True
                self.engine.check_alive()  # idle: a split model's lost worker ends the loop now, not at the next request
                continue
            block = False
            if message is _STOP:
                self._shut_down(_Shutdown())
                return False
            if isinstance(message, _Shutdown):
                self._shut_down(message)
            elif isinstance(message, _Abort):
                self._abort(message.ids)
            else:
                self._add(message)

    def _add(self, message: _Add) -> None:
        """Queue all of a request's choices, or none: a full queue or a request the engine
        refuses (one that could never fit in the pool) is answered with an error instead."""
        if self.engine.num_queued >= self.max_queue:
            self._outbox.append((message.ids[0], QueueFull(f"{self.max_queue} requests are already waiting")))
            return
        try:
            for choice, prompt, params in zip(message.ids, message.prompts, message.params):
                self.engine.add_request(choice, prompt, params, message.arrival)
        except Exception as err:  # whatever one request raises ends that request, never the loop
            self._abort(message.ids)  # the choices already queued, if any
            if isinstance(err, ValueError):
                self._outbox.append((message.ids[0], Rejected(str(err))))
            else:
                log.exception("admitting request %s failed", message.ids[0].request_id)
                self._outbox.append((message.ids[0], EngineFailure(f"the request could not be admitted: "
                                                                   f"{type(err).__name__}")))

    def _shut_down(self, message: _Shutdown) -> None:
        if not message.queued_only:
            error = ShuttingDown("the server shut down before this request finished")
            self._abort(self.engine.unfinished_request_ids, error)
            return
        queued = self.engine.queued_request_ids
        waiting = Counter(choice.request_id for choice in queued)  # a request's choices still queued
        error = ShuttingDown("the server is shutting down; this request had not started")
        self._abort([choice for choice in queued if waiting[choice.request_id] == choice.count], error)

    def _abort(self, ids: list[Choice], error: Exception | None = None) -> None:
        """Abort the unfinished requests among ``ids``; each gets ``error``, if one is given."""
        aborted = [choice for choice in ids if self.engine.abort(choice)]
        if error is not None:
            self._outbox.extend((choice, error) for choice in aborted)

    def _step(self) -> None:
        self._step_started, previous = self.clock(), self.engine.last_step
        try:
            outputs = self.engine.step()
        except EngineDead:  # no later step can succeed either: the loop ends, and the server exits
            raise
        except Exception as err:
            batch = self.engine.last_step
            self._fail_batch(err, None if batch is previous else [chunk.seq.request_id for chunk in batch.chunks])
            return
        finally:
            self._step_started = None
        self._outbox.extend((out.request_id, out) for out in outputs)

    def _fail_batch(self, err: Exception, batch: list[Choice] | None) -> None:
        """End the requests of the step that raised, ``batch``, and nobody else; those it had
        finished too, as their last outputs are lost. If the batch is unknown (scheduling
        failed), end every request, or the same failure would repeat."""
        log.exception("an engine step failed; ending the requests in its batch")
        error = EngineFailure(f"the engine failed while {'scheduling' if batch is None else 'generating'}: "
                              f"{type(err).__name__}: {err}")
        if batch is None:
            self._abort(self.engine.unfinished_request_ids, error)
            return
        ids = list(dict.fromkeys(batch))
        self._abort(ids)
        self._outbox.extend((choice, error) for choice in ids)

    def publish(self) -> None:
        """Hand this pass's outputs and a fresh stats snapshot to the event loop, in one wake-up."""
        items, self._outbox = self._outbox, []
        self._loop.call_soon_threadsafe(self.deliver, items, self.engine.stats())
