"""The server against hostile input and a failing engine: whatever a client sends, it gets an
answer (200, or a 4xx in OpenAI's error shape), other requests lose nothing, and an engine
that wedges or dies is reported (``/health``) or ends the process, never left answering 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import urllib.error
import urllib.request
from typing import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import GREEDY, metric, model, run, serving, settled, sse_events, state  # noqa: F401 (model: fixture)

from minillm.engine.config import EngineConfig

from minillm.engine.llm_engine import EngineDead, LLMEngine
from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
from server.app import STATE, create_app
from server.config import ServerConfig
from server.engine_loop import AsyncEngine

COMPLETION = {"prompt": "Once", **GREEDY}


# ----------------------------------------------------------------------------- isolation


def test_anything_raised_while_admitting_ends_that_request_only(model: GPT, monkeypatch) -> None:
    """Only ValueError was caught at admission; anything else marked the whole loop dead."""
    async def main() -> None:
        async with serving(model) as client:
            engine = state(client).engine.engine
            add = engine.add_request

            def picky(request_id, prompt, params, arrival):
                if params.max_tokens == 7:
                    raise OverflowError("a number too large for the engine")
                return add(request_id, prompt, params, arrival)

            monkeypatch.setattr(engine, "add_request", picky)
            stream = await client.post("/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 40})
            bad = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 7})
            assert bad.status == 500 and (await bad.json())["error"]["code"] == "engine_error"
            events = await sse_events(stream)
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert state(client).engine.alive and (await client.get("/health")).status == 200
            assert (await client.post("/v1/completions", json=COMPLETION)).status == 200

    run(main())


def test_a_request_the_failing_step_had_finished_still_gets_its_error(model: GPT, monkeypatch) -> None:
    """A step that raises after finishing a request loses that request's last output: its
    client must get the error, not wait for ever (the run's timeout would catch a hang)."""
    async def main() -> None:
        async with serving(model) as client:
            scheduler = state(client).engine.engine.scheduler
            postprocess, failed = scheduler.postprocess, []

            def failing(output):
                postprocess(output)  # finishes the one-token request and frees its blocks
                if not failed and any(c.seq.is_finished for c in output.chunks):
                    failed.append(True)
                    raise RuntimeError("lost the outputs")

            monkeypatch.setattr(scheduler, "postprocess", failing)
            answer = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
            assert answer.status == 500 and "lost the outputs" in (await answer.json())["error"]["message"]
            assert (await settled(client)).stats.kv_blocks_used == 0
            assert (await client.post("/v1/completions", json=COMPLETION)).status == 200

    run(main(), timeout=30)


def test_a_scheduling_failure_names_scheduling_and_the_loop_goes_on(model: GPT, monkeypatch) -> None:
    """When ``schedule()`` raises, no batch ran: the previous step's batch is not blamed as
    if it had failed; every request ends with an error that says scheduling failed."""
    async def main() -> None:
        async with serving(model) as client:
            scheduler = state(client).engine.engine.scheduler
            schedule, armed = scheduler.schedule, [True]

            def failing(now):
                if armed[0] and scheduler.num_waiting and scheduler.running:
                    armed[0] = False
                    raise RuntimeError("bad bookkeeping")
                return schedule(now)

            monkeypatch.setattr(scheduler, "schedule", failing)
            running = await client.post("/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 100})
            await state(client).engine.wait_until(lambda s: s.running == 1)
            late = await client.post("/v1/completions", json=COMPLETION)
            events = await sse_events(running)
            assert "while scheduling" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
            assert late.status == 500 and "while scheduling" in (await late.json())["error"]["message"]
            assert (await settled(client)).stats.kv_blocks_used == 0
            assert (await client.post("/v1/completions", json=COMPLETION)).status == 200

    run(main())


# ----------------------------------------------------------------------------- health


def test_health_is_503_while_a_step_is_wedged_and_200_once_it_returns(model: GPT, monkeypatch) -> None:
    """The heartbeat is a step's completion: a step running past --stall-timeout (on a fake
    clock here) is a wedged engine, whatever its thread's liveness says."""
    async def main() -> None:
        async with serving(model, stall_timeout=60) as client:
            loop_engine = state(client).engine
            now, release = [0.0], threading.Event()
            loop_engine.clock = lambda: now[0]
            execute = loop_engine.engine.runner.execute_prepared
            monkeypatch.setattr(loop_engine.engine.runner, "execute_prepared", lambda step: release.wait(30) and execute(step))
            request = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
            while loop_engine._step_started is None:  # the wedged step has begun
                await asyncio.sleep(0.005)
            now[0] = 60.0
            assert (await client.get("/health")).status == 200  # at the limit, not past it
            now[0] = 61.0
            wedged = await client.get("/health")
            assert wedged.status == 503 and (await wedged.json())["status"] == "stalled"
            release.set()
            assert (await request).status == 200
            assert (await client.get("/health")).status == 200

    run(main())


def test_a_crashed_engine_loop_ends_the_server_with_a_non_zero_status(model: GPT, monkeypatch) -> None:
    """``python -m server`` whose engine loop dies exits 1 (a supervisor restarts it) instead
    of staying up to answer 500 for ever."""
    import server.__main__ as entry

    engine = LLMEngine(model, EngineConfig(num_blocks=32, block_size=8), get_tokenizer())
    monkeypatch.setattr(entry, "build", lambda config: engine)

    def broken(self) -> bool:
        raise RuntimeError("a bug in the loop itself")

    monkeypatch.setattr(AsyncEngine, "apply_messages", broken)
    # On this (main) thread, where the server can install its signal handlers. Should the
    # crash go unnoticed, the server would serve on: a SIGINT after 30 s ends it, with status 0.
    watchdog = threading.Timer(30, signal.raise_signal, (signal.SIGINT,))
    watchdog.start()
    try:
        assert entry.main(["--port", "0"]) == 1
    finally:
        watchdog.cancel()


def test_an_engine_that_cannot_step_ends_the_loop_even_while_idle(model: GPT, monkeypatch) -> None:
    """A split model's lost worker (EngineDead) is not one batch's failure: the next step would
    fail the same way, so the loop ends (the server then exits). A step that raises it ends the
    running requests with an error; an idle loop finds it by asking ``check_alive``."""
    async def main() -> None:
        async with serving(model) as client:
            loop_engine = state(client).engine
            monkeypatch.setattr(loop_engine.engine, "step", lambda: (_ for _ in ()).throw(EngineDead("rank 1 is gone")))
            response = await client.post("/v1/completions", json=COMPLETION)
            assert response.status == 500 and "stopped" in (await response.json())["error"]["message"]
            assert not loop_engine.alive
        async with serving(model) as client:
            loop_engine = state(client).engine
            monkeypatch.setattr(loop_engine.engine, "check_alive", lambda: (_ for _ in ()).throw(EngineDead("gone")))
            for _ in range(100):  # within about a second of idling
                if not loop_engine.alive:
                    break
                await asyncio.sleep(0.05)
            assert not loop_engine.alive

    run(main())


def test_the_stall_timeout_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="stall_timeout"):
        ServerConfig(stall_timeout=0)


# ----------------------------------------------------------------------------- malformed bodies


async def raw_request(client: TestClient, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send bytes no HTTP client library would let through; the status and the JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    response = await reader.read()
    writer.close()
    status = int(response.split(b" ", 2)[1])
    return status, json.loads(response.split(b"\r\n\r\n", 1)[1])


def test_malformed_bodies_and_headers_are_4xx_in_openais_shape(model: GPT) -> None:
    async def main() -> None:
        async with serving(model, api_key="sk-test") as client:
            key = {"Authorization": "Bearer sk-test"}
            post = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
            cases = {
                "unknown charset": (post + "Content-Type: application/json; charset=klingon\r\n", b"{}", 415),
                "bytes not in the charset": (post + "Content-Type: application/json\r\n", b'{"prompt": "\xff"}', 400),
                "nested too deeply": (post + "Content-Type: application/json\r\n", b"[" * 100_000, 400),
                "non-ASCII bytes in the key": ("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                               "Content-Type: application/json\r\n", b"{}", 401),
            }
            for name, (head, body, status) in cases.items():
                head_bytes = head.encode()
                if name == "non-ASCII bytes in the key":
                    head_bytes += b"Authorization: Bearer sk-\xe9\xff\r\n"
                got, answer = await raw_request(client, head_bytes, body)
                assert got == status and set(answer["error"]) >= {"message", "type", "code"}, (name, answer)
            latin = '{"prompt": "caf\u00e9", "max_tokens": 2}'.encode("latin-1")
            ok, _ = await raw_request(client, (post + "Content-Type: application/json; charset=latin-1\r\n").encode(),
                                      latin)
            assert ok == 200
            chat = await client.post("/v1/chat/completions", headers=key,
                                     json={"messages": [{"role": ["user"], "content": "hi"}]})
            assert chat.status == 400 and (await chat.json())["error"]["param"] == "messages"
            assert (await client.post("/v1/completions", headers=key, json=COMPLETION)).status == 200

    run(main())


# ----------------------------------------------------------------------------- fuzzing


@contextlib.contextmanager
def background_server(model: GPT) -> Iterator[tuple[str, AsyncEngine]]:
    """The server on its own event-loop thread, for a synchronous (hypothesis) test to call."""
    loop = asyncio.new_event_loop()
    engine = LLMEngine(model, EngineConfig(num_blocks=256, block_size=8, max_num_seqs=16), get_tokenizer())
    app = create_app(engine, ServerConfig())
    server = TestServer(app)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start_server(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{server.port}", app
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
# Edges and extremes, each as likely as the others: hypothesis favours small values, which
# would leave the dangerous ones (past 64 bits, past float32) almost never tried.
NUMBERS = st.sampled_from([0, 1, -1, -2, 3, 300, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400, 0.5, 2.0,
                           2.0000001, 1e-50, 1e-300, 5e-324, 1e308, -0.0]) | st.floats(-3, 5)
FIELDS = {
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 50_300), max_size=8) | st.lists(st.text(max_size=8), max_size=3)
    | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x", ["user"],
                                                                          {"user": 1}, 3]) | JSON,
                                                "content": st.text(max_size=20) | JSON}), max_size=3) | JSON,
    "max_tokens": NUMBERS | JSON, "max_completion_tokens": NUMBERS, "temperature": NUMBERS | JSON, "top_p": NUMBERS,
    "top_k": NUMBERS, "seed": NUMBERS, "n": st.integers(-1, 70) | JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=600), max_size=6) | JSON,
    "stream": st.booleans() | JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "ignore_eos": st.booleans(), "model": st.sampled_from(["minillm", "gpt-4"]) | JSON, "user": JSON,
    "logprobs": JSON, "echo": JSON, "logit_bias": JSON, "unknown_field": JSON,
}
VALID = {
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60_000), "seed": st.integers(-(2**40), 2**40), "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4), "stream": st.booleans(), "ignore_eos": st.booleans(),
}
PROMPTS = {"/v1/completions": ("prompt", st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 50_256), min_size=1,
                                                                                       max_size=8)),
           "/v1/chat/completions": ("messages", st.lists(st.fixed_dictionaries(
               {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}),
               min_size=1, max_size=3))}


