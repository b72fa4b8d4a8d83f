"""The live dashboard: its quantile arithmetic, its event stream and traffic endpoints, and the
page itself in headless Chromium.

The browser test drives Debian's ``chromium`` through Playwright (see ``browser.py``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from urllib.parse import urlsplit

import aiohttp
import pytest
from browser import headless_chromium
from models import tiny_model
from test_server_live import Live, live_server, small_engine

from minillm.engine.llm_engine import EngineStats
from minillm.model.gpt import GPT
from server import dashboard
from server.dashboard import FEED, RATE_WINDOW_S, TICK_S, StatsFeed, histogram_quantile
from server.loadgen.client import LoadSpec
from server.metrics import Metrics
from server.traffic_panel import MAX_TRAFFIC_RATE, TRAFFIC, Traffic
from server.wire import OpenAIError, sse


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model()


def test_histogram_quantiles_interpolate_inside_buckets() -> None:
    bounds, cumulative = (1.0, 2.0, 4.0, float("inf")), (2, 6, 8, 10)
    assert histogram_quantile(bounds, cumulative, 0.1) == 0.5  # rank 1 of 2 in [0, 1]
    assert histogram_quantile(bounds, cumulative, 0.5) == 1.75  # rank 5: 3 of 4 into [1, 2]
    assert histogram_quantile(bounds, cumulative, 0.8) == 4.0  # rank 8: the top of [2, 4]
    assert histogram_quantile(bounds, cumulative, 0.95) == 4.0  # in +Inf: the largest finite bound
    assert histogram_quantile(bounds, (0, 0, 0, 0), 0.5) is None


async def first_events(live: Live, count: int) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        return await read_events(session, live, count)


async def read_events(session: aiohttp.ClientSession, live: Live, count: int) -> list[dict]:
    events = []
    async with session.get(f"{live.url}/dashboard/events") as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
                if len(events) == count:
                    return events
    return events


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``predicate`` about the server's state (kept in its own thread) to hold."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_a_snapshot_reads_its_rates_and_latencies_over_windows_of_the_feeds_clock() -> None:
    """Six ticks on a fake clock, each with a known token count: the rate is over the last
    ``RATE_WINDOW_S`` (four ticks back), not since the start; latencies over the whole window."""
    assert (TICK_S, RATE_WINDOW_S) == (0.5, 2.0)  # the arithmetic below
    stats = EngineStats(running=2, waiting=1, kv_blocks_used=16, kv_blocks_total=64, kv_tokens=0, preemptions=3,
                        prefix_cache_hit_rate=0.0, steps=0, prefill_tokens=0, generated_tokens=0, batch_size=2)
    engine = SimpleNamespace(stats=stats)
    metrics = Metrics(engine)
    now = [50.0]
    feed = StatsFeed(engine, metrics, lambda: {"state": "idle"}, clock=lambda: now[0])
    snapshots = []
    for tick, tokens in enumerate((0, 100, 300, 600, 1000, 1500)):
        now[0] = 50.0 + tick * TICK_S
        engine.stats = replace(stats, generated_tokens=tokens)
        if tick == 5:  # four requests finish, each 30 ms to its first token
            for _ in range(4):
                metrics.ttft.observe(0.03)
                metrics.e2e.observe(0.2)
        snapshots.append(feed.snapshot())
    assert [s["t"] for s in snapshots] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [s["tokens_per_s"] for s in snapshots] == [0.0, 200.0, 300.0, 400.0, 500.0, (1500 - 100) / 2.0]
    last = snapshots[-1]
    assert last["requests_per_s"] == 2.0 and last["ttft_ms"] == {"p50": 30.0, "p95": 39.0, "p99": 39.8}
    assert last["itl_ms"] == {"p50": None, "p95": None, "p99": None}  # no gaps observed
    assert (last["running"], last["waiting"], last["batch_size"], last["kv_cache_usage"], last["preemptions"],
            last["traffic"]) == (2, 1, 2, 0.25, 3, {"state": "idle"})


def test_the_event_stream_ticks_and_ends_at_shutdown(model: GPT) -> None:
    """Neither a page left open nor the traffic panel's load may hold a graceful shutdown for
    its grace period. The grace here is an hour: only a shutdown that ends them itself can
    finish inside the test's timeout, and the stream must end cleanly, because the feed closed."""

    async def watch_through_shutdown(live: Live) -> tuple[list[dict], bool]:
        events = await first_events(live, 3)
        feed = live.app[FEED]
        async with aiohttp.ClientSession() as session:
            traffic = {"request_rate": 20, "input_len": 8, "output_len": 100, "duration": 60}
            async with session.post(f"{live.url}/dashboard/traffic", json=traffic) as response:
                assert response.status == 202
            async with session.get(f"{live.url}/dashboard/events") as response:
                await response.content.readline()
                await live.wait_until(lambda stats: stats.running > 0)
                assert not feed.closed
                live.stop()
                await response.read()  # to the end of the stream; a stream cut off instead raises
                return events, feed.closed

    with live_server(small_engine(model), shutdown_grace=3600) as live:
        events, closed_by_the_feed = asyncio.run(asyncio.wait_for(watch_through_shutdown(live), 60))
    assert closed_by_the_feed
    times = [e["t"] for e in events]
    assert times == sorted(set(times))  # three distinct snapshots, in the order taken
    keys = {"tokens_per_s", "requests_per_s", "running", "waiting", "batch_size", "kv_cache_usage", "preemptions",
            "ttft_ms", "itl_ms", "traffic"}
    assert keys <= events[-1].keys() and events[-1]["traffic"] == {"state": "idle"}


