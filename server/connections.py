"""What an open socket may cost the server: a cap on connections, within the descriptor limit.

Every connection holds a file descriptor, and a process that runs out of descriptors cannot
accept a connection, open a file or log to one. Timeouts bound how long a slow client keeps
its socket (``--keep-alive-timeout`` for the request's head, ``--client-timeout`` for its
body and for stream writes), but a few thousand sockets opened at once still arrive within any
timeout. So the server counts its connections: one past ``--max-connections`` is answered
503 at once, in OpenAI's error shape, and closed, before it costs a handler. The cap is held
below the process's descriptor limit (``ulimit -n``), which is first raised to its hard
limit where the soft one is lower, as Go's runtime and nginx's ``worker_rlimit_nofile`` do.
"""

from __future__ import annotations

import json
import logging
import resource
from typing import Any

from server.wire import OpenAIError

log = logging.getLogger("server")

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

_body = json.dumps(OpenAIError(503, "the server has too many open connections; retry shortly", "server_error",
                               None, "too_many_connections").body()).encode()
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
    """Cap the open connections of an aiohttp ``web.Server`` (``AppRunner.server``) at ``limit``.

    aiohttp tells its server of each new connection (``connection_made``) before it reads a
    byte from it; past the limit the answer is written there and the connection closed, so
    the handler it would have started ends at once.
    """
    admit = server.connection_made

    def connection_made(handler: Any, transport: Any) -> None:
        admit(handler, transport)
        if len(server.connections) > limit:
            transport.write(BUSY)
            handler.force_close()  # closes the transport once BUSY is flushed

    server.connection_made = connection_made
