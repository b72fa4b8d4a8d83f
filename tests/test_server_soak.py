"""A bounded soak: a few hundred clients at once on loopback, mixing good streams and answers,
bad bodies, clients that hang up mid-stream, slow readers and readers that stop reading.

Afterwards nothing may be left over: every client has its answer (none hangs), the engine is
idle with every KV block back in the pool, every good stream has exactly the tokens a lone
greedy request gets, and the server's ``/metrics`` counts what the clients saw, no more and
no less. It runs in well under a minute, so it runs with the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections import Counter

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from test_server_live import Live, live_server, model  # noqa: F401 (model: fixture)

import server.app
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
from server.app import STATE

CLIENTS = {"stream": 100, "whole": 40, "bad": 60, "hang_up": 40, "slow": 20, "stalled": 10}
GOOD = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
STALLED = {"prompt": "Once", "max_tokens": 100, "n": 8, "ignore_eos": True, "stream": True}  # ~140 kB of events
ABORTED = ("minillm:request_success_total", (("finished_reason", "abort"),))
BAD_BODIES = [b"{", b'{"prompt": "x", "temperature": 5}', b'{"prompt": "x", "n": 1000}', b"[]",
              b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "top_k": 99999999999999999999}',
              b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', b'{"prompt": "x", "seed": 1e400}']


async def stream(session: aiohttp.ClientSession, url: str, delay: float = 0.0) -> tuple[str, int]:
    """A good stream read to its end (``delay`` between reads: a slow reader): its text, status."""
    async with session.post(f"{url}/v1/completions", json={**GOOD, "stream": True}) as response:
        events = [line[6:].strip() async for line in _paced(response.content, delay) if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-2:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]), response.status


async def _paced(content: aiohttp.StreamReader, delay: float):
    async for line in content:
        yield line
        if delay:
            await asyncio.sleep(delay)


async def whole(session: aiohttp.ClientSession, url: str) -> tuple[str, int]:
    async with session.post(f"{url}/v1/completions", json=GOOD) as response:
        return (await response.json())["choices"][0]["text"], response.status


async def bad(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[str, int]:
    headers = {"Content-Type": "application/json"}
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as response:
        error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return "", response.status


async def hang_up(session: aiohttp.ClientSession, url: str) -> tuple[str, int]:
    """Read the first event of a long stream, then close the connection."""
    response = await session.post(f"{url}/v1/completions", json={**GOOD, "max_tokens": 100, "stream": True})
    assert (await response.content.readline()).startswith(b"data: {")
    response.close()
    return "", response.status


async def stalled(port: int, held: list[asyncio.StreamWriter]) -> tuple[str, int]:
    """Ask for a long stream and never read it; the socket stays open (in ``held``) until the
    test is done, so only the server's ``--client-timeout`` can end the request."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    reader._transport.pause_reading()
    data = json.dumps(STALLED).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    held.append(writer)
    return "", 0  # no status: it never reads one


async def aborted(live: Live, expected: float, seconds: float) -> float:
    """The server's count of aborted choices once it reaches ``expected`` (or after ``seconds``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        value = counts(live.app[STATE].metrics.render().decode()).get(ABORTED, 0.0)
        if value >= expected or loop.time() > deadline:
            return value
        await asyncio.sleep(0.1)


def counts(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus page, keyed by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_few_hundred_mixed_clients_leave_nothing_behind(model: GPT, monkeypatch) -> None:
    engine = LLMEngine(model, EngineConfig(num_blocks=512, block_size=8, max_num_seqs=32), get_tokenizer())
    write = server.app.write_within

    async def small_send_buffer(request, response, data, timeout):  # loopback's grows to 4 MiB (see below)
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        await write(request, response, data, timeout)

    # A reader that stops must fill the buffers between it and the server; on loopback they grow
    # past what this tiny model streams in the test's time, so every stream's socket is held to
    # a send buffer of a slow link.
    monkeypatch.setattr(server.app, "write_within", small_send_buffer)

    async def main(live: Live) -> None:
        port = int(live.url.rsplit(":", 1)[1])
        rng = random.Random(0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            reference, _ = await whole(session, live.url)  # what every good request must get
            kinds = [kind for kind, n in CLIENTS.items() for _ in range(n)]
            rng.shuffle(kinds)
            held: list[asyncio.StreamWriter] = []

            async def client(i: int, kind: str) -> tuple[str, str, int]:
                await asyncio.sleep(rng.uniform(0, 3))  # arrivals spread over three seconds
                if kind == "stalled":
                    return kind, *await stalled(port, held)
                if kind == "bad":
                    return kind, *await bad(session, live.url, BAD_BODIES[i % len(BAD_BODIES)])
                if kind == "hang_up":
                    return kind, *await hang_up(session, live.url)
                if kind == "whole":
                    return kind, *await whole(session, live.url)
                return kind, *await stream(session, live.url, 0.02 if kind == "slow" else 0.0)

            results = await asyncio.wait_for(asyncio.gather(*(client(i, k) for i, k in enumerate(kinds))), 120)
            expected_aborts = CLIENTS["hang_up"] + CLIENTS["stalled"] * STALLED["n"]
            assert await aborted(live, expected_aborts, 30) == expected_aborts  # the stalled were cut
            stats = await live.wait_until(lambda s: s.running + s.waiting == 0 and not s.computing)
            for writer in held:
                writer.close()
            metrics = counts(await (await session.get(f"{live.url}/metrics")).text())

        statuses = Counter((kind, status) for kind, _, status in results)
        assert statuses == Counter({("bad", 400): CLIENTS["bad"], ("stalled", 0): CLIENTS["stalled"],
                                    **{(k, 200): n for k, n in CLIENTS.items() if k not in ("bad", "stalled")}})
        good = [text for kind, text, _ in results if kind in ("stream", "whole", "slow")]
        assert len(good) == 160 and set(good) == {reference}  # nobody lost a token to the others
        assert stats.kv_blocks_used == 0

        finished = {reason: metrics.get(("minillm:request_success_total", (("finished_reason", reason),)), 0)
                    for reason in ("length", "stop", "abort", "error")}
        assert finished == {"length": 1 + len(good), "stop": 0, "error": 0, "abort": expected_aborts}
        completions = {status: value for (name, labels), value in metrics.items()
                       if name == "minillm:http_requests_total" and ("path", "/v1/completions") in labels
                       for key, status in labels if key == "status"}
        assert completions["400"] == CLIENTS["bad"] and "500" not in completions
        e2e = metrics[("minillm:e2e_request_latency_seconds_count", ())]
        assert e2e == 1 + len(good)  # a latency for every choice that finished, none for the rest

    with live_server(engine, client_timeout=1.0) as live:
        asyncio.run(asyncio.wait_for(main(live), 150))
