"""The load generator: its arithmetic by hand, then real runs against a tiny model's server.

Live runs reuse ``test_server_live``'s in-process server (``serve`` on a free port of
127.0.0.1, in its own thread); ``asyncio.run`` with a timeout drives each, so none can hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import statistics
from dataclasses import replace

import numpy as np
import pytest
from models import tiny_model
from test_server_live import Gate, live_server, small_engine

from minillm.cli import UsageError
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import EOT_ID, get_tokenizer
from server.loadgen import client as loadgen_client
from server.app import STATE
from server.loadgen.__main__ import build_parser, main, spec_from_args
from server.loadgen.client import LoadRun, LoadSpec, arrival_times
from server.loadgen.stats import RequestResult, parse_slo, percentile, summarize
from server.loadgen.client import prompts


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model()


def load(spec: LoadSpec, timeout: float = 60) -> tuple[LoadRun, object]:
    """Run ``spec`` to the end; returns the run (for its per-request results) and its summary."""
    run = LoadRun(spec)
    return run, asyncio.run(asyncio.wait_for(run.run(), timeout))


# ----------------------------------------------------------------------------- by hand


def test_percentiles_interpolate_linearly_between_ranks() -> None:
    # rank h = (n - 1) * q / 100 over [1, 2, 3, 4]: p50 -> h 1.5, p95 -> 2.85, p99 -> 2.97
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert (percentile([1, 2, 3, 4], 0), percentile([1, 2, 3, 4], 100), percentile([7.0], 99)) == (1, 4, 7.0)
    values = [random.Random(1).expovariate(1) for _ in range(101)]
    for q in (1, 50, 90, 95, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))  # numpy's default method
    with pytest.raises(ValueError):
        percentile([], 50)


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_spread() -> None:
    def gaps(rate: float, burstiness: float) -> list[float]:
        times = arrival_times(rate, burstiness, random.Random(0))
        points = [next(times) for _ in range(20_001)]
        return [b - a for a, b in zip(points, points[1:])]

    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):  # a gamma's CV is 1 / sqrt(shape)
        g = gaps(10.0, burstiness)
        assert statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
        assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.1)
    at_once = arrival_times(math.inf, 1.0, random.Random(0))
    assert [next(at_once) for _ in range(5)] == [0.0] * 5


def test_summary_tpot_and_goodput_by_hand() -> None:
    fast = RequestResult(4, 5, ttft=0.1, itl=[0.05] * 4, e2e=0.3, output_tokens=5)  # TPOT 0.05
    slow = RequestResult(6, 5, ttft=0.6, itl=[0.2] * 4, e2e=1.4, output_tokens=5)  # TPOT 0.2
    single = RequestResult(2, 1, ttft=0.2, e2e=0.2, output_tokens=1)  # no TPOT
    refused = RequestResult(3, 5, error="HTTP 429")
    s = summarize([fast, slow, single, refused], duration_s=2.0, peak_concurrency=3,
                  slo=parse_slo("ttft=500ms,tpot=100ms"))
    assert (s.completed, s.failed, s.errors) == (3, 1, {"HTTP 429": 1})
    assert (s.input_tokens, s.output_tokens) == (12, 11)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (1.5, 5.5, 11.5)
    assert s.goodput == 1.0  # fast and single meet both; slow misses both
    assert s.tpot_ms.mean == pytest.approx(125) and s.tpot_ms.p50 == pytest.approx(125)
    assert s.ttft_ms.p50 == pytest.approx(200) and s.e2el_ms.mean == pytest.approx(633.333, rel=1e-4)
    assert len([g for r in (fast, slow) for g in r.itl]) == 8 and s.itl_ms.p50 == pytest.approx(125)
    assert summarize([refused], 1.0, 1).ttft_ms.p99 is None


def test_slos_and_specs_are_checked() -> None:
    assert parse_slo("ttft=500ms, tpot=100,e2e=2s") == {"ttft": 0.5, "tpot": 0.1, "e2el": 2.0}
    for bad in ("ttft", "latency=1s", "ttft=fast", "tpot=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    with pytest.raises(ValueError, match="bound"):
        LoadSpec(num_prompts=None)
    with pytest.raises(ValueError, match="infinite"):
        LoadSpec(num_prompts=None, duration=5)
    with pytest.raises(ValueError, match="range_ratio"):
        LoadSpec(range_ratio=1.0)
    assert LoadSpec(input_len=100, range_ratio=0.5).length_range(100) == (50, 150)


def test_prompts_are_random_tokens_corpus_windows_or_fixed_ones_of_the_asked_lengths(monkeypatch) -> None:
    spec = LoadSpec(input_len=10, output_len=20, range_ratio=0.5)
    pairs = [pair for pair, _ in zip(prompts(spec, random.Random(0)), range(200))]
    assert {len(p) for p, _ in pairs} <= set(range(5, 16)) and {n for _, n in pairs} <= set(range(10, 31))
    assert all(0 <= t < EOT_ID for p, _ in pairs for t in p) and len({len(p) for p, _ in pairs}) > 5
    monkeypatch.setattr(loadgen_client, "_corpus_tokens", lambda: np.arange(1000, dtype=np.uint16))
    for (prompt, _), _ in zip(prompts(replace(spec, dataset="corpus"), random.Random(0)), range(20)):
        assert prompt == list(range(prompt[0], prompt[0] + len(prompt)))  # a contiguous window
    fixed = [[1, 2, 3], [4, 5]]
    pairs = [pair for pair, _ in zip(prompts(replace(spec, fixed_prompts=fixed), random.Random(0)), range(4))]
    assert pairs == [([1, 2, 3], 20), ([4, 5], 20)] * 2  # in turn, each for output_len


# ----------------------------------------------------------------------------- live


def test_a_run_against_a_real_server_adds_up(model: GPT, tmp_path) -> None:
    with live_server(small_engine(model)) as live:
        spec = LoadSpec(url=live.url, num_prompts=24, request_rate=50, max_concurrency=6, input_len=12,
                        output_len=10, range_ratio=0.5, slo=parse_slo("ttft=2s,tpot=1s"), seed=3)
        run, s = load(spec)
        assert main(["--url", live.url, "--num-prompts", "6", "--sweep", "20,inf", "--input-len", "8",
                     "--output-len", "6", "--slo", "ttft=1ms", "--out", str(tmp_path)]) == 0
    assert (s.completed, s.failed, run.sent) == (24, 0, 24)
    assert 1 <= s.peak_concurrency <= 6
    asked = [r.output_len for r in run.results]
    assert [r.output_tokens for r in run.results] == asked and s.output_tokens == sum(asked)  # ignore_eos
    assert set(asked) != {10}  # lengths varied with range_ratio
    for lat in (s.ttft_ms, s.tpot_ms, s.itl_ms, s.e2el_ms):
        assert 0 < lat.p50 <= lat.p95 <= lat.p99
    assert all(0 < r.ttft <= r.e2e for r in run.results)
    assert s.goodput <= s.request_throughput and s.output_throughput > s.request_throughput

    report = json.loads((tmp_path / "loadtest-sweep.json").read_text())
    assert [r["request_rate"] for r in report["runs"]] == [20.0, "inf"] and report["clock"].startswith("client")
    assert all(r["completed"] == 6 and r["goodput"] <= r["request_throughput"] for r in report["runs"])
    assert "api_key" not in report["spec"] and (tmp_path / "loadtest-sweep.png").stat().st_size > 10_000


class Replay:
    """Just enough of an ``aiohttp.ClientSession`` for ``send_request``: ``post`` answers 200
    with a stream of ``(time, line)``, and the fake clock reads each line's time while the
    client is handling that line, so every timing the client takes is known exactly."""

    def __init__(self, start: float, timed_lines: list[tuple[float, bytes]]) -> None:
        self.now, self.timed_lines, self.status, self.bodies = start, timed_lines, 200, []

    def clock(self) -> float:
        return self.now

    def post(self, url: str, json: dict, timeout) -> Replay:
        self.bodies.append(json)
        return self

    async def __aenter__(self) -> Replay:
        self.content = self._lines()
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def _lines(self):
        for at, line in self.timed_lines:
            self.now = at
            yield line


def data(payload: dict | str) -> bytes:
    return b"data: " + (payload if isinstance(payload, str) else json.dumps(payload)).encode() + b"\n"


def text(t: str) -> bytes:
    return data({"choices": [{"index": 0, "text": t, "finish_reason": None}]})


def usage(tokens: int) -> bytes:
    return data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}})


def test_the_client_times_each_chunk_on_its_clock() -> None:
    """TTFT, ITL and E2E from known chunk times (binary fractions: exact in floating point),
    and TPOT over the server's token count, which can exceed the chunks: here the third chunk
    carries two tokens (a character split across them was held back)."""
    first = Replay(100.0, [(100.25, text("Once")), (100.25, b"\n"), (100.375, text(" upon")),
                           (100.5, text(" a t")), (100.75, text("ime")), (101.0, usage(5)), (101.5, data("[DONE]"))])
    second = Replay(200.0, [(200.5, text("The")), (200.75, text(" dog")), (201.0, text(" ran")),
                            (201.0, usage(3)), (202.0, data("[DONE]"))])

    async def send(replay: Replay) -> RequestResult:
        return await loadgen_client.send_request(replay, "http://fake", "minillm", [1, 2, 3], 5, 30.0,
                                                 clock=replay.clock)

    a, b = asyncio.run(send(first)), asyncio.run(send(second))
    assert first.bodies[0] == {"model": "minillm", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    assert (a.ok, a.ttft, a.itl, a.e2e, a.output_tokens) == (True, 0.25, [0.125, 0.125, 0.25], 0.75, 5)
    assert a.tpot == (0.75 - 0.25) / 4  # the usage chunk and [DONE] after the last text are not latency
    assert (b.ttft, b.itl, b.e2e, b.output_tokens, b.tpot) == (0.5, [0.25, 0.25], 1.0, 3, 0.25)

    s = summarize([a, b], duration_s=2.0, peak_concurrency=2)
    assert (s.ttft_ms.mean, s.ttft_ms.p50) == (375.0, 375.0)
    assert (s.tpot_ms.mean, s.e2el_ms.p50) == (187.5, 875.0)
    assert (s.itl_ms.mean, s.itl_ms.p50) == (200.0, 250.0)  # pooled: 125, 125, 250, 250, 250
    assert s.output_throughput == 4.0


def test_refusals_are_counted_by_status(model: GPT, monkeypatch) -> None:
    """One seat and a one-request queue: of six requests at once, the first to arrive takes
    the free seat, the second waits in the queue, and the other four are refused with 429. The
    engine takes no step until all six have been answered or queued, so no seat comes free in
    between however fast it is."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=1), get_tokenizer())
    gate = Gate(engine, monkeypatch)

    async def main(live) -> tuple[LoadRun, object]:
        run = LoadRun(LoadSpec(url=live.url, num_prompts=6, input_len=4, output_len=20, warmup=0))
        task = asyncio.create_task(run.run())
        engine_loop = live.app[STATE].engine
        while len(run.results) + engine_loop.stats.waiting < 6:  # a condition, not a time
            await asyncio.sleep(0.005)
        gate.open()
        return run, await task

    with live_server(engine, max_queue=1) as live:
        run, s = asyncio.run(asyncio.wait_for(main(live), 60))
    assert len(run.results) == 6 and (s.completed, s.failed, s.errors) == (2, 4, {"HTTP 429": 4})