@st.composite
def bodies(draw, path: str) -> dict:
    """A good request for ``path`` with up to three fields replaced by anything at all."""
    name, prompt = PROMPTS[path]
    body = {name: draw(prompt), **draw(st.fixed_dictionaries({}, optional=VALID))}
    for field in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[field] = draw(FIELDS[field])
    return body


def test_whatever_the_body_the_answer_is_200_or_a_json_4xx(model: GPT) -> None:
    """Property: for any body on either endpoint, no 5xx; a 4xx carries OpenAI's error object;
    and after all of them the engine holds nothing and serves a good request."""
    with background_server(model) as (url, app):
        seen: dict[int, int] = {}

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(request=st.sampled_from(sorted(PROMPTS)).flatmap(lambda path: st.tuples(st.just(path), bodies(path))),
               raw=st.none() | st.none() | st.binary(max_size=30))
        def check(request: tuple[str, dict], raw: bytes | None) -> None:
            path, body = request
            data = raw if raw is not None else json.dumps(body).encode()
            status, answer = post(url + path, data)
            seen[status] = seen.get(status, 0) + 1
            assert status == 200 or 400 <= status < 500, (status, body, answer[:300])
            if status != 200:
                assert set(json.loads(answer)["error"]) >= {"message", "type", "param", "code"}
            elif answer.startswith(b"data: "):  # a stream: a failure after its 200 would be an error event
                events = [json.loads(line[6:]) for line in answer.split(b"\n") if line.startswith(b"data: {")]
                assert not any("error" in event for event in events), (body, answer[-300:])

        check()
        assert seen.get(200, 0) > 5 and sum(n for s, n in seen.items() if s >= 400) > 50  # both kinds were tried
        status, _ = post(url + "/v1/completions", json.dumps(COMPLETION).encode())
        assert status == 200
        engine = app[STATE].engine.engine
        assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished


