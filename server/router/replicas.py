"""The router's view of its replicas: who is healthy, how loaded each one is.

- **Active health checks**: every ``interval`` seconds, ``GET /health`` (our server answers 503
  while it shuts down) and, when that passes, ``GET /metrics`` for the load-aware policy. A
  replica is ejected after ``eject_after`` failed checks in a row and re-admitted after
  ``readmit_after`` passed ones, so one slow answer does not flap it out and one lucky answer
  does not bring a broken replica back.
- **Passive checks**: a request refused, broken, or answered 503 ejects its replica at once:
  that evidence is unambiguous, and waiting would send it more requests to fail. A replica that
  is only slow is counted, not ejected: whether it is wedged is for ``/health`` to say.

Envoy calls the two active health checking and outlier detection.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("server.router")

# The replica gauges the router reads, by their name after the ``minillm:`` (or ``vllm:``) prefix.
LOAD_GAUGES = {"num_requests_waiting": "waiting", "num_requests_running": "running",
               "kv_cache_usage_perc": "kv_usage", "prefix_cache_hit_rate": "prefix_hit_rate"}


@dataclass(eq=False)
class Replica:
    """One replica: its URL, the router's bookkeeping, and its latest scraped load."""

    url: str
    healthy: bool = True
    outstanding: int = 0  # requests this router sent and has not seen finish
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    passes: int = 0  # health checks passed in a row
    failures: int = 0  # health checks failed in a row
    requests: int = 0  # attempts sent to it
    errors: int = 0  # attempts it failed: refused, broke, timed out, or answered 429 or 5xx
    ejections: int = 0
    readmissions: int = 0


def parse_load(text: str) -> dict[str, float]:
    """The load gauges in a Prometheus text page, keyed as :class:`Replica`'s fields."""
    load = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = LOAD_GAUGES.get(sample.name.rpartition(":")[2])
            if field is not None:
                load[field] = float(sample.value)
    return load


class ReplicaSet:
    """The replicas and their health, updated by checks (:meth:`check_all`) and by requests
    (:meth:`report_failure`). New replicas start healthy: the router checks them all once
    before it takes traffic."""

    def __init__(self, urls: Sequence[str], eject_after: int = 2, readmit_after: int = 2) -> None:
        if not urls:
            raise ValueError("a router needs at least one replica")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {urls}")
        self.replicas = [Replica(u) for u in urls]
        self.eject_after, self.readmit_after = eject_after, readmit_after

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def report_failure(self, replica: Replica, reason: str) -> None:
        """A request could not reach ``replica``: eject it now (a passive check)."""
        replica.errors += 1
        replica.failures, replica.passes = max(replica.failures, self.eject_after), 0
        self._eject(replica, reason)

    def record_check(self, replica: Replica, ok: bool, load: dict[str, float] | None = None) -> None:
        """Count one active check; eject or re-admit when the run of results is long enough."""
        if ok:
            replica.passes, replica.failures = replica.passes + 1, 0
            for field, value in (load or {}).items():
                setattr(replica, field, value)
            if not replica.healthy and replica.passes >= self.readmit_after:
                replica.healthy = True
                replica.readmissions += 1
                log.warning("replica %s re-admitted after %d passed checks", replica.url, replica.passes)
        else:
            replica.failures, replica.passes = replica.failures + 1, 0
            if replica.failures >= self.eject_after:
                self._eject(replica, f"{replica.failures} failed health checks")

    def _eject(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            replica.healthy = False
            replica.ejections += 1
            replica.waiting = replica.running = replica.kv_usage = 0.0
            log.warning("replica %s ejected: %s", replica.url, reason)

    async def check(self, session: aiohttp.ClientSession, replica: Replica, timeout: float) -> None:
        """One active check: ``/health`` must answer 200; then ``/metrics`` (optional: a
        replica without one is still healthy, the load-aware policy just sees no queue)."""
        limit = aiohttp.ClientTimeout(total=timeout)
        try:
            async with session.get(f"{replica.url}/health", timeout=limit) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        load = None
        if ok:
            try:
                async with session.get(f"{replica.url}/metrics", timeout=limit) as response:
                    if response.status == 200:
                        load = parse_load(await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                load = None
        self.record_check(replica, ok, load)

    async def check_all(self, session: aiohttp.ClientSession, timeout: float) -> None:
        await asyncio.gather(*(self.check(session, r, timeout) for r in self.replicas))

    async def keep_checking(self, session: aiohttp.ClientSession, interval: float, timeout: float) -> None:
        """Check every replica every ``interval`` seconds, each check given up after
        ``timeout`` (shorter than the interval, so checks never pile up), until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.check_all(session, timeout)
