"""The server on a real socket: the official ``openai`` client, shutdown, and ``python -m server``.

In-process servers run ``server.connections.serve`` on port 0 in a thread of their own, with
their own event loop, exactly as ``python -m server`` runs it; the SIGTERM test starts the
real command in a subprocess on a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import aiohttp
import openai
import pytest
from aiohttp import web
from models import tiny_model

from minillm.model.checkpoint import save_checkpoint
from minillm.cli import UsageError
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import EngineStats, LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
from server.__main__ import banner, build
from server.app import STATE, create_app
from server.config import ServerConfig
from server.connections import serve
from server.launch import start_server



@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model()


@dataclass
class Live:
    url: str
    app: web.Application
    loop: asyncio.AbstractEventLoop  # the server's own event loop, in its thread
    stop: Callable[[], None]  # what SIGTERM does, callable from any thread

    async def wait_until(self, predicate: Callable[[EngineStats], bool]) -> EngineStats:
        """``AsyncEngine.wait_until``, run on the server's loop, awaited from the test's."""
        coro = self.app[STATE].engine.wait_until(predicate)
        return await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop)), 10)


@contextlib.contextmanager
def live_server(engine: LLMEngine, **options) -> Iterator[Live]:
    """``serve`` in a background thread on a free port, stopped (gracefully) on exit."""
    config = ServerConfig(port=0, **options)
    app = create_app(engine, config)
    ready: queue.Queue = queue.Queue()
    handles: dict = {}

    async def main() -> None:
        handles["loop"], handles["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await serve(app, config, handles["stop"], ready.put)

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as err:  # surface a failed start instead of waiting for it
            ready.put(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    url = ready.get(timeout=30)
    assert isinstance(url, str), url
    try:
        loop = handles["loop"]
        yield Live(url, app, loop, lambda: loop.call_soon_threadsafe(handles["stop"].set))
    finally:
        with contextlib.suppress(RuntimeError):  # a test that stopped the server may find its loop closed already
            handles["loop"].call_soon_threadsafe(handles["stop"].set)
        thread.join(30)
        assert not thread.is_alive(), "the server did not shut down"


def small_engine(model: GPT) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=64, block_size=8), get_tokenizer())


def test_the_official_openai_client(model: GPT) -> None:
    with live_server(small_engine(model)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["minillm"]
        greedy = dict(model="minillm", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})

        whole = client.completions.create(prompt="Once upon a time", **greedy)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
        stream = client.completions.create(prompt="Once upon a time", stream=True, **greedy)
        assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text

        messages = [{"role": "user", "content": "Tell me a story."}]
        chat = client.chat.completions.create(messages=messages, **greedy)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 12
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **greedy))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        last, first = chunks[-1].usage, chat.usage
        assert (last.prompt_tokens, last.completion_tokens) == (first.prompt_tokens, first.completion_tokens)
        # the same prompt again: the prefix cache now holds its full blocks
        assert first.prompt_tokens_details.cached_tokens == 0 < last.prompt_tokens_details.cached_tokens

        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="minillm", prompt="hi", temperature=-1)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="hi")


class Gate:
    """The engine's steps on the test's say-so, so a test can act between two steps however
    fast or slow this machine is: a step runs only with a permit (``allow(n)`` grants ``n``;
    ``open()`` lets every step from then on run). Without one the engine thread makes an empty
    pass instead, in which it still applies its inbox (new requests, aborts, shutdown) exactly
    as it does between real steps, and publishes fresh stats. A permit is one step's tokens,
    appended and published: the engine must be serial (the default on a CPU)."""

    def __init__(self, engine: LLMEngine, monkeypatch) -> None:
        assert not engine.overlap  # an overlapped engine appends each step's tokens during the next
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        step = engine.step

        def gated_step():
            if self._open.is_set() or self._permits.acquire(timeout=0.002):
                return step()
            return []

        monkeypatch.setattr(engine, "step", gated_step)

    def allow(self, steps: int = 1) -> None:
        self._permits.release(steps)

    def open(self) -> None:
        self._open.set()


def test_a_client_that_leaves_while_queued_is_dropped_from_the_queue(model: GPT, monkeypatch) -> None:
    """Only handler cancellation can notice this client: nothing is ever written to it."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=1), get_tokenizer())
    gate = Gate(engine, monkeypatch)

    async def main(live: Live) -> None:
        url = f"{live.url}/v1/completions"
        async with aiohttp.ClientSession() as session:
            long = {"prompt": "Once", "max_tokens": 8, "ignore_eos": True, "stream": True}
            gate.allow(1)  # its first token, which its response headers wait for; then the engine holds
            async with session.post(url, json=long) as running:  # holds the only seat
                queued = asyncio.create_task(session.post(url, json={"prompt": "The dog", "max_tokens": 5}))
                await live.wait_until(lambda s: s.waiting == 1)
                queued.cancel()  # the client gives up: its connection closes
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
                stats = await live.wait_until(lambda s: s.waiting == 0)
                # dropped while the other held its seat, not steps later when it finished
                assert (stats.running, stats.generated_tokens) == (1, 1)
                gate.open()
                assert (await running.read()).endswith(b"data: [DONE]\n\n")
            metrics = await (await session.get(f"{live.url}/metrics")).text()
        assert 'minillm:request_success_total{finished_reason="abort"} 1.0' in metrics
        assert 'minillm:request_success_total{finished_reason="length"} 1.0' in metrics

    with live_server(engine) as live:
        asyncio.run(asyncio.wait_for(main(live), 30))


