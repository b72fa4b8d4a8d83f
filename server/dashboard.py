"""The live dashboard (chapter 11): ``GET /`` shows the server's vital signs as they move.

One sampler task per server reads the engine's latest stats and the ``/metrics`` histograms
every ``TICK_S`` into one small JSON snapshot, encoded once as a server-sent event and sent to
every open page (``GET /dashboard/events``); a page that connects gets the recent history
first, so its charts start full. TTFT and ITL percentiles are the histograms' bucket counts
differenced over ``LATENCY_WINDOW_S`` and read as Prometheus' ``histogram_quantile`` reads
them: server-side, and only as exact as their buckets, unlike the load generator's.

No page can cost the server much: at most ``MAX_SUBSCRIBERS`` watch at once (the next gets a
503), and a page that stops reading is cut off after ``--client-timeout`` on one write.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from aiohttp import web
from prometheus_client import Histogram

from server.engine_loop import AsyncEngine
from server.metrics import Metrics
from server.traffic_panel import add_traffic
from server.wire import SSE_HEADERS, OpenAIError, sse, write_within


STATIC = Path(__file__).resolve().parent / "static"
TICK_S = 0.5
HISTORY = 240  # snapshots a page receives when it connects: two minutes
RATE_WINDOW_S = 2.0
LATENCY_WINDOW_S = 30.0
QUANTILES = (0.5, 0.95, 0.99)
MAX_SUBSCRIBERS = 64  # pages watching at once
SUBSCRIBER_RETRY_AFTER_S = 5


def histogram_quantile(bounds: Sequence[float], cumulative: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, as Prometheus estimates it: find the bucket
    holding rank ``q * total`` and interpolate linearly inside it (the first bucket starts at
    0). A rank in the ``+Inf`` bucket returns the largest finite bound. None when empty."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, count in enumerate(cumulative) if count >= rank)
    if math.isinf(bounds[i]):
        return bounds[i - 1] if i > 0 else None
    lower, below = (bounds[i - 1], cumulative[i - 1]) if i > 0 else (0.0, 0.0)
    return lower + (bounds[i] - lower) * (rank - below) / (cumulative[i] - below)


def buckets(histogram: Histogram) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A histogram's upper bounds and cumulative counts, ``+Inf`` last."""
    samples = [s for s in histogram.collect()[0].samples if s.name.endswith("_bucket")]
    return tuple(float(s.labels["le"]) for s in samples), tuple(s.value for s in samples)


@dataclass(frozen=True)
class Counters:
    """The cumulative counts one tick reads; a window is the difference of two of these."""

    time: float
    tokens: int
    finished: float
    ttft: tuple[float, ...]
    itl: tuple[float, ...]


