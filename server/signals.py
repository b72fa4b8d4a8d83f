"""How the server and the router stop: the first SIGINT or SIGTERM asks for a graceful stop,
and a second one stops at once.

Both programs wait on an event that the first signal sets. That signal also removes the
handlers, so a second Ctrl+C is Python's own KeyboardInterrupt (and a second SIGTERM the
default action), instead of a request to wait out the grace period again.
"""

from __future__ import annotations

import asyncio
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
