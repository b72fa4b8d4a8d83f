"""``python -m server.router``: one OpenAI-compatible address in front of several replicas.

A request's body goes to the replica the policy picks among the healthy ones, and the answer
comes back; streams are relayed event by event, never buffered, so the client's time to first
token is the replica's plus one hop (failures: :mod:`server.router.proxy`). The router keeps
its own ``/health`` (200 while any replica is healthy) and ``/metrics``, and every answer names
its replica in an ``X-Replica`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minillm.cli import UsageError, run
from minillm.settings import preset_dir, resolve_checkpoint
from server.connections import serve
from server.launch import ServerProcess, start_server, stop_all
from server.router.replicas import ReplicaSet
from server.router.config import RouterConfig, parse_router_args
from server.router.proxy import ROUTER, RouterState, proxy
from server.router.policy import POLICIES
from server.wire import openai_errors

log = logging.getLogger("server.router")


def create_router(urls: Sequence[str], config: RouterConfig) -> web.Application:
    """The router app over the replicas at ``urls``."""
    replicas = ReplicaSet(urls, config.eject_after, config.readmit_after)
    state = RouterState(replicas, POLICIES[config.policy](), config)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[openai_errors("router", log)])
    app[ROUTER] = state
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.router.add_post(path, proxy)
    for path in ("/v1/models", "/v1/models/{model:.+}"):
        app.router.add_get(path, proxy)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    """Open the upstream session, check every replica once, then keep checking."""
    state = app[ROUTER]
    state.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    await state.replicas.check_all(state.session, state.config.health_timeout)
    state.checker = asyncio.create_task(state.replicas.keep_checking(state.session, state.config.health_interval,
                                                                     state.config.health_timeout))


async def _stop(app: web.Application) -> None:
    state = app[ROUTER]
    if state.checker is not None:
        state.checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.checker
    if state.session is not None:
        await state.session.close()


# ----------------------------------------------------------------------------- the router's own routes


async def health(request: web.Request) -> web.Response:
    """200 while at least one replica is healthy, with each replica's state."""
    replicas = request.app[ROUTER].replicas.replicas
    ok = any(r.healthy for r in replicas)
    return web.json_response({"status": "ok" if ok else "unavailable",
                              "replicas": {r.url: "healthy" if r.healthy else "ejected" for r in replicas}},
                             status=200 if ok else 503)


class RouterCollector:
    """The router's numbers as Prometheus metrics, read from its state at scrape time."""

    PREFIX = "minillm_router:"

    def __init__(self, state: RouterState) -> None:
        self.state = state

    def collect(self) -> Iterator:
        p, s = self.PREFIX, self.state
        requests = CounterMetricFamily(p + "requests", "Proxied requests by the status the client got.",
                                       labels=["status"])
        for status, n in sorted(s.statuses.items()):
            requests.add_metric([str(status)], n)
        yield requests
        yield CounterMetricFamily(p + "retries", "Attempts on another replica after one did not take the request.",
                                  s.retries)
        yield CounterMetricFamily(p + "midstream_failures", "Streams cut by a replica after their first event.",
                                  s.midstream_failures)
        per_replica = [  # (kind, name, help, the Replica field it reads)
            (GaugeMetricFamily, "replica_healthy", "1 if the replica takes traffic, 0 if ejected.", "healthy"),
            (GaugeMetricFamily, "replica_outstanding", "Requests sent to it and not finished.", "outstanding"),
            (GaugeMetricFamily, "replica_waiting", "Its waiting requests, as last scraped.", "waiting"),
            (GaugeMetricFamily, "replica_kv_cache_usage_perc", "Its KV-cache usage, 0..1, as last scraped.",
             "kv_usage"),
            (GaugeMetricFamily, "replica_prefix_cache_hit_rate", "Its prefix-cache hit rate, as last scraped.",
             "prefix_hit_rate"),
            (CounterMetricFamily, "replica_requests", "Attempts sent to it.", "requests"),
            (CounterMetricFamily, "replica_errors", "Attempts it failed: refused, broke, timed out, or answered 429 "
             "or 5xx.", "errors"),
            (CounterMetricFamily, "replica_ejections", "Times it was taken out of rotation.", "ejections"),
        ]
        for kind, name, text, attribute in per_replica:
            family = kind(p + name, text, labels=["replica"])
            for r in s.replicas.replicas:
                family.add_metric([r.url], float(getattr(r, attribute)))
            yield family


async def metrics(request: web.Request) -> web.Response:
    registry = CollectorRegistry()
    registry.register(RouterCollector(request.app[ROUTER]))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ----------------------------------------------------------------------------- running it


def spawn_replicas(config: RouterConfig) -> list[ServerProcess]:
    """Start ``config.spawn`` servers at once, each on a free port; stop them all if one fails."""
    try:
        checkpoint = resolve_checkpoint(config.checkpoint or preset_dir("cpu"))
    except FileNotFoundError as err:
        raise UsageError(f"--checkpoint: {err} (train one with `make serve` first, or name one)") from None
    with ThreadPoolExecutor(config.spawn) as pool:
        futures = [pool.submit(start_server, checkpoint, *config.replica_flags()) for _ in range(config.spawn)]
    started, problems = [], []
    for future in futures:
        try:
            started.append(future.result())
        except RuntimeError as err:
            problems.append(str(err))
    if problems:
        stop_all(started)
        raise UsageError(f"--spawn: a replica did not start: {problems[0]}")
    return started


async def _until_signalled(app: web.Application, config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM, printing the address once listening; a second Ctrl+C
    stops at once (:func:`server.connections.stop_on_signals`)."""
    urls = ", ".join(r.url for r in app[ROUTER].replicas.replicas)
    await serve(app, config, on_ready=lambda url: print(f"minillm router ({config.policy}) serving at {url} over "
                                                        f"{urls}   (Ctrl+C to stop)", flush=True))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_router_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    spawned = spawn_replicas(config) if config.spawn else []
    if spawned:
        log.info("spawned %d replicas in %.1f s", len(spawned), time.monotonic() - started)
    try:
        app = create_router(config.replicas + [s.url for s in spawned], config)
        asyncio.run(_until_signalled(app, config))
    except KeyboardInterrupt:  # a second Ctrl+C: whoever pressed it will not wait out the replicas' grace
        for server in spawned:
            server.kill()
        raise  # minillm.cli.run prints "interrupted" and exits 130
    finally:
        stop_all(spawned)  # side by side; at once if they were killed
    return 0


if __name__ == "__main__":
    run(main, prog="python -m server.router")