def test_command_line_problems_are_one_line_errors(model: GPT, tmp_path) -> None:
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(UsageError, match="no server answered"):
        main(["--url", closed, "--num-prompts", "1", "--out", str(tmp_path)])
    for argv in (["--sweep", "1,fast"], ["--sweep", "0,1"], ["--slo", "ttft"], ["--request-rate", "0"]):
        with pytest.raises(UsageError):
            main(argv + ["--url", closed, "--out", str(tmp_path)])
    with live_server(small_engine(model)) as live:  # 128 positions of context
        with pytest.raises(UsageError, match="context of 128"):
            main(["--url", live.url, "--input-len", "100", "--output-len", "40", "--out", str(tmp_path)])


def test_without_keep_alive_every_request_opens_its_own_connection() -> None:
    """A server that closes a kept-alive connection after a few requests (llama-server) can
    race the next request sent on it; ``keep_alive=False`` (``--no-keep-alive``) sends each
    request on a connection of its own. Counted by the client ports a stub server sees."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def ports_seen(keep_alive: bool) -> tuple[int, int]:
        ports: list[int] = []

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "stub"}]})

        async def completions(request: web.Request) -> web.StreamResponse:
            ports.append(request.transport.get_extra_info("peername")[1])
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(text("x") + b"\n" + usage(1) + b"\ndata: [DONE]\n\n")
            return response

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app) as server:
            spec = LoadSpec(url=str(server.make_url("")), num_prompts=6, max_concurrency=1, input_len=4, output_len=1,
                            keep_alive=keep_alive)
            summary = await LoadRun(spec).run()
        assert summary.completed == 6
        return len(ports), len(set(ports))

    assert asyncio.run(ports_seen(True)) == (7, 1)  # the warm-up and six requests, one after another, on one connection
    assert asyncio.run(ports_seen(False)) == (7, 7)
    flags = lambda argv: spec_from_args(build_parser().parse_args(argv))  # noqa: E731
    assert flags(["--no-keep-alive"]).keep_alive is False and flags([]).keep_alive is True
