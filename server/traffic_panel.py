"""The dashboard's traffic panel: ``POST``/``DELETE /dashboard/traffic`` start and stop one
bounded run of the load generator inside the server, against the server's own address.

A visitor can push the server past its knee and watch latency climb, but only within bounds:
rate, duration and count are capped, one run at a time (a POST while one runs is a 409), and
the panel is off on a server with ``--api-key``.

Both routes change what the server does, so they answer the server's own page only. An HTML
form on another site can make its visitor's browser POST ``text/plain`` here without a CORS
preflight; so a POST must be ``application/json`` (which a browser sends cross-site only after
a preflight this server never grants), and a request whose ``Origin`` or ``Sec-Fetch-Site``
names another site is a 403. A request with neither (curl, a script) is no browser acting for
a visitor and passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from server.loadgen.client import LoadRun, LoadSpec
from server.loadgen.stats import Summary
from server.wire import OpenAIError, invalid, read_json

# The bounds: a visitor can overload the server, but only briefly.
MAX_TRAFFIC_RATE = 100.0
MAX_TRAFFIC_SECONDS = 120.0
MAX_TRAFFIC_REQUESTS = 5000
TRAFFIC_REQUEST_TIMEOUT_S = 30.0
SAME_ORIGIN_SITES = ("same-origin", "none")  # Sec-Fetch-Site values of the page itself, or of a typed URL


class Traffic:
    """The panel's built-in load: at most one bounded :class:`LoadRun` at a time."""

    def __init__(self, max_model_len: int, locked: bool, body_timeout: float = 30.0) -> None:
        self.max_model_len = max_model_len
        self.body_timeout = body_timeout  # the longest a posted body may take (--client-timeout)
        self.locked = locked  # the server wants an API key: no anonymous traffic
        self.load: LoadRun | None = None
        self.task: asyncio.Task | None = None
        self.summary: Summary | None = None
        self.error: str | None = None
        self.started = 0.0
        self.closed = False

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def spec_from(self, url: str, body: object) -> LoadSpec:
        """The visitor's settings, checked against the panel's bounds (400 otherwise)."""
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        rate = _bounded(body, "request_rate", MAX_TRAFFIC_RATE)
        duration = _bounded(body, "duration", MAX_TRAFFIC_SECONDS)
        input_len = _bounded(body, "input_len", self.max_model_len - 1, integer=True)
        output_len = _bounded(body, "output_len", self.max_model_len - input_len, integer=True)
        return LoadSpec(url=url, num_prompts=MAX_TRAFFIC_REQUESTS, duration=duration, request_rate=rate,
                        input_len=input_len, output_len=output_len, warmup=0,
                        request_timeout=TRAFFIC_REQUEST_TIMEOUT_S)

    def start(self, spec: LoadSpec) -> None:
        """Start a run, unless one is going (409) or the server is shutting down (503). Not a
        coroutine on purpose: nothing can run between the check and the new task, so of two
        POSTs at once exactly one starts."""
        if self.closed:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down")
        if self.running:
            raise OpenAIError(409, "a traffic run is in progress: stop it first (DELETE /dashboard/traffic)",
                              code="traffic_running")
        self.load, self.summary, self.error, self.started = LoadRun(spec), None, None, time.monotonic()
        self.task = asyncio.create_task(self.load.run())
        self.task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self.error = f"{type(task.exception()).__name__}: {task.exception()}"
        else:
            self.summary = task.result()

    async def stop(self) -> None:
        """Stop sending and cancel what is in flight; the summary covers what finished."""
        if not self.running:
            return
        self.load.stop()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), 5)

    async def close(self, app: web.Application | None = None) -> None:
        """At shutdown: end the run now, and start no other (a keep-alive connection can still
        POST while the server drains). Cancelled, not stopped and waited for: a request it has
        just sent may never be answered by a server that is closing."""
        self.closed = True
        if self.running:
            self.load.stop()
            self.task.cancel()
            await asyncio.wait([self.task])  # not `await self.task`: close() stays cancellable itself

    def status(self) -> dict:
        """The panel's line: idle, running (with counts so far), or the last run's outcome."""
        if self.load is None:
            return {"state": "idle"}
        load, spec = self.load, self.load.spec
        done = [r for r in load.results if r.ok]
        status = {"state": "running" if self.running else ("failed" if self.error else "finished"),
                  "request_rate": spec.request_rate, "input_len": spec.input_len, "output_len": spec.output_len,
                  "sent": load.sent, "completed": len(done), "failed": len(load.results) - len(done),
                  "in_flight": load.in_flight,
                  "seconds_left": round(max(0.0, spec.duration - (time.monotonic() - self.started)), 1),
                  "error": self.error}
        if self.summary is not None:
            status["output_throughput"] = self.summary.output_throughput
            status["ttft_p99_ms"] = self.summary.ttft_ms.p99
        return status


def _bounded(body: dict, name: str, high: float, integer: bool = False) -> float:
    """``body[name]``: a number in (0, high], or an integer from 1; a 400 naming it otherwise."""
    value = body.get(name)
    kinds, what = (int, f"an integer in [1, {high}]") if integer else ((int, float), f"a number in (0, {high:g}]")
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= high:
        raise invalid(f"{name} must be {what}, got {value!r}", name)
    return value if integer else float(value)


TRAFFIC = web.AppKey("traffic", Traffic)


def add_traffic(app: web.Application, max_model_len: int, *, locked: bool, body_timeout: float) -> Traffic:
    """Mount the panel's two routes, stopped at shutdown (``locked``: it takes no runs)."""
    app[TRAFFIC] = traffic = Traffic(max_model_len, locked, body_timeout)
    app.router.add_post("/dashboard/traffic", start_traffic)
    app.router.add_delete("/dashboard/traffic", stop_traffic)
    app.on_shutdown.append(traffic.close)
    return traffic


def refuse_other_sites(request: web.Request) -> None:
    """403 unless the request comes from this server's own page, or from no browser at all.
    The page's origin is the one the request addressed: its scheme and its Host header."""
    origin, site = request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site")
    own = f"{request.scheme}://{request.host}".lower()
    if (origin is not None and origin.lower() != own) or (site is not None and site not in SAME_ORIGIN_SITES):
        raise OpenAIError(403, "the traffic panel answers its own page only, not a page on another site",
                          code="cross_origin")


def own_url(request: web.Request) -> str:
    """This server's address as the visitor's connection reached it: the traffic goes there."""
    host, port = request.transport.get_extra_info("sockname")[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_traffic(request: web.Request) -> web.Response:
    """Start a run with the posted settings: 202 and the panel's status line."""
    refuse_other_sites(request)
    traffic = request.app[TRAFFIC]
    if traffic.locked:
        raise OpenAIError(403, "the traffic panel is off on a server that requires an API key",
                          code="traffic_disabled")
    if request.content_type != "application/json":
        raise OpenAIError(415, f"send the settings as application/json, not {request.content_type}")
    body = await read_json(request, traffic.body_timeout)
    traffic.start(traffic.spec_from(own_url(request), body))
    return web.json_response(traffic.status(), status=202)


async def stop_traffic(request: web.Request) -> web.Response:
    """Stop the run, if one is going: the panel's status line."""
    refuse_other_sites(request)
    await request.app[TRAFFIC].stop()
    return web.json_response(request.app[TRAFFIC].status())