def test_shutdown_refuses_the_queue_at_once_and_ends_what_outlives_the_grace(model: GPT, monkeypatch) -> None:
    """At SIGTERM a queued request gets its 503 at once, not after the grace period; a stream
    still running when the grace runs out ends with an error event and ``[DONE]``, so its
    client knows the answer is cut short, instead of a bare close of the connection."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=1), get_tokenizer())
    gate = Gate(engine, monkeypatch)  # one step and no more: the stream outlives any grace period
    grace = 3.0

    async def main(live: Live) -> tuple[list[bytes], int, float]:
        lines = []
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
            gate.allow(1)  # greedy: the same first token every run, one with text, so a first line comes
            async with session.post(f"{live.url}/v1/completions", json=body) as response:
                lines.append(await response.content.readline())
                queued = asyncio.create_task(session.post(f"{live.url}/v1/completions", json={"prompt": "The dog"}))
                await live.wait_until(lambda s: s.waiting == 1)  # behind the stream, which holds the only seat
                stopped = time.monotonic()
                live.stop()
                refused = await queued
                waited = time.monotonic() - stopped
                assert (await refused.json())["error"]["code"] == "shutting_down"
                lines += [line async for line in response.content]
        return lines, refused.status, waited

    with live_server(engine, shutdown_grace=grace) as live:
        lines, status, waited = asyncio.run(asyncio.wait_for(main(live), 30))
    assert status == 503 and waited < grace / 2
    events = [line for line in lines if line.startswith(b"data: ")]
    assert events[0].startswith(b'data: {"id"') and events[-1] == b"data: [DONE]\n"
    assert json.loads(events[-2][6:])["error"]["code"] == "shutting_down"
    engine_loop = live.app[STATE].engine
    stats = engine_loop.stats
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0)
    assert stats.generated_tokens == 1 and not engine_loop.alive


def test_build_reports_a_missing_checkpoint_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--checkpoint: no checkpoint at"):
        build(ServerConfig(checkpoint=str(tmp_path / "nothing.pt"), device="cpu"))
    text = banner(ServerConfig(api_key="sekrit"), 8123)
    assert "http://127.0.0.1:8123/v1/completions" in text and "Bearer $OPENAI_API_KEY" in text
    assert 'base_url="http://127.0.0.1:8123/v1"' in text and "sekrit" not in text
    assert "the dashboard asks for it as a password" in text


def test_sigterm_during_a_stream_lets_it_finish_and_exits_0(tmp_path: Path) -> None:
    m = tiny_model(context_length=512)
    ckpt = save_checkpoint(tmp_path / "ckpt.pt", {"model": m.state_dict(), "model_config": m.cfg.to_dict()})
    env = {**os.environ, "MINILLM_HOME": str(tmp_path), "MINILLM_SHUTDOWN_GRACE": "30"}
    with start_server(ckpt, "--device", "cpu", "--kv-cache-memory", "8MiB", timeout=60, env=env) as server:
        events = asyncio.run(asyncio.wait_for(_stream_through_sigterm(server.url, server.proc), 60))
        assert server.proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 400
    deadline = time.monotonic() + 10  # the reader thread may still be collecting the last lines
    while "status=200 prompt_tokens=1 completion_tokens=400" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.output()
    assert log.index("shutting down") < log.index("status=200 prompt_tokens=1 completion_tokens=400")


def test_start_server_reports_a_server_that_never_comes_up(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no checkpoint at"):
        start_server(tmp_path / "missing.pt", "--device", "cpu", timeout=60)


async def _stream_through_sigterm(url: str, proc: subprocess.Popen) -> list:
    """Start a 400-token stream, SIGTERM the server after its first chunk, read to the end."""
    events = []
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "Once", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: "):
                    data = line[6:].decode().strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
    return events