def test_traffic_is_bounded_and_off_behind_an_api_key(model: GPT) -> None:
    async def post(live: Live, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{live.url}/dashboard/traffic", json=body, headers=headers) as response:
                return response.status, await response.json()

    ok = {"request_rate": 5, "input_len": 8, "output_len": 8, "duration": 1}
    with live_server(small_engine(model)) as live:
        for bad, param in (({**ok, "request_rate": MAX_TRAFFIC_RATE * 2}, "request_rate"),
                           ({**ok, "duration": 0}, "duration"), ({**ok, "output_len": 121}, "output_len"),
                           ({**ok, "input_len": 1.5}, "input_len")):
            status, body = asyncio.run(asyncio.wait_for(post(live, bad), 10))
            assert (status, body["error"]["param"]) == (400, param)
    with live_server(small_engine(model), api_key="sekrit") as live:  # without the key, no dashboard at all
        status, body = asyncio.run(asyncio.wait_for(post(live, ok), 10))
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = asyncio.run(asyncio.wait_for(post(live, ok, {"Authorization": "Bearer sekrit"}), 10))
        assert status == 403 and body["error"]["code"] == "traffic_disabled"  # and with it, no built-in load


def test_each_snapshot_is_encoded_once_however_many_pages_watch(model: GPT, monkeypatch) -> None:
    """Four pages, six events each (the history, then new ticks): every snapshot the feed's
    encoder saw is a different one, so no page had its own copy of an event encoded."""
    encoded: list[dict] = []
    monkeypatch.setattr(dashboard, "sse", lambda data: encoded.append(data) or sse(data))
    monkeypatch.setattr(dashboard, "TICK_S", 0.05)

    async def watch(live: Live) -> list[list[dict]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(read_events(session, live, 6) for _ in range(4)))

    with live_server(small_engine(model)) as live:
        pages = asyncio.run(asyncio.wait_for(watch(live), 30))
    times = [snapshot["t"] for snapshot in encoded]
    assert len(times) == len(set(times))  # each snapshot encoded once
    assert all(len(page) == 6 and {e["t"] for e in page} <= set(times) for page in pages)


def test_pages_past_the_limit_get_a_503_until_one_leaves(model: GPT, monkeypatch) -> None:
    monkeypatch.setattr(dashboard, "MAX_SUBSCRIBERS", 2)

    async def main(live: Live) -> None:
        feed, url = live.app[FEED], f"{live.url}/dashboard/events"
        async with aiohttp.ClientSession() as session:
            first, second = await session.get(url), await session.get(url)
            async with session.get(url) as third:
                assert (third.status, third.headers.get("Retry-After")) == (503, "5")
                body = await third.json()
                assert (body["error"]["type"], body["error"]["code"]) == ("server_error", "too_many_subscribers")
            first.close()  # the page leaves: its slot is free again
            await until(lambda: feed.subscribers == 1)
            async with session.get(url) as fourth:
                assert fourth.status == 200 and (await fourth.content.readline()).startswith(b"data: ")
            second.close()
            await until(lambda: feed.subscribers == 0)

    with live_server(small_engine(model)) as live:
        asyncio.run(asyncio.wait_for(main(live), 30))


def test_a_page_that_stops_reading_is_cut_off(model: GPT, monkeypatch) -> None:
    """A client that sends its GET and never reads, with a tiny receive buffer, and snapshots
    of 256 KiB: the socket's buffers fill within a few ticks, a write blocks, and the write
    timeout must end the stream and free its slot."""
    monkeypatch.setattr(dashboard, "TICK_S", 0.05)
    monkeypatch.setattr(dashboard, "HISTORY", 4)
    snapshot = StatsFeed.snapshot
    monkeypatch.setattr(StatsFeed, "snapshot", lambda self: {**snapshot(self), "padding": "x" * 2**18})

    async def main(live: Live) -> None:
        feed, address = live.app[FEED], urlsplit(live.url)
        with socket.socket() as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it sets the window
            reader.connect((address.hostname, address.port))
            reader.sendall(f"GET /dashboard/events HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode())
            await until(lambda: feed.subscribers == 1)
            await until(lambda: feed.subscribers == 0)

    with live_server(small_engine(model), client_timeout=0.3) as live:
        asyncio.run(asyncio.wait_for(main(live), 30))


TRAFFIC_FOR_A_MINUTE = {"request_rate": 2, "input_len": 8, "output_len": 8, "duration": 60}


def test_one_traffic_run_at_a_time(model: GPT) -> None:
    """Of two POSTs at once exactly one starts a run; a POST during it is a 409 and leaves it
    running; after DELETE a POST starts a new one."""

    async def main(live: Live) -> None:
        traffic, url = live.app[TRAFFIC], f"{live.url}/dashboard/traffic"
        async with aiohttp.ClientSession() as session:
            async def post() -> tuple[int, dict]:
                async with session.post(url, json=TRAFFIC_FOR_A_MINUTE) as response:
                    return response.status, await response.json()

            answers = sorted(await asyncio.gather(post(), post()), key=lambda answer: answer[0])
            assert [status for status, _ in answers] == [202, 409]
            assert answers[1][1]["error"]["code"] == "traffic_running"
            run = traffic.task
            status, body = await post()
            assert (status, body["error"]["code"]) == (409, "traffic_running")
            assert traffic.task is run and not run.done()
            async with session.delete(url) as response:
                assert response.status == 200 and (await response.json())["state"] == "finished"
            status, body = await post()
            assert (status, body["state"]) == (202, "running") and traffic.task is not run

    with live_server(small_engine(model)) as live:
        asyncio.run(asyncio.wait_for(main(live), 30))


def test_shutdown_ends_the_traffic_run_at_once_and_starts_no_other() -> None:
    """The run's first request goes to a server that accepts and never answers, as one that
    is closing may: shutdown must not wait on it, nor start a run after."""

    async def main() -> None:
        connections: list[asyncio.StreamWriter] = []
        silent = await asyncio.start_server(lambda _, writer: connections.append(writer), "127.0.0.1", 0)
        traffic = Traffic(max_model_len=128, locked=False)
        spec = LoadSpec(url=f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}", num_prompts=1, warmup=0)
        traffic.start(spec)
        await until(lambda: bool(connections))
        started = time.monotonic()
        await asyncio.wait_for(traffic.close(), 15)  # the test's own bound; the check is the next line
        assert time.monotonic() - started < 1 and traffic.task.done()
        with pytest.raises(OpenAIError) as refused:
            traffic.start(spec)
        assert (refused.value.status, refused.value.code) == (503, "shutting_down")
        silent.close()

    asyncio.run(main())


def test_the_traffic_panel_answers_its_own_page_only(model: GPT) -> None:
    """What another site's page can make a visitor's browser send: a text/plain form POST (no
    preflight), or a fetch that carries its Origin and Sec-Fetch-Site. None may start or stop
    a run; the page itself, and a client that is no browser, may."""

    async def main(live: Live) -> None:
        traffic, url = live.app[TRAFFIC], f"{live.url}/dashboard/traffic"
        async with aiohttp.ClientSession() as session:
            async def answer(method: str, **options) -> tuple[int, str | None]:
                async with session.request(method, url, **options) as response:
                    body = await response.json()
                    return response.status, body["error"]["code"] if response.status >= 400 else body["state"]

            form = {"data": json.dumps(TRAFFIC_FOR_A_MINUTE), "headers": {"Content-Type": "text/plain"}}
            assert await answer("POST", **form) == (415, None)
            for body, charset, status in ((b"[" * 100_000, "utf-8", 400), (b"{}", "klingon", 415)):  # were 500s
                headers = {"Content-Type": f"application/json; charset={charset}"}
                assert (await answer("POST", data=body, headers=headers))[0] == status
            for header in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                           {"Origin": live.url, "Sec-Fetch-Site": "same-site"}):
                assert await answer("POST", json=TRAFFIC_FOR_A_MINUTE, headers=header) == (403, "cross_origin")
            assert traffic.load is None  # none of them started a run
            own_page = {"Origin": live.url, "Sec-Fetch-Site": "same-origin"}
            assert await answer("POST", json=TRAFFIC_FOR_A_MINUTE, headers=own_page) == (202, "running")
            assert await answer("DELETE", headers={"Origin": "http://evil.example"}) == (403, "cross_origin")
            assert traffic.running
            assert await answer("DELETE") == (200, "finished")  # curl: no browser, no headers

    with live_server(small_engine(model)) as live:
        asyncio.run(asyncio.wait_for(main(live), 30))


def test_the_page_in_chromium_charts_live_traffic(model: GPT, artifacts: Path) -> None:
    with live_server(small_engine(model)) as live, headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.set_default_timeout(20_000)
        problems: list[str] = []
        requests: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda err: problems.append(str(err)))
        page.on("request", lambda r: requests.append(r.url))

        page.goto(f"{live.url}/")
        page.wait_for_selector("#connection.live")
        before = int(page.get_attribute("#tokens svg", "data-points"))

        page.fill("input[name=request_rate]", "30")
        page.fill("input[name=input_len]", "8")
        page.fill("input[name=output_len]", "24")
        page.fill("input[name=duration]", "20")
        page.click("#start")
        page.wait_for_function("Number(document.querySelector('#tokens .value').dataset.value) > 0")
        page.wait_for_function("document.querySelector('#ttft .value').dataset.value !== ''")
        page.wait_for_function(f"Number(document.querySelector('#tokens svg').dataset.points) >= {before + 3}")
        assert page.get_attribute("#tokens svg path", "d").count("L") >= 2  # a drawn line
        assert "running at 30 req/s" in page.text_content("#traffic-status")
        assert page.is_disabled("#start")  # one run at a time: the server would answer 409
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

        page.click("#stop")
        page.wait_for_function("document.querySelector('#traffic-status').textContent.startsWith('finished')")
        assert page.is_enabled("#start")
        page.close()
    assert problems == []
    outside = [u for u in requests if not u.startswith(live.url + "/") and not u.startswith("data:")]
    assert outside == [] and f"{live.url}/dashboard/events" in requests
