"""The load generator's engine: what to send, when to send it, and one timed streaming request.

Arrivals are *open-loop*: request ``i`` leaves at its scheduled time whether or not earlier
ones have finished, as real users arrive. (A closed loop, "send the next when one returns",
slows down exactly when the server does and hides the queue that builds up.) The gaps between
arrivals are drawn from a gamma distribution with mean ``1 / rate``: shape 1 is the
exponential, i.e. Poisson arrivals; a smaller shape (``burstiness``) bunches them together,
a larger one spaces them evenly. ``--max-concurrency`` is a client-side cap on top: a request
whose time has come waits for a free slot, and its clock starts when it is sent, as in vLLM.

Every request streams with ``ignore_eos`` so it produces exactly the tokens asked for, and
asks for the usage chunk, so the token count is the server's, not a count of chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import time
from dataclasses import dataclass
from typing import AsyncContextManager, Callable, Iterator, Sequence

import aiohttp

from minillm.data.tokenizer import EOT_ID
from server.flags import check
from server.loadgen.stats import RequestResult, Summary, summarize

DEFAULT_URL = "http://127.0.0.1:8000"
DATASETS = ("random", "corpus")


@dataclass
class LoadSpec:
    """One run's traffic. It always ends by itself: after ``num_prompts`` requests or when
    ``duration`` seconds of arrivals have passed, whichever comes first, and every request is
    bounded by ``request_timeout``."""

    url: str = DEFAULT_URL
    num_prompts: int | None = 100
    duration: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 64
    output_len: int = 64
    range_ratio: float = 0.0
    dataset: str = "random"
    warmup: int = 1
    seed: int = 0
    request_timeout: float = 120.0
    slo: dict[str, float] | None = None  # seconds, from loadgen_stats.parse_slo
    api_key: str | None = None
    fixed_prompts: list[list[int]] | None = None  # sent in turn instead of the dataset's, each for output_len
    # reuse connections between requests; False opens one per request, for servers that close a
    # kept-alive connection after a few requests (llama-server), a close that can race the next request
    keep_alive: bool = True

    def __post_init__(self) -> None:
        if self.num_prompts is None and self.duration is None:
            raise ValueError("a run needs a bound: num_prompts, duration, or both")
        if self.num_prompts is None and math.isinf(self.request_rate):
            raise ValueError("an infinite request rate sends everything at once, so it needs num_prompts")
        check(self, [("num_prompts", self.num_prompts is None or self.num_prompts >= 1, ">= 1"),
                     ("duration", self.duration is None or self.duration > 0, "> 0"),
                     ("request_rate", self.request_rate > 0, "> 0"), ("burstiness", self.burstiness > 0, "> 0"),
                     ("max_concurrency", self.max_concurrency is None or self.max_concurrency >= 1, ">= 1"),
                     ("input_len", self.input_len >= 1, ">= 1"), ("output_len", self.output_len >= 1, ">= 1"),
                     ("range_ratio", 0 <= self.range_ratio < 1, "in [0, 1)"), ("warmup", self.warmup >= 0, ">= 0"),
                     ("request_timeout", self.request_timeout > 0, "> 0")])
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")

    def length_range(self, mean: int) -> tuple[int, int]:
        """vLLM's random lengths: uniform in ``mean * (1 -+ range_ratio)``, at least 1."""
        return max(1, int(mean * (1 - self.range_ratio))), int(mean * (1 + self.range_ratio))


