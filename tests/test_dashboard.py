"""The live dashboard: its quantile arithmetic, its event stream and traffic endpoints, and the
page itself in headless Chromium.

The browser test drives Debian's ``chromium`` through Playwright (see ``browser.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from browser import headless_chromium
from test_server_live import Live, live_server, slowed, small_engine, tiny_model

from minillm.model import GPT
from server.dashboard import MAX_TRAFFIC_RATE, histogram_quantile

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
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{live.url}/dashboard/events") as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            async for line in response.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == count:
                        return events
    return events


def test_the_event_stream_ticks_and_ends_at_shutdown(model: GPT) -> None:
    """Neither a page left open nor the traffic panel's load may hold a graceful shutdown for
    its whole grace period."""

    async def watch_through_shutdown(live: Live) -> tuple[list[dict], float]:
        events = await first_events(live, 3)
        async with aiohttp.ClientSession() as session:
            traffic = {"request_rate": 20, "input_len": 8, "output_len": 100, "duration": 60}
            async with session.post(f"{live.url}/dashboard/traffic", json=traffic) as response:
                assert response.status == 202
            async with session.get(f"{live.url}/dashboard/events") as response:
                await response.content.readline()
                await live.wait_until(lambda stats: stats.running > 0)
                live.stop()
                stopping = time.monotonic()
                await response.read()  # to the end of the stream
                return events, time.monotonic() - stopping

    with live_server(small_engine(model), shutdown_grace=30) as live:
        events, closing = asyncio.run(asyncio.wait_for(watch_through_shutdown(live), 30))
    assert closing < 5
    assert [e["t"] for e in events] == sorted(e["t"] for e in events) and events[-1]["t"] - events[0]["t"] <= 2
    keys = {"tokens_per_s", "requests_per_s", "running", "waiting", "batch_size", "kv_cache_usage", "preemptions",
            "ttft_ms", "itl_ms", "traffic"}
    assert keys <= events[-1].keys() and events[-1]["traffic"] == {"state": "idle"}


def test_traffic_is_bounded_and_off_behind_an_api_key(model: GPT) -> None:
    async def post(live: Live, body: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{live.url}/dashboard/traffic", json=body) as response:
                return response.status, await response.json()

    ok = {"request_rate": 5, "input_len": 8, "output_len": 8, "duration": 1}
    with live_server(small_engine(model)) as live:
        for bad, param in (({**ok, "request_rate": MAX_TRAFFIC_RATE * 2}, "request_rate"),
                           ({**ok, "duration": 0}, "duration"), ({**ok, "output_len": 121}, "output_len"),
                           ({**ok, "input_len": 1.5}, "input_len")):
            status, body = asyncio.run(asyncio.wait_for(post(live, bad), 10))
            assert (status, body["error"]["param"]) == (400, param)
    with live_server(small_engine(model), api_key="sekrit") as live:
        status, body = asyncio.run(asyncio.wait_for(post(live, ok), 10))
        assert status == 403 and body["error"]["code"] == "traffic_disabled"


def test_the_page_in_chromium_charts_live_traffic(model: GPT, monkeypatch, artifacts: Path) -> None:
    engine = slowed(small_engine(model), monkeypatch, seconds=0.005)  # busy enough to show a batch
    with live_server(engine) as live, headless_chromium() as browser:
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
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

        page.click("#stop")
        page.wait_for_function("document.querySelector('#traffic-status').textContent.startsWith('finished')")
        page.close()
    assert problems == []
    outside = [u for u in requests if not u.startswith(live.url + "/") and not u.startswith("data:")]
    assert outside == [] and f"{live.url}/dashboard/events" in requests
