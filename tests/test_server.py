"""The server through aiohttp's test client: the API, streaming, disconnects, load, bad input.

Each test builds a tiny random model's engine with a small KV pool and serves it in-process;
``asyncio.run`` with a timeout drives each test, so none can hang.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import re
import threading
from typing import AsyncIterator

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from test_server_live import Gate

from minillm.model.config import ModelConfig
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import EngineStats, LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
from minillm.decoding.sampling import SamplingParams
from server.app import STATE, State, create_app
from server.config import ServerConfig
from server.engine_loop import AsyncEngine, Choice, RequestStream, ShuttingDown
from server.responses import Responses

CONTEXT = 128


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(ModelConfig(context_length=CONTEXT, d_model=64, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():  # peaky logits: greedy decoding has no near-ties to break differently
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return m


def run(coro, timeout: float = 60):
    """Drive one async test, failing it rather than hanging if it takes too long."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serving(model: GPT, num_blocks: int = 64, block_size: int = 8, max_num_seqs: int = 16,
                  **config) -> AsyncIterator[TestClient]:
    engine = LLMEngine(model, EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs),
                       get_tokenizer())
    async with TestClient(TestServer(create_app(engine, ServerConfig(**config)))) as client:
        yield client


def state(client: TestClient) -> State:
    return client.server.app[STATE]


async def settled(client: TestClient) -> AsyncEngine:
    """The server's engine loop once it has no work left (every abort applied)."""
    engine = state(client).engine
    await asyncio.wait_for(engine.wait_until(idle), 10)
    return engine


def idle(stats: EngineStats) -> bool:
    return stats.running + stats.waiting == 0 and not stats.computing


async def sse_events(response) -> list:
    """The ``data:`` payloads of a server-sent-event body, JSON-decoded except ``[DONE]``."""
    events = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def metric(client: TestClient, name: str) -> float:
    """One sample's value from /metrics (0 when absent)."""
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


GREEDY = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}


def test_streamed_text_equals_whole_text_for_completions_and_chat(model: GPT, caplog) -> None:
    caplog.set_level(logging.INFO, logger="server.access")

    async def main() -> None:
        async with serving(model) as client:
            for path, body in [("/v1/completions", {"prompt": "Once upon a time", **GREEDY}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **GREEDY})]:
                whole = await client.post(path, json=body)
                assert whole.status == 200, await whole.text()
                answer = await whole.json()
                choice = answer["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 20
                options = {"stream": True, "stream_options": {"include_usage": True}}
                streamed = await client.post(path, json={**body, **options})
                assert streamed.headers["Content-Type"].startswith("text/event-stream")
                events = await sse_events(streamed)
                assert events[-1] == "[DONE]" and events[-2]["usage"] == answer["usage"]
                chunks = events[:-2]
                pieces = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text", "")
                          for c in chunks]
                assert "".join(pieces) == text and len(chunks) > 1
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                if "message" in choice:
                    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            loop = await settled(client)
            assert loop.stats.kv_blocks_used == 0
            # nothing of the four finished requests is left in the server's or the engine's tables
            assert loop._streams == {} and loop._outbox == [] and loop.engine.unfinished_request_ids == []

    run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "server.access"]
    assert len(lines) == 4
    assert re.fullmatch(r"request_id=cmpl-\w+ path=/v1/completions status=200 prompt_tokens=4 completion_tokens=20 "
                        r"ttft_ms=[\d.]+ total_ms=[\d.]+ finish_reason=length user=-", lines[0]), lines[0]


