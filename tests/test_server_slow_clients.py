"""Slow and greedy clients on a real socket: none of them can hold the server's connections,
handlers or KV blocks for longer than its timeouts allow.

Each test speaks raw HTTP/1.1 over ``asyncio.open_connection``, because a well-behaved client
library cannot be made to dribble its headers or stop reading halfway through a stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from test_server_live import Live, live_server, model, small_engine  # noqa: F401 (model: fixture)

from minillm.engine.config import EngineConfig

from minillm.engine.llm_engine import LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
import server.app
from server.app import STATE


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def port_of(live: Live) -> int:
    return int(live.url.rsplit(":", 1)[1])


def post(body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}\r\n")
    return head.encode() + data


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection, which must be soon."""
    return await asyncio.wait_for(reader.read(), seconds)


def test_a_connection_must_send_its_headers_within_the_keep_alive_timeout(model: GPT) -> None:
    """A socket that never finishes its request's head (or goes quiet after an answer) held a
    descriptor for an hour: aiohttp's keep-alive timeout defaults to 3,630 s."""
    async def main(live: Live) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # ... and the rest never comes
        started = time.monotonic()
        assert await closed_within(reader, 5) == b""
        assert time.monotonic() - started < 3
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
        writer.write(post({"prompt": "Once", "max_tokens": 2}))
        answer = await closed_within(reader, 5)  # answered, then closed once idle
        assert answer.startswith(b"HTTP/1.1 200")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2

    with live_server(small_engine(model), keep_alive_timeout=0.5) as live:
        run(main(live))


def test_a_body_that_does_not_arrive_in_time_is_a_408(model: GPT) -> None:
    async def main(live: Live) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
        writer.write(post({"prompt": "Once upon a time", "max_tokens": 2})[:-5])  # five bytes short, for ever
        answer = await closed_within(reader, 5)
        assert answer.startswith(b"HTTP/1.1 408")
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and "0.5 s" in error["message"]

    with live_server(small_engine(model), client_timeout=0.5) as live:
        run(main(live))


def test_a_stream_nobody_reads_is_cut_and_its_blocks_freed(model: GPT, monkeypatch) -> None:
    """A client that asks for a long stream and never reads it: once the socket's buffers are
    full, a write waits. Before, it waited for ever, holding the request's KV blocks; now the
    stream is cut after ``--client-timeout`` and the request aborted.

    Loopback's send buffer grows to 4 MiB, more than this tiny model streams in the test's
    time, so the server's side of the socket is pinned small, as on a slow link. The tiny model's
    steps are slowed to a larger model's pace: on a fast machine it finished all 100 tokens of
    every choice before the cut, and nothing was left to abort."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256, block_size=8, max_num_seqs=16), get_tokenizer())
    step = engine.step

    def large_model_step():  # at least 4 s for the 100 steps on any machine; the cut comes in about 1.5
        time.sleep(0.04)
        return step()

    engine.step = large_model_step
    write = server.app.write_within

    async def small_buffer_write(request, response, data, timeout):
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await write(request, response, data, timeout)

    monkeypatch.setattr(server.app, "write_within", small_buffer_write)

    async def main(live: Live) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port_of(live)))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        reader._transport.pause_reading()  # and read nothing from here on
        writer.write(post({"prompt": "Once", "max_tokens": 100, "n": 16, "ignore_eos": True, "stream": True}))
        await live.wait_until(lambda s: s.running > 0)
        stats = await live.wait_until(lambda s: s.running + s.waiting == 0 and not s.computing)
        assert stats.kv_blocks_used == 0 and stats.generated_tokens < 16 * 100  # cut short, not finished
        writer.close()

    with live_server(engine, client_timeout=0.5) as live:
        run(main(live))
    metrics = live.app[STATE].metrics.render().decode()
    assert 'minillm:request_success_total{finished_reason="abort"} 16.0' in metrics


async def answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    """One HTTP response read off a kept-alive connection: its status line and JSON body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return head.split(b"\r\n", 1)[0], json.loads(await reader.readexactly(length))


def test_connections_past_the_cap_get_a_503_and_the_server_stays_up(model: GPT) -> None:
    async def main(live: Live) -> None:
        held = []
        for _ in range(3):  # each answered once, so the server has certainly counted it, then kept open
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
            writer.write(post({"prompt": "Once", "max_tokens": 1}))
            assert (await answer(reader))[0] == b"HTTP/1.1 200 OK"
            held.append(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
        refused = await closed_within(reader, 5)
        assert refused.startswith(b"HTTP/1.1 503")
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        held.pop().close()  # one leaves: there is room again, once the server has seen it go
        deadline = time.monotonic() + 5
        while True:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(live))
            writer.write(post({"prompt": "Once", "max_tokens": 2}, "Connection: close\r\n"))
            try:
                status = (await closed_within(reader, 5)).split(b"\r\n", 1)[0]
            except ConnectionResetError:  # still refused: the 503 was closed over our unread request
                status = b"reset"
            if status not in (b"HTTP/1.1 503 Service Unavailable", b"reset") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert status == b"HTTP/1.1 200 OK"

    with live_server(small_engine(model), max_connections=3) as live:
        run(main(live))


class _Transport:
    """A socket's transport with ``buffered`` bytes not yet sent (high-water mark 100)."""

    def __init__(self, buffered: int) -> None:
        self.buffered, self.aborted = buffered, False

    def is_closing(self) -> bool:
        return self.aborted

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 25, 100

    def abort(self) -> None:
        self.aborted = True


class _Request:
    def __init__(self, transport: _Transport) -> None:
        self.transport = transport


class _Response:
    def __init__(self, blocks: bool) -> None:
        self.blocks, self.written = blocks, []

    async def write(self, data: bytes) -> None:
        if self.blocks:
            await asyncio.sleep(3600)  # a client that stopped reading: the buffer never drains
        self.written.append(data)


def test_a_write_with_room_in_the_buffer_goes_without_a_timer_and_one_that_may_wait_has_one(monkeypatch) -> None:
    """A token's write arms no timer while the socket's buffer has room (it cannot wait); a write
    that could wait on a full buffer still gives up on the client after the timeout."""
    from server import wire

    def no_timer(seconds: float):
        raise AssertionError("a write that cannot wait armed a timer")

    with monkeypatch.context() as m:
        m.setattr(wire.asyncio, "timeout", no_timer)
        response = _Response(blocks=False)
        asyncio.run(wire.write_within(_Request(_Transport(10)), response, b"data: {}\n\n", timeout=0.05))
        assert response.written == [b"data: {}\n\n"]
    transport = _Transport(95)  # 95 + 10 bytes would pass the high-water mark: the write may wait
    with pytest.raises(ConnectionResetError, match="read nothing"):
        asyncio.run(wire.write_within(_Request(transport), _Response(blocks=True), b"data: {}\n\n", timeout=0.05))
    assert transport.aborted
