"""How the server and the router serve: what an open socket may cost them (a cap on
connections, within the descriptor limit), the app runner that applies it, and how they stop.

Every connection holds a file descriptor, and a process out of descriptors cannot accept a
connection, open a file or log. Timeouts bound how long a slow client keeps its socket, but a
few thousand sockets opened at once still arrive within any timeout. So one connection past
``--max-connections`` is answered 503 at once and closed, before it costs a handler. The cap
is held below the descriptor limit (``ulimit -n``), first raised to its hard limit where the
soft one is lower, as Go's runtime and nginx's ``worker_rlimit_nofile`` do.

The first SIGINT or SIGTERM asks for a graceful stop and removes the handlers, so a second is
Python's own KeyboardInterrupt (or SIGTERM's default action): it stops at once, instead of
asking to wait out the grace period again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import signal
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from server.wire import OpenAIError

log = logging.getLogger("server")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
SPARE_DESCRIPTORS = 64  # for what is not a client: the model's files, logs, the engine's pipes

# The client-facing limits, the same for the server and the router (their defaults and flags).
KEEP_ALIVE_TIMEOUT_S = 15.0
CLIENT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 2048
CLIENT_FLAGS = [
    ("--keep-alive-timeout", float, "seconds a connection may stay idle, or take to send a request's headers"),
    ("--client-timeout", float, "seconds a request's body may take to arrive (408 beyond), and one write of a "
                                "stream to leave (the stream is then cut: the client stopped reading)"),
    ("--max-connections", int, "most open connections; more are answered 503 and closed"),
]

_body = json.dumps(OpenAIError(503, "the server has too many open connections; retry shortly",
                               code="too_many_connections").body()).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_body), _body))


def connection_room(wanted: int) -> int:
    """How many connections the descriptor limit allows, at most ``wanted``: the soft limit is
    raised towards the hard one first; a lower cap than ``wanted`` is logged as a warning."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + SPARE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    room = wanted if soft == resource.RLIM_INFINITY else min(wanted, soft - SPARE_DESCRIPTORS)
    if room < wanted:
        log.warning("--max-connections lowered from %d to %d: the process may open only %d files (ulimit -n)",
                    wanted, room, soft)
    return max(room, 1)


def limit_connections(server: Any, limit: int) -> None:
    """Cap the open connections of an aiohttp ``web.Server`` at ``limit``: aiohttp reports each
    new connection (``connection_made``) before reading a byte, so one past the limit is
    answered and closed there, and the handler it would have started ends at once."""
    admit = server.connection_made

    def connection_made(handler: Any, transport: Any) -> None:
        admit(handler, transport)
        if len(server.connections) > limit:
            transport.write(BUSY)
            handler.force_close()  # closes the transport once BUSY is flushed

    server.connection_made = connection_made


@contextlib.asynccontextmanager
async def running(app: web.Application, host: str = "127.0.0.1", port: int = 0, shutdown_grace: float = 30.0,
                  keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S, max_connections: int | None = None,
                  client_timeout: float = CLIENT_TIMEOUT_S) -> AsyncIterator[str]:
    """Serve ``app`` on the running event loop and yield its URL (``port`` 0: a free one); on
    exit, in-flight requests get ``shutdown_grace`` seconds, then the app is cleaned up. A
    connection must send a request's head within ``keep_alive_timeout``; past
    ``max_connections`` open ones, a new one gets a 503."""
    # lingering_time: how long aiohttp reads (and drops) the rest of a body it refused before it
    # closes; like the body itself, that gets the client timeout
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_grace,
                           keepalive_timeout=keep_alive_timeout, lingering_time=client_timeout)
    await runner.setup()
    if max_connections is not None:
        limit_connections(runner.server, connection_room(max_connections))
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"http://{host}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def serve(app: web.Application, settings: Any, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], object] = print) -> None:
    """Serve ``app`` where ``settings`` (the server's or the router's) say until ``stop`` is set
    (by default: at the first SIGINT or SIGTERM), then shut down gracefully. ``on_ready`` gets
    the URL actually bound (``--port 0`` picks a free port)."""
    stop = stop or stop_on_signals()
    async with running(app, settings.host, settings.port, settings.shutdown_grace, settings.keep_alive_timeout,
                       settings.max_connections, settings.client_timeout) as url:
        on_ready(url)
        await stop.wait()
        log.info("shutting down: %.0f s for in-flight requests to finish", settings.shutdown_grace)


def stop_on_signals() -> asyncio.Event:
    """An event the first SIGINT or SIGTERM sets, on the running loop (call it from there)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        stop.set()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    return stop