def test_stop_strings_n_and_prompt_lists(model: GPT) -> None:
    async def main() -> None:
        async with serving(model) as client:
            first = await (await client.post("/v1/completions", json={"prompt": "Once upon a time", **GREEDY})).json()
            text = first["choices"][0]["text"]
            stop = text[len(text) // 2:][:3]  # three characters from the middle of the greedy answer
            cut = await (await client.post("/v1/completions",
                                           json={"prompt": "Once upon a time", **GREEDY, "stop": [stop]})).json()
            assert cut["choices"][0]["finish_reason"] == "stop"
            assert cut["choices"][0]["text"] == text[:text.index(stop)]
            many = await (await client.post("/v1/completions", json={
                "prompt": ["Once upon a time", "The dog"], "n": 2, "max_tokens": 5, "seed": 3})).json()
            assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
            assert many["usage"]["prompt_tokens"] == 4 + 2 and many["usage"]["completion_tokens"] == 20
            again = await (await client.post("/v1/completions", json={
                "prompt": ["Once upon a time", "The dog"], "n": 2, "max_tokens": 5, "seed": 3})).json()
            assert [c["text"] for c in again["choices"]] == [c["text"] for c in many["choices"]]  # seeded
            models = await (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == "minillm" and models["data"][0]["max_model_len"] == CONTEXT

    run(main())


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(model: GPT, monkeypatch) -> None:
    async def main() -> None:
        async with serving(model) as client:
            engine_loop = state(client).engine
            gate = Gate(engine_loop.engine, monkeypatch)  # exactly three steps, then the engine holds
            gate.allow(3)
            response = await client.post("/v1/completions", json={
                "prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True})
            assert (await response.content.readline()).startswith(b"data: ")
            held = await asyncio.wait_for(engine_loop.wait_until(lambda s: s.generated_tokens == 3), 10)
            assert held.running == 1 and held.kv_blocks_used > 0
            response.close()  # walk away mid-stream
            s = await settled(client)  # no step can finish it now: only the abort can empty the engine
            assert (s.stats.kv_blocks_used, s.stats.running, s.stats.waiting) == (0, 0, 0)
            assert s.stats.generated_tokens == 3
            assert await metric(client, 'minillm:request_success_total{finished_reason="abort"}') == 1

    run(main())


def test_a_hundred_concurrent_streams_against_a_small_pool(model: GPT, monkeypatch) -> None:
    """Every client completes or is told 429 with Retry-After; nothing hangs or leaks.

    The engine is held until the first half of the burst has reached it, so the burst is a
    burst however fast this machine is: 8 take the free seats, 8 are queued and 34 refused for
    sure (the queue's bound counts only what the seats cannot take); the second
    half arrives while requests run and finish, and is queued or refused as room allows.
    """
    n, max_tokens = 100, 24

    async def one(client: TestClient, i: int) -> int:
        response = await client.post("/v1/completions", json={
            "prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
        if response.status == 429:
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "rate_limit_exceeded"
            return 429
        events = await sse_events(response)
        assert response.status == 200 and events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert len(events) - 1 <= max_tokens
        return 200

    async def main() -> None:
        async with serving(model, num_blocks=24, max_num_seqs=8, max_queue=8) as client:
            hold_until_half_arrived(state(client).engine, n // 2, monkeypatch)
            statuses = await asyncio.gather(*(one(client, i) for i in range(n)))
            done, refused = statuses.count(200), statuses.count(429)
            assert done + refused == n and done >= 16 and refused >= n // 2 - 16
            s = await settled(client)
            assert s.stats.kv_blocks_used == 0 and s.stats.preemptions > 0  # the small pool was felt
            assert (await client.get("/health")).status == 200
            assert await metric(client, 'minillm:request_success_total{finished_reason="length"}') == done
            assert await metric(client, 'minillm:http_requests_total{path="/v1/completions",status="429"}') == refused
            assert await metric(client, "minillm:generation_tokens_total") == done * max_tokens
            assert await metric(client, "minillm:time_to_first_token_seconds_count") == done
            assert await metric(client, "minillm:num_preemptions_total") == s.stats.preemptions

    run(main())


def hold_until_half_arrived(engine_loop: AsyncEngine, arrivals: int, monkeypatch) -> None:
    """Let the engine thread take requests but not step until ``arrivals`` have reached it."""
    arrived = threading.Event()
    count = itertools.count(1)
    add, step = engine_loop._add, engine_loop.engine.step

    def counting_add(message) -> None:
        add(message)
        if next(count) == arrivals:
            arrived.set()

    def held_step():
        return step() if arrived.wait(0.001) else []

    monkeypatch.setattr(engine_loop, "_add", counting_add)
    monkeypatch.setattr(engine_loop.engine, "step", held_step)


CASES = [  # (what, body or raw bytes, status, param)
    ("malformed JSON", b'{"prompt": "hi",', 400, None),
    ("not an object", [1, 2], 400, None),
    ("prompt of the wrong type", {"prompt": 5}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", {"prompt": []}, 400, "prompt"),
    ("token id beyond the vocabulary", {"prompt": [60000]}, 400, "prompt"),
    ("max_tokens a string", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("prompt plus max_tokens beyond the context", {"prompt": [7] * 100, "max_tokens": 29}, 400, "max_tokens"),
    ("prompt filling the context", {"prompt": "word " * 200}, 400, "prompt"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("stream not a boolean", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("empty stop string", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("n zero", {"prompt": "hi", "n": 0}, 400, "n"),
    ("unknown field", {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("logprobs past 5", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("tools", {"prompt": "hi", "tools": [{"type": "function"}]}, 400, "tools"),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("more blocks than the pool", {"prompt": "hi", "max_tokens": 100}, 400, None),
    ("unknown model", {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    ("body over the size limit", {"prompt": "x" * 5000}, 413, None),
]
CHAT_CASES = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("content not text", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("max_completion_tokens zero", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
]


def test_bad_inputs_get_the_right_4xx_and_a_json_error_then_a_good_request_succeeds(model: GPT) -> None:
    async def check(client: TestClient, path: str, what: str, body, status: int, param) -> None:
        raw = isinstance(body, bytes)
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if raw else {"json": body}
        response = await client.post(path, **kwargs)
        error = (await response.json())["error"]
        assert response.status == status, (what, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
        if param is not None:
            assert error["param"] == param, (what, error)

    async def main() -> None:
        async with serving(model, num_blocks=8, max_body_bytes=4096) as client:  # the pool holds 64 tokens
            for what, body, status, param in CASES:
                await check(client, "/v1/completions", what, body, status, param)
            for what, body, status, param in CHAT_CASES:
                await check(client, "/v1/chat/completions", what, body, status, param)
            assert (await client.get("/v1/completions")).status == 405
            assert (await client.post("/v1/nothing", json={})).status == 404
            good = await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5})
            assert good.status == 200 and (await good.json())["usage"]["completion_tokens"] == 5
            assert (await settled(client)).stats.kv_blocks_used == 0

    run(main())


def test_api_key(model: GPT) -> None:
    async def main() -> None:
        async with serving(model, api_key="sekrit") as client:
            body = {"prompt": "hi", "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                response = await client.post("/v1/completions", json=body, headers=headers)
                assert response.status == 401 and (await response.json())["error"]["code"] == "invalid_api_key"
            assert (await client.get("/v1/models")).status == 401
            ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
            assert ok.status == 200
            assert (await client.get("/health")).status == 200  # probes need no key
            basic = "Basic " + base64.b64encode(b"anyone:sekrit").decode()
            wrong = "Basic " + base64.b64encode(b"sekrit:wrong").decode()
            for path in ("/metrics", "/", "/dashboard/events", "/dashboard/static/dashboard.js"):
                refused = await client.get(path)  # a browser is offered Basic auth, the key as the password
                assert refused.status == 401 and refused.headers["WWW-Authenticate"].startswith("Basic")
                assert (await client.get(path, headers={"Authorization": wrong})).status == 401
            for authorization in (basic, "Bearer sekrit", "bearer  sekrit"):
                assert (await client.get("/metrics", headers={"Authorization": authorization})).status == 200
            assert (await client.delete("/dashboard/traffic")).status == 401
            assert (await client.get("/v1/models")).headers["WWW-Authenticate"] == "Bearer"
            assert (await client.get("/v1/models", headers={"Authorization": basic})).status == 200

    run(main())


def test_a_failing_request_leaves_the_others_running(model: GPT, monkeypatch) -> None:
    """A bug in one request's handling (here: building its whole answer) is a 500 for that
    request alone; a concurrent stream finishes, and nothing leaks."""
    def broken(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(Responses, "full", broken)

    async def main() -> None:
        async with serving(model) as client:
            streaming = client.post("/v1/completions", json={"prompt": "Once", **GREEDY, "stream": True})
            whole = client.post("/v1/completions", json={"prompt": "The dog", **GREEDY})
            streamed, failed = await asyncio.gather(streaming, whole)
            assert failed.status == 500 and (await failed.json())["error"]["type"] == "server_error"
            events = await sse_events(streamed)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert (await settled(client)).stats.kv_blocks_used == 0
            assert (await client.get("/health")).status == 200

    run(main())


def test_a_failing_engine_step_ends_only_its_batch(model: GPT, monkeypatch) -> None:
    """A step that raises fails the requests in its batch and nobody else: mid-stream, as an
    error event; before the first token, as a 500. With max_num_seqs=1 the other request,
    waiting meanwhile, is served, and the loop stays healthy throughout."""
    async def main() -> None:
        async with serving(model, max_num_seqs=1) as client:
            runner = state(client).engine.engine.runner
            execute, calls, fail_at = runner.execute_prepared, [], {5}

            def failing(step):
                calls.append(step)
                if len(calls) in fail_at:
                    raise RuntimeError("device on fire")
                return execute(step)

            monkeypatch.setattr(runner, "execute_prepared", failing)
            alone = await client.post("/v1/completions", json={"prompt": "Once", **GREEDY, "stream": True})
            events = await sse_events(alone)
            assert alone.status == 200 and len(events) >= 3 and events[-1] == "[DONE]"  # some text came first
            assert events[-2]["error"]["code"] == "engine_error" and "device on fire" in events[-2]["error"]["message"]

            fail_at.add(len(calls) + 1)  # the next step: whichever of two requests runs first
            a, b = await asyncio.gather(client.post("/v1/completions", json={"prompt": "Once", **GREEDY}),
                                        client.post("/v1/completions", json={"prompt": "The dog", **GREEDY}))
            assert sorted([a.status, b.status]) == [200, 500]
            failed, served = (a, b) if a.status == 500 else (b, a)
            assert "device on fire" in (await failed.json())["error"]["message"]
            assert (await served.json())["choices"][0]["finish_reason"] == "length"

            s = await settled(client)
            assert s.stats.kv_blocks_used == 0 and s.alive
            assert await metric(client, 'minillm:request_success_total{finished_reason="error"}') == 2
            assert (await client.post("/v1/completions", json={"prompt": "Once", **GREEDY})).status == 200

    run(main())


def test_health_is_503_once_the_engine_stops(model: GPT) -> None:
    async def main() -> None:
        async with serving(model) as client:
            assert (await client.get("/health")).status == 200
            await state(client).engine.stop()
            assert (await client.get("/health")).status == 503
            refused = await client.post("/v1/completions", json={"prompt": "hi"})
            assert refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"

    run(main())


@contextlib.asynccontextmanager
async def engine_loop(model: GPT, max_num_seqs: int = 16) -> AsyncIterator[AsyncEngine]:
    """An engine loop with no HTTP around it, stopped on the way out."""
    loop = AsyncEngine(LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=max_num_seqs),
                                 get_tokenizer()))
    loop.start()
    try:
        yield loop
    finally:
        await loop.stop()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def drain(stream: RequestStream, choices: int) -> list[list[int]]:
    """Each choice's tokens, from the stream's events, which must each name their own choice."""
    tokens: list[list[int]] = [[] for _ in range(choices)]
    async for event in stream:
        assert event.output.request_id == Choice(stream.request_id, event.index, choices)
        tokens[event.index] += event.output.new_token_ids
    stream.close()
    return tokens


def test_two_choices_of_one_request_stream_independently(model: GPT) -> None:
    """Each output reaches its own choice: a choice that stops early ends while its sibling runs
    on, each gets the tokens it would alone, and a request beside them gets only its own."""
    prompt = get_tokenizer().encode("Once upon a time")

    async def main() -> None:
        async with engine_loop(model) as loop:
            both = loop.submit("both", [prompt, prompt], [greedy(8), greedy(3)], 0.0)
            other = loop.submit("other", [prompt], [greedy(3)], 0.0)
            (long, short), (alone,) = await asyncio.gather(drain(both, 2), drain(other, 1))
            assert len(long) == 8 and short == long[:3] == alone
            assert loop._streams == {} and idle(await loop.wait_until(idle))

    run(main())


def test_closing_a_request_aborts_every_one_of_its_choices(model: GPT) -> None:
    """A request that goes away ends all of its choices at once (the engine then runs just the
    other request, which a single aborted choice would not leave), and no other request's."""
    prompt = get_tokenizer().encode("Once upon a time")

    async def main() -> None:
        async with engine_loop(model) as loop:
            leaving = loop.submit("leaving", [prompt] * 3, [greedy(100)] * 3, 0.0)
            staying = loop.submit("staying", [prompt], [greedy(10)], 0.0)
            await leaving.ready()
            assert leaving.close() == 3
            assert (await asyncio.wait_for(loop.wait_until(lambda s: s.running + s.waiting == 1), 10)).running == 1
            assert [len(t) for t in await drain(staying, 1)] == [10]
            assert (await loop.wait_until(idle)).kv_blocks_used == 0

    run(main())


def test_shutdown_refuses_only_requests_whose_every_choice_is_queued(model: GPT) -> None:
    """One sequence runs at a time: a request whose first choice runs while its second waits has
    started, so it runs on through a shutdown; the request queued behind it is refused."""
    prompt = get_tokenizer().encode("Once upon a time")

    async def main() -> None:
        async with engine_loop(model, max_num_seqs=1) as loop:
            started = loop.submit("started", [prompt, prompt], [greedy(20), greedy(20)], 0.0)
            queued = loop.submit("queued", [prompt], [greedy(3)], 0.0)
            await started.ready()
            loop.refuse_queued()
            with pytest.raises(ShuttingDown):
                await queued.ready()
            queued.close()
            first, second = await drain(started, 2)
            assert first == second and len(first) == 20

    run(main())