def arrival_times(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Send times in seconds from the start, endless: 0, then gamma-distributed gaps with
    mean ``1 / rate`` and shape ``burstiness`` (1: Poisson). An infinite rate sends all at 0."""
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def prompts(spec: LoadSpec, rng: random.Random) -> Iterator[tuple[list[int], int]]:
    """Endless ``(prompt token ids, output length)`` pairs: ``fixed_prompts`` in turn, random ids
    (ordinary tokens, below ``<|endoftext|>``) or windows cut at random places from the corpus."""
    if spec.fixed_prompts:
        yield from ((prompt, spec.output_len) for prompt in itertools.cycle(spec.fixed_prompts))
    corpus = _corpus_tokens() if spec.dataset == "corpus" else None
    while True:
        n_in = rng.randint(*spec.length_range(spec.input_len))
        n_out = rng.randint(*spec.length_range(spec.output_len))
        if corpus is None:
            yield [rng.randrange(EOT_ID) for _ in range(n_in)], n_out
        else:
            start = rng.randrange(len(corpus) - n_in)
            yield [int(t) for t in corpus[start:start + n_in]], n_out


def _corpus_tokens() -> Sequence[int]:
    from minillm.data.corpus import prepare_corpus  # only this dataset needs it, and it is slow to import

    return prepare_corpus(verbose=False).tokens("validation")


@dataclass(frozen=True)
class ServerInfo:
    """What ``GET /v1/models`` says about the model being served."""

    model: str
    max_model_len: int


async def server_info(session: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> ServerInfo:
    """Ask the server what it serves, so requests name its model and fit its context."""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                raise ConnectionError(f"{url}/v1/models answered HTTP {response.status}: {await response.text()}")
            card = (await response.json())["data"][0]
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise ConnectionError(f"no server answered at {url} ({type(err).__name__}: {err})") from None
    return ServerInfo(card["id"], int(card.get("max_model_len", 0)))


async def send_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                       output_len: int, timeout: float, *,
                       clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Stream one completion and time it on the client's clock. Never raises for a failed
    request: the failure is its ``error``, an HTTP status or what went wrong. (``clock`` is
    there so a test can drive the timings with a fake one and check them exactly.)"""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(len(prompt), output_len)
    start = last = clock()
    chunks = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}"
                return result
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error {chunk['error'].get('code') or chunk['error'].get('type')}"
                    return result
                if chunk.get("choices"):
                    now = clock()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except asyncio.TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as err:
        result.error = type(err).__name__
    except ValueError:  # a data line that is not JSON: not an OpenAI-compatible stream
        result.error = "malformed stream"
    if result.ttft is None and result.error is None:
        result.error = "empty stream"
    if result.ok:
        result.e2e = last - start
        result.output_tokens = result.output_tokens or chunks
    return result


class LoadRun:
    """One bounded run of open-loop traffic: ``await run()`` sends the uncounted warm-up, then
    the measured traffic, and returns the :class:`Summary`. Its counters (``sent``,
    ``in_flight``, ``results``) are live, for the dashboard; ``stop()`` ends it early, leaving
    the requests it cancels out of the results."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.url = spec.url.rstrip("/")
        self.sent = self.in_flight = self.peak_concurrency = 0
        self.results: list[RequestResult] = []
        self.info: ServerInfo | None = None
        self._stopped = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def stop(self) -> None:
        self._stopped.set()
        for task in self._tasks:
            task.cancel()

    async def run(self) -> Summary:
        spec = self.spec
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        # No connection limit: aiohttp's default of 100 would silently cap the concurrency.
        connector = aiohttp.TCPConnector(limit=0, force_close=not spec.keep_alive)
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            self.info = await server_info(session, self.url)
            prompt_len = max(map(len, spec.fixed_prompts)) if spec.fixed_prompts else spec.length_range(spec.input_len)[1]
            longest = prompt_len + spec.length_range(spec.output_len)[1]
            if self.info.max_model_len and longest > self.info.max_model_len:
                raise ValueError(f"the longest prompt + output ({longest} tokens) exceeds the served model's "
                                 f"context of {self.info.max_model_len}; lower --input-len or --output-len")
            work = prompts(spec, random.Random(spec.seed))  # the same prompts at every rate
            for _ in range(spec.warmup):
                await send_request(session, self.url, self.info.model, *next(work), spec.request_timeout)
            start = time.perf_counter()
            await self._send_all(session, work, random.Random(f"arrivals-{spec.seed}"), start)
            await asyncio.gather(*self._tasks, return_exceptions=True)
            duration = time.perf_counter() - start
        return summarize(self.results, duration, self.peak_concurrency, spec.slo)

    async def _send_all(self, session: aiohttp.ClientSession, work: Iterator, rng: random.Random,
                        start: float) -> None:
        """Launch each request at its arrival time until a bound is reached or ``stop()``."""
        spec = self.spec
        gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else contextlib.nullcontext()
        for i, offset in enumerate(arrival_times(spec.request_rate, spec.burstiness, rng)):
            if spec.num_prompts is not None and i >= spec.num_prompts:
                return
            if spec.duration is not None and offset >= spec.duration:
                return
            if await self._stopped_before(start + offset):
                return
            task = asyncio.create_task(self._one(session, gate, *next(work)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _stopped_before(self, when: float) -> bool:
        """Sleep until ``when`` (``perf_counter`` time); True if ``stop()`` came first."""
        delay = when - time.perf_counter()
        if self._stopped.is_set() or delay <= 0:
            return self._stopped.is_set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), delay)
        return self._stopped.is_set()

    async def _one(self, session: aiohttp.ClientSession, gate: AsyncContextManager, prompt: list[int],
                   output_len: int) -> None:
        async with gate:
            self.sent += 1
            self.in_flight += 1
            self.peak_concurrency = max(self.peak_concurrency, self.in_flight)
            try:
                result = await send_request(session, self.url, self.info.model, prompt, output_len,
                                            self.spec.request_timeout)
            finally:
                self.in_flight -= 1
            self.results.append(result)