class StatsFeed:
    """Samples the server every ``TICK_S`` and hands each snapshot to every open page, as one
    server-sent event encoded once: its ``history`` holds the events' bytes, not the snapshots.
    ``write_timeout`` is the longest one event may take to leave for a page (``--client-timeout``).
    (``clock`` times the snapshots; a test passes a fake one to check the rates exactly.)"""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, traffic: Callable[[], dict],
                 clock: Callable[[], float] = time.monotonic, write_timeout: float = 30.0) -> None:
        self._engine, self._metrics, self._traffic, self._clock = engine, metrics, traffic, clock
        self.write_timeout = write_timeout
        self._bounds = {"ttft": buckets(metrics.ttft)[0], "itl": buckets(metrics.itl)[0]}
        self._counters: deque[Counters] = deque(maxlen=int(LATENCY_WINDOW_S / TICK_S) + 1)
        self.history: deque[bytes] = deque(maxlen=HISTORY)
        self.subscribers = 0  # pages whose event stream is open (``events`` counts them)
        self._ticks = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._started = clock()
        self.closed = False

    async def start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self, app: web.Application | None = None) -> None:
        """End every page's stream (graceful shutdown must not wait for them) and the sampler."""
        self.closed = True
        async with self._changed:
            self._changed.notify_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            self.history.append(sse(self.snapshot()))
            self._ticks += 1
            async with self._changed:
                self._changed.notify_all()
            await asyncio.sleep(TICK_S)

    async def updates(self) -> AsyncIterator[bytes]:
        """The recent history, then each new snapshot as it is taken, until the feed closes:
        each an encoded event, the same bytes object for every page."""
        seen = self._ticks
        for event in list(self.history):
            yield event
        while not self.closed:
            async with self._changed:
                await self._changed.wait_for(lambda: self._ticks > seen or self.closed)
            if self.closed:
                return
            seen = self._ticks
            yield self.history[-1]

    def snapshot(self) -> dict:
        """Now, as the page shows it: rates over ``RATE_WINDOW_S``, latency percentiles (ms)
        over ``LATENCY_WINDOW_S``, and the engine's current state."""
        now = Counters(self._clock(), self._engine.stats.generated_tokens, buckets(self._metrics.e2e)[1][-1],
                       buckets(self._metrics.ttft)[1], buckets(self._metrics.itl)[1])
        self._counters.append(now)
        back = min(len(self._counters) - 1, int(RATE_WINDOW_S / TICK_S))
        then, oldest = self._counters[-1 - back], self._counters[0]
        elapsed = now.time - then.time
        stats = self._engine.stats
        return {
            "t": round(now.time - self._started, 2),
            "tokens_per_s": round((now.tokens - then.tokens) / elapsed, 1) if elapsed > 0 else 0.0,
            "requests_per_s": round((now.finished - then.finished) / elapsed, 2) if elapsed > 0 else 0.0,
            "running": stats.running,
            "waiting": stats.waiting,
            "batch_size": stats.batch_size if stats.running else 0,
            "kv_cache_usage": round(stats.kv_cache_usage, 4),
            "preemptions": stats.preemptions,
            "ttft_ms": self._window_quantiles("ttft", now.ttft, oldest.ttft),
            "itl_ms": self._window_quantiles("itl", now.itl, oldest.itl),
            "traffic": self._traffic(),
        }

    def _window_quantiles(self, name: str, now: tuple[float, ...], then: tuple[float, ...]) -> dict:
        window = [a - b for a, b in zip(now, then)]
        values = (histogram_quantile(self._bounds[name], window, q) for q in QUANTILES)
        return {f"p{round(q * 100)}": None if v is None else round(v * 1e3, 2) for q, v in zip(QUANTILES, values)}


FEED = web.AppKey("dashboard_feed", StatsFeed)


def add_dashboard(app: web.Application, engine: AsyncEngine, metrics: Metrics, max_model_len: int, *,
                  locked: bool, client_timeout: float) -> None:
    """Mount the page, its static files, the event stream and the traffic panel
    (``locked``: the server wants an API key, so the traffic panel takes no anonymous runs;
    ``client_timeout`` bounds each write to a page and the wait for a posted body)."""
    traffic = add_traffic(app, max_model_len, locked=locked, body_timeout=client_timeout)
    app[FEED] = feed = StatsFeed(engine, metrics, traffic.status, write_timeout=client_timeout)
    app.router.add_get("/", index)
    app.router.add_static("/dashboard/static", STATIC)
    app.router.add_get("/dashboard/events", events)
    app.on_startup.append(feed.start)
    app.on_shutdown.append(feed.close)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the history, then one snapshot per tick until the page leaves or
    the server stops. Past ``MAX_SUBSCRIBERS`` pages a new one gets a 503 to retry later."""
    feed = request.app[FEED]
    if feed.subscribers >= MAX_SUBSCRIBERS:
        raise OpenAIError(503, f"{MAX_SUBSCRIBERS} pages are watching already; retry shortly",
                          code="too_many_subscribers", headers={"Retry-After": str(SUBSCRIBER_RETRY_AFTER_S)})
    feed.subscribers += 1
    try:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await _relay(request, response, feed)
        return response
    finally:  # however the stream ends, even by the handler's cancellation when the page leaves
        feed.subscribers -= 1


async def _relay(request: web.Request, response: web.StreamResponse, feed: StatsFeed) -> None:
    """Write the feed's events to one page, each within the feed's ``write_timeout``: past it
    the page has stopped reading and the socket's buffers are full, so its connection is
    dropped, with what is buffered for it, instead of waited on for ever."""
    with contextlib.suppress(ConnectionResetError):  # the page went away, or stopped reading
        async with contextlib.aclosing(feed.updates()) as updates:
            async for event in updates:
                await write_within(request, response, event, feed.write_timeout)
        await write_within(request, response, None, feed.write_timeout)