def test_a_long_stream_keeps_every_token_while_bad_requests_arrive(model: GPT) -> None:
    """The victim: a good stream runs through a burst of bad requests of every kind and
    ends with all its tokens."""
    bad = [{"prompt": "x", "temperature": 10**400}, {"prompt": "x", "top_k": 2**70}, {"prompt": "x", "seed": 2**64},
           {"prompt": "x", "stop": ["s"] * 9}, {"prompt": "x", "stop": ["a" * 100_000]}, {"prompt": [70_000]},
           {"messages": [{"role": ["user"], "content": "x"}]}, {"prompt": ["x"] * 65}, {"prompt": "x", "n": 10**30}]
    odd_but_fine = {"prompt": "x", "temperature": 1e-300, "max_tokens": 3}  # greedy, not NaN

    async def main() -> None:
        async with serving(model, num_blocks=128) as client:
            victim = await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 100, "stream": True,
                                                                "stream_options": {"include_usage": True}})
            paths = ["/v1/chat/completions" if "messages" in b else "/v1/completions" for b in bad]
            answers = await asyncio.gather(*(client.post(p, json=b) for p, b in zip(paths * 4, bad * 4)),
                                           client.post("/v1/completions", json=odd_but_fine))
            assert [a.status for a in answers] == [400] * len(bad) * 4 + [200]
            events = await sse_events(victim)
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 100
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert (await settled(client)).stats.kv_blocks_used == 0

    run(main())
