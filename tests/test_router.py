"""The router (``server.router``): policies, replica health, failover, streams, cancellation.

Policies and health bookkeeping are pure and tested with plain objects. Everything else runs
the real router app on a real socket in front of *fake* replicas: small aiohttp apps that
stream, refuse, die mid-stream or stall on command, so each failure happens exactly when the
test wants it. ``test_router_live.py`` puts the router in front of real ``python -m server``s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from minillm.cli import UsageError
from server.connections import running
from server.router import __main__ as router
from server.launch import ServerProcess, stop_all
from server.router.replicas import Replica, ReplicaSet, parse_load
from server.router.__main__ import ROUTER, _until_signalled, create_router, spawn_replicas
from server.router.proxy import CLIENT_GONE
from server.router.config import RouterConfig, parse_router_args
from server.wire import MAX_BODY_BYTES
from server.router.policy import (LeastOutstanding, LoadAware, PrefixAffinity, RoundRobin, affinity_key)

# ----------------------------------------------------------------------------- policies (pure)


def fleet(n: int = 3) -> list[Replica]:
    return [Replica(f"http://r{i}") for i in range(n)]


def test_round_robin_takes_each_replica_in_turn() -> None:
    r, policy = fleet(), RoundRobin()
    assert [policy.choose(r).url for _ in range(6)] == ["http://r0", "http://r1", "http://r2"] * 2


def test_least_outstanding_picks_the_least_busy_and_rotates_among_ties() -> None:
    r, policy = fleet(), LeastOutstanding()
    r[0].outstanding, r[1].outstanding, r[2].outstanding = 3, 1, 2
    assert policy.choose(r) is r[1]
    r[1].outstanding = 2
    assert {policy.choose(r).url for _ in range(4)} == {"http://r1", "http://r2"}  # both tied at 2


def test_load_aware_counts_the_replicas_own_queue_and_kv_pressure() -> None:
    r, policy = fleet(), LoadAware()
    r[0].waiting = 5  # traffic this router never sent: only /metrics shows it
    r[1].kv_usage = 0.9  # nearly full cache: 0.9 * 4 = 3.6
    r[2].outstanding = 3
    assert policy.choose(r) is r[2]  # 3 < 3.6 < 5
    assert LeastOutstanding().choose(r) is not r[2]  # which least-outstanding cannot see


def test_prefix_affinity_is_sticky_stable_and_bounded() -> None:
    r, policy = fleet(4), PrefixAffinity(balance_slack=3)
    keys = [f"system prompt {i}".encode() for i in range(40)]
    home = {k: policy.choose(r, k) for k in keys}
    assert all(policy.choose(r, k) is home[k] for k in keys)  # sticky
    assert len({h.url for h in home.values()}) == 4  # and spread over the fleet
    without = [x for x in r if x is not r[0]]  # r0 leaves: only its keys move
    assert all(policy.choose(without, k) is home[k] for k in keys if home[k] is not r[0])
    hot = keys[0]
    home[hot].outstanding = 3  # 3 more than the least busy: bounded load sends it elsewhere
    assert policy.choose(r, hot) is not home[hot]
    home[hot].outstanding = 2
    assert policy.choose(r, hot) is home[hot]


def test_affinity_key_uses_the_session_else_the_prompts_start() -> None:
    long = "Once upon a time " * 40
    assert affinity_key({"prompt": long + "the end"}) == affinity_key({"prompt": long + "a dragon"})
    assert affinity_key({"prompt": "a"}) != affinity_key({"prompt": "b"})
    assert affinity_key({"prompt": "a", "user": "u1"}) == affinity_key({"prompt": "b", "user": "u1"})
    assert affinity_key({"prompt": list(range(100))}) == affinity_key({"prompt": list(range(64)) + [7] * 30})
    assert affinity_key({"prompt": ["first", "second"]}) == affinity_key({"prompt": "first"})
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert affinity_key(chat) is not None and affinity_key(chat) != affinity_key({"prompt": "hi"})
    assert affinity_key(None) is None and affinity_key({"prompt": 3}) is None
    with pytest.raises(ValueError, match="--policy must be one of"):
        RouterConfig(replicas=["http://127.0.0.1:8001"], policy="random")


# ----------------------------------------------------------------------------- health (pure)

METRICS_PAGE = """# HELP minillm:num_requests_waiting Requests waiting to be scheduled.
# TYPE minillm:num_requests_waiting gauge
minillm:num_requests_waiting 7.0
# TYPE minillm:kv_cache_usage_perc gauge
minillm:kv_cache_usage_perc 0.25
# TYPE minillm:prefix_cache_hit_rate gauge
minillm:prefix_cache_hit_rate 0.5
# TYPE minillm:generation_tokens counter
minillm:generation_tokens_total 99.0
"""


def test_checks_eject_after_a_run_of_failures_and_readmit_after_a_run_of_passes() -> None:
    assert parse_load(METRICS_PAGE) == {"waiting": 7.0, "kv_usage": 0.25, "prefix_hit_rate": 0.5}
    pool = ReplicaSet(["http://a", "http://b/"], eject_after=2, readmit_after=2)
    a, b = pool.replicas
    assert b.url == "http://b"
    pool.record_check(a, False)
    assert a.healthy  # one failure is not enough
    pool.record_check(a, True)
    pool.record_check(a, False)
    assert a.healthy  # the run was broken
    pool.record_check(a, False)
    assert not a.healthy and a.ejections == 1 and pool.healthy() == [b]
    pool.record_check(a, True, parse_load(METRICS_PAGE))
    assert not a.healthy and a.waiting == 7.0
    pool.record_check(a, True)
    assert a.healthy and a.readmissions == 1
    pool.report_failure(b, "connection refused")  # a passive check ejects at once
    assert not b.healthy and b.errors == 1 and b.ejections == 1
    with pytest.raises(ValueError, match="listed twice"):
        ReplicaSet(["http://a", "http://a/"])


def test_router_flags_are_checked_in_one_line(capsys, tmp_path) -> None:
    config = parse_router_args(["--replica", "http://h:1", "--replica", "http://h:2", "--policy", "prefix"], {})
    assert config.replicas == ["http://h:1", "http://h:2"] and config.policy == "prefix"
    assert parse_router_args([], {"MINILLM_ROUTER_REPLICA": "http://a:1,http://b:2"}).replicas == ["http://a:1",
                                                                                                  "http://b:2"]
    for argv, message in ((["--spawn", "2", "--replica", "http://h:1"], "one or the other"), ([], "one or the other"),
                          (["--replica", "h:1"], "--replica wants a URL"),
                          (["--spawn", "99"], "--spawn must be in 0..16"),
                          (["--spawn", "1", "--health-interval", "0"], "--health-interval must be > 0"),
                          (["--spawn", "1", "--health-timeout", "1"],
                           r"--health-timeout \(1.0 s\) must be shorter than --health-interval \(1.0 s\)"),
                          (["--spawn", "1", "--replica-args=--max-body-bytes 4MiB"],
                           r"--max-body-bytes 4MiB \(4194304 bytes\), the router's --max-body-bytes is 1048576"),
                          (["--spawn", "1", "--replica-args", "'unclosed"], "--replica-args")):
        with pytest.raises(UsageError, match=message):
            parse_router_args(argv, {})
    with pytest.raises(SystemExit):
        parse_router_args(["--spawn", "1", "--policy", "fastest"], {})
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
    assert RouterConfig(spawn=1, replica_args="--device cpu").replica_flags() == ["--device", "cpu",
                                                                                 "--max-body-bytes", "1048576"]
    same = parse_router_args(["--spawn", "1", "--max-body-bytes", "4MiB", "--replica-args=--max-body-bytes=4MiB"], {})
    assert same.max_body_bytes == 4 << 20 and same.replica_flags() == ["--max-body-bytes=4MiB"]
    with pytest.raises(UsageError, match="--checkpoint: no checkpoint at"):
        spawn_replicas(RouterConfig(spawn=1, checkpoint=str(tmp_path / "none.pt")))


# ----------------------------------------------------------------------------- fake replicas

SEEN = web.AppKey("seen", dict)


@dataclass
class Fake:
    """A replica that behaves as told, by ``mode``:

    - ok: answers (a stream: ``events`` events and ``[DONE]``); refuse: 429; fail: ``status``
      with an error body;
    - cut: a stream dies after two events; stall: a stream sends its first event, then waits
      for the test to set ``release`` before the rest;
    - late: sends nothing, not even its status line, until ``release``; silent: a stream sends
      its status line, then nothing until ``release``;
    - drop: the connection closes after the request arrives, with no answer (a stream: right
      after its status line).

    ``hang_health``: ``/health`` never answers; ``health_waits`` gets how long each hung check
    waited before the router gave up on it. ``padding``: characters added to each event's text."""

    mode: str = "ok"
    events: int = 3
    padding: int = 0
    status: int = 500
    healthy: bool = True
    hang_health: bool = False
    waiting: float = 0.0
    bodies: list = field(default_factory=list)
    health_waits: list = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def chunk(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n".encode()


def fake_app(fake: Fake) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fake.bodies.append(body)
        if fake.mode == "refuse":
            return web.json_response({"error": {"message": "busy", "code": "rate_limit_exceeded"}}, status=429)
        if fake.mode == "fail":
            return web.json_response({"error": {"message": "boom", "code": None}}, status=fake.status)
        try:
            return await answer(request, body)
        except asyncio.CancelledError:
            fake.cancelled.set()  # the server's handler saw its client (the router) leave
            raise

    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        if fake.mode == "late":
            await fake.release.wait()
        if fake.mode == "drop" and not body.get("stream"):
            request.transport.close()  # the process died before answering
            await fake.release.wait()  # (cancelled: the connection is gone)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "whole"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if fake.mode == "silent":
            await fake.release.wait()
        for i in range(fake.events):
            if fake.mode == "drop" or (fake.mode == "cut" and i == 2):
                request.transport.close()  # the process died: no more bytes, no [DONE]
                return response
            await response.write(chunk(f"t{i}" + "x" * fake.padding))
            if fake.mode == "stall" and i == 0:
                await fake.release.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        if fake.hang_health:
            start = time.monotonic()
            try:
                await asyncio.Event().wait()  # never set: only the router giving up ends it
            finally:
                fake.health_waits.append(time.monotonic() - start)
        return web.json_response({}, status=200 if fake.healthy else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=f"minillm:num_requests_waiting {fake.waiting}\n")

    async def echo_route(request: web.Request) -> web.Response:
        """The token and model routes: say which path and body arrived."""
        body = await request.json() if request.method == "POST" else None
        return web.json_response({"path": request.path, "body": body})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/tokenize", echo_route)
    app.router.add_post("/detokenize", echo_route)
    app.router.add_get("/v1/models/{model:.+}", echo_route)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def dead_url() -> str:
    """A port nothing listens on: connecting is refused, as with a crashed replica."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.asynccontextmanager
async def router_over(fakes: list[Fake | str], **options):
    """The router on a free port in front of ``fakes`` (a string is a URL used as is)."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [f if isinstance(f, str) else await stack.enter_async_context(running(fake_app(f))) for f in fakes]
        config = RouterConfig(replicas=urls, health_interval=options.pop("health_interval", 30), **options)
        app = create_router(urls, config)
        url = await stack.enter_async_context(running(app, shutdown_grace=1))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield url, app[ROUTER], session


@contextlib.asynccontextmanager
async def uncancelled_router(fakes: list[Fake | str], **options):
    """As :func:`router_over`, but served without handler cancellation (``web.run_app``'s own
    default), so a client that leaves is noticed only when a write to it fails. With
    cancellation on, that is a race the cancellation can lose: when the replica's next event is
    already in, the write comes first. Also yields ``client_left()``: True once the router has
    seen every client connection it holds close."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [f if isinstance(f, str) else await stack.enter_async_context(running(fake_app(f))) for f in fakes]
        app = create_router(urls, RouterConfig(replicas=urls, health_interval=30, **options))
        runner = web.AppRunner(app, handler_cancellation=False, access_log=None, shutdown_timeout=1)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        session = await stack.enter_async_context(aiohttp.ClientSession())

        def client_left() -> bool:
            held = runner.server.connections
            return bool(held) and all(handler.transport is None for handler in held)

        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[ROUTER], session, client_left


async def events(response: aiohttp.ClientResponse) -> list:
    out = []
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


STREAM = {"prompt": "Once", "max_tokens": 3, "stream": True}


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


async def until(condition) -> None:
    """Wait for ``condition()`` to hold: for a state, not for a time (``run``'s timeout ends a hang)."""
    while not condition():
        await asyncio.sleep(0.005)


async def router_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        return await response.text()


# ----------------------------------------------------------------------------- routing over HTTP


def test_a_dead_replica_is_retried_before_the_first_token_and_ejected() -> None:
    async def main() -> None:
        dead, good = dead_url(), Fake()
        async with router_over([dead, good], policy="round-robin") as (url, state, session):
            async with session.post(f"{url}/v1/completions", json=STREAM) as response:
                assert response.status == 200
                got = await events(response)
            assert [e["choices"][0]["text"] for e in got[:-1]] == ["t0", "t1", "t2"] and got[-1] == "[DONE]"
            assert [r.healthy for r in state.replicas.replicas] == [False, True]
            text = await router_metrics(session, url)
        assert "minillm_router:retries_total 1.0" in text
        assert f'minillm_router:replica_ejections_total{{replica="{dead}"}} 1.0' in text
        assert 'minillm_router:requests_total{status="200"} 1.0' in text and len(good.bodies) == 1

    run(main())


def test_a_refusal_goes_to_another_replica_and_the_last_refusal_reaches_the_client() -> None:
    async def main() -> None:
        busy, good = Fake(mode="refuse"), Fake()
        async with router_over([busy, good], policy="round-robin") as (url, state, session):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                assert response.status == 200 and await response.json() == {"choices": [{"text": "whole"}]}
            assert state.replicas.replicas[0].healthy  # a 429 is load, not ill health
        async with router_over([Fake(mode="refuse")], max_attempts=3) as (url, state, session):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                assert response.status == 429
                assert (await response.json())["error"]["code"] == "rate_limit_exceeded"
            assert state.replicas.replicas[0].requests == 1  # one replica: tried once, not three times

    run(main())


def test_the_token_and_model_routes_are_forwarded() -> None:
    async def main() -> None:
        async with router_over([Fake()]) as (url, state, session):
            for method, path, body in [("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                       ("GET", "/v1/models/org/tiny", None)]:
                async with session.request(method, f"{url}{path}", json=body) as response:
                    assert response.status == 200 and await response.json() == {"path": path, "body": body}

    run(main())


def test_a_bad_request_is_passed_back_without_a_retry() -> None:
    async def bad(request: web.Request) -> web.Response:
        calls.append(1)
        return web.json_response({"error": {"message": "temperature", "param": "temperature"}}, status=400)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    calls: list = []

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", bad)
        app.router.add_get("/health", health)
        async with running(app) as replica, router_over([replica, Fake()], policy="round-robin") as (url, _, session):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                assert response.status == 400 and (await response.json())["error"]["param"] == "temperature"
        assert calls == [1]

    run(main())


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def main() -> None:
        async with router_over([Fake(mode="cut", events=5), Fake()], policy="round-robin") as (url, state, session):
            async with session.post(f"{url}/v1/completions", json=STREAM) as response:
                assert response.status == 200
                got = await events(response)
            assert [e["choices"][0]["text"] for e in got[:2]] == ["t0", "t1"]
            assert got[2]["error"]["code"] == "replica_failed" and got[3] == "[DONE]" and len(got) == 4
            assert state.midstream_failures == 1 and not state.replicas.replicas[0].healthy
            assert "minillm_router:midstream_failures_total 1.0" in await router_metrics(session, url)

    run(main())


def test_a_client_leaving_the_router_cancels_the_request_on_the_replica() -> None:
    async def main() -> None:
        stalled = Fake(mode="stall")  # never released: the stream can only end by the client leaving
        async with router_over([stalled]) as (url, state, session):
            response = await session.post(f"{url}/v1/completions", json=STREAM)
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
            assert not stalled.cancelled.is_set() and state.replicas.replicas[0].outstanding == 1
            response.close()  # the client goes away mid-stream
            await stalled.cancelled.wait()
            await until(lambda: state.replicas.replicas[0].outstanding == 0)  # the router's handler unwinds
            assert len(stalled.bodies) == 1  # sent once, not retried

    run(main())


def test_health_checks_eject_and_readmit_and_no_replica_is_a_503() -> None:
    async def main() -> None:
        a, b = Fake(), Fake()
        async with router_over([a, b], health_interval=0.1, health_timeout=0.08) as (url, state, session):
            ra, rb = state.replicas.replicas
            a.healthy = b.healthy = False
            await until(lambda: not ra.healthy and not rb.healthy)
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                assert response.status == 503
                assert (await response.json())["error"]["code"] == "no_healthy_replica"
            async with session.get(f"{url}/health") as response:
                assert response.status == 503
                assert (await response.json())["replicas"] == {ra.url: "ejected", rb.url: "ejected"}
            a.healthy = True
            await until(lambda: ra.healthy)
            assert ra.readmissions == 1 and not rb.healthy
            async with session.get(f"{url}/health") as response:
                assert response.status == 200
            async with session.get(f"{url}/v1/nothing") as response:
                assert response.status == 404 and (await response.json())["error"]["type"] == "invalid_request_error"

    run(main())


def test_load_aware_routing_reads_the_replicas_metrics() -> None:
    async def main() -> None:
        queued, idle = Fake(waiting=6), Fake()
        async with router_over([queued, idle], policy="load-aware") as (url, state, session):
            assert [r.waiting for r in state.replicas.replicas] == [6.0, 0.0]  # scraped at startup
            for _ in range(4):
                async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                    assert response.status == 200
        assert (len(queued.bodies), len(idle.bodies)) == (0, 4)

    run(main())


def test_only_what_a_replica_did_not_start_is_retried() -> None:
    async def main() -> None:
        for status in (500, 502, 504):  # the replica took the request and failed: its answer, as it is
            failing, other = Fake(mode="fail", status=status), Fake()
            async with router_over([failing, other], policy="round-robin") as (url, state, session):
                async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                    assert response.status == status and (await response.json())["error"]["message"] == "boom"
                assert not other.bodies and state.retries == 0 and state.replicas.replicas[0].healthy
        for body in ({"prompt": "x"}, STREAM):  # the connection broke after the request was sent
            dropping, other = Fake(mode="drop"), Fake()
            async with router_over([dropping, other], policy="round-robin") as (url, state, session):
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 502 and (await response.json())["error"]["code"] == "replica_failed"
                assert not other.bodies and state.retries == 0 and not state.replicas.replicas[0].healthy
        refusing, other = Fake(mode="fail", status=503), Fake()  # a refusal: another replica takes it
        async with router_over([refusing, other], policy="round-robin") as (url, state, session):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response:
                assert response.status == 200
            assert len(other.bodies) == 1 and state.retries == 1 and not state.replicas.replicas[0].healthy

    run(main())


def test_a_silent_replica_is_a_504_and_an_abort_not_a_retry_or_an_ejection() -> None:
    async def main() -> None:
        for mode, body in (("late", {"prompt": "x"}), ("silent", STREAM)):  # no status line; no first event
            slow, other = Fake(mode=mode), Fake()
            async with router_over([slow, other], policy="round-robin", first_byte_timeout=0.2) as (url, state,
                                                                                                      session):
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 504
                    assert (await response.json())["error"]["code"] == "replica_timeout"
                await slow.cancelled.wait()  # the router closed the connection: the replica aborts the request
                replica = state.replicas.replicas[0]
                assert replica.healthy and replica.errors == 1 and not other.bodies and state.retries == 0
                assert dict(state.statuses) == {504: 1}

    run(main())


def test_a_client_leaving_mid_stream_is_not_the_replicas_failure() -> None:
    """aiohttp (3.14) raises ClientConnectionResetError, a ClientConnectionError as well as a
    ConnectionResetError, for a write to a client that has gone: caught together with the
    replica's read errors, it ejected a healthy replica."""
    async def main() -> None:
        stalled = Fake(mode="stall")
        async with uncancelled_router([stalled]) as (url, state, session, client_left):
            response = await session.post(f"{url}/v1/completions", json=STREAM)
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
            response.close()  # the client goes away mid-stream
            await until(client_left)
            stalled.release.set()  # the replica's next event meets a closed client
            replica = state.replicas.replicas[0]
            await until(lambda: replica.outstanding == 0)
            assert replica.healthy and replica.errors == 0 and state.midstream_failures == 0
            assert dict(state.statuses) == {CLIENT_GONE: 1}

    run(main())


def test_a_client_that_stops_reading_is_cut_off_and_the_replica_told() -> None:
    """A client that opens a stream through the router and never reads: once the buffers are
    full the router's write waits; past --client-timeout the router drops the client, as one
    that left, and closes the replica's stream (the replica sees its client go)."""
    async def main() -> None:
        flood = Fake(mode="ok", events=400, padding=2**16)  # 26 MB: more than loopback buffers
        async with router_over([flood], client_timeout=0.3) as (url, state, _):
            address = urlsplit(url)
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((address.hostname, address.port))
                body = json.dumps(STREAM).encode()
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await until(lambda: state.statuses)  # ... and never a byte read
                assert dict(state.statuses) == {CLIENT_GONE: 1}
                await asyncio.wait_for(flood.cancelled.wait(), 5)
            replica = state.replicas.replicas[0]
            assert replica.healthy and replica.errors == 0

    run(main())


def test_a_client_gone_before_the_first_event_is_neither_retried_nor_blamed() -> None:
    async def main() -> None:
        late, other = Fake(mode="late"), Fake()
        async with uncancelled_router([late, other], policy="round-robin") as (url, state, session, client_left):
            asking = asyncio.create_task(session.post(f"{url}/v1/completions", json=STREAM))
            await until(lambda: late.bodies)  # the request reached the replica
            asking.cancel()  # the client gives up before any answer
            await until(client_left)
            late.release.set()  # the first event is in: the router's status line meets a closed client
            await until(lambda: state.statuses)
            assert dict(state.statuses) == {CLIENT_GONE: 1} and not other.bodies and state.retries == 0
            assert all(r.healthy and r.errors == 0 for r in state.replicas.replicas)

    run(main())


def test_health_checks_give_up_after_the_health_timeout() -> None:
    async def main() -> None:
        hung = Fake(hang_health=True)
        async with router_over([hung, Fake()], health_interval=0.2, health_timeout=0.05) as (url, state, session):
            await until(lambda: not state.replicas.replicas[0].healthy and len(hung.health_waits) >= 2)
        assert max(hung.health_waits) < 0.5  # each gave up after about 0.05 s: not max(interval, 1 s)

    run(main())


def test_a_body_over_the_replicas_limit_is_the_routers_own_413() -> None:
    async def main() -> None:
        fake = Fake()
        async with router_over([fake]) as (url, state, session):
            async with session.post(f"{url}/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES}) as response:
                assert response.status == 413
                assert (await response.json())["error"]["type"] == "invalid_request_error"
            async with session.post(f"{url}/v1/completions", json={"prompt": "x" * 1000}) as response:
                assert response.status == 200
        assert len(fake.bodies) == 1  # the large one never reached it

    run(main())


# ----------------------------------------------------------------------------- stopping

SLOW_TO_STOP = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))\n"
                "print('ready', flush=True)\n"
                "time.sleep(60)\n")


@contextlib.contextmanager
def slow_to_stop(n: int):
    """``n`` child processes that each take 1 s to exit after SIGTERM, as servers draining their
    requests do, wrapped as :class:`ServerProcess` es; yielded once their handlers are in place."""
    procs = [subprocess.Popen([sys.executable, "-c", SLOW_TO_STOP], stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "ready\n"
        yield [ServerProcess(proc, f"http://127.0.0.1:{9000 + i}", []) for i, proc in enumerate(procs)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_stop_all_stops_servers_side_by_side() -> None:
    with slow_to_stop(3) as servers:
        start = time.monotonic()
        assert stop_all(servers, grace=5) == [0, 0, 0]  # each exited through its handler: gracefully
        assert time.monotonic() - start < 2.5  # one after another takes 3 s


def test_the_first_signal_removes_the_handlers_so_a_second_interrupts() -> None:
    async def main() -> None:
        before = signal.getsignal(signal.SIGTERM)
        async with running(fake_app(Fake())) as replica:
            config = RouterConfig(replicas=[replica], port=0, shutdown_grace=0)
            serving = asyncio.create_task(_until_signalled(create_router([replica], config), config))
            await until(lambda: signal.getsignal(signal.SIGTERM) is not before)  # its handlers are in
            os.kill(os.getpid(), signal.SIGTERM)
            await serving
            assert signal.getsignal(signal.SIGTERM) is before
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the signal interrupts this at once (or landed already)

    run(main())


def test_a_second_ctrl_c_kills_the_spawned_replicas_at_once(monkeypatch) -> None:
    async def interrupted(app: web.Application, config: RouterConfig) -> None:
        raise KeyboardInterrupt  # what a second Ctrl+C does while the router drains

    with slow_to_stop(2) as servers:
        monkeypatch.setattr(router, "spawn_replicas", lambda config: servers)
        monkeypatch.setattr(router, "_until_signalled", interrupted)
        with pytest.raises(KeyboardInterrupt):
            router.main(["--spawn", "2"])
        assert [s.proc.returncode for s in servers] == [-signal.SIGKILL] * 2  # killed, not 1 s of grace each


def test_the_shared_prefix_workload_shares_exactly_its_prefixes() -> None:
    from server.router.bench import QUICK, shared_prefix_prompts

    prompts = shared_prefix_prompts(QUICK, seed=1)
    assert len(prompts) == QUICK.prefix_requests
    assert {len(p) for p in prompts} == {QUICK.prefix_len + QUICK.suffix_len}
    prefixes = {tuple(p[:QUICK.prefix_len]) for p in prompts}
    assert 1 < len(prefixes) <= QUICK.groups  # shared: fewer prefixes than prompts
    assert len({tuple(p[QUICK.prefix_len:]) for p in prompts}) == len(prompts)  # each suffix its own
    assert prefixes.isdisjoint(tuple(p[:QUICK.prefix_len]) for p in shared_prefix_prompts(QUICK, seed=2))
    assert len({affinity_key({"prompt": p}) for p in prompts}) == len(prefixes)  # the router sees the groups
