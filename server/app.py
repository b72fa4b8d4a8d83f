"""The HTTP side: aiohttp routes that speak OpenAI's API over the engine loop.

A completion request goes: read the body (413 past the size limit, 408 past
``--client-timeout``) -> check and tokenize it (:mod:`server.protocol`; 400/404) ->
:meth:`AsyncEngine.submit` -> wait until the engine accepts it (429 when the waiting queue is
full, 503 while shutting down) -> one JSON body, or server-sent events as tokens arrive.

aiohttp cancels the handler of a client that disconnects (``handler_cancellation=True``), and a
client that stops reading is cut off once a write has waited ``--client-timeout``; either way
the handler's ``finally`` closes its stream, so its choices are aborted before the next engine
step and their KV blocks go back to the pool. Each completion request ends with one
``key=value`` access-log line (logger ``server.access``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from minillm.engine.llm_engine import LLMEngine
from minillm.decoding.logprobs import TokenLogprobs
from minillm.data.tokenizer import Tokenizer
from server.config import ServerConfig
from server.dashboard import add_dashboard
from server.engine_loop import AsyncEngine, EngineFailure, Event, QueueFull, Rejected, RequestStream, ShuttingDown
from server.metrics import Metrics
from server.protocol import GenerationRequest, ModelCard, parse_chat, parse_completion
from server.responses import (Responses, chat_logprobs, completion_logprobs, end_offset, models_list, unscored,
                              usage)
from server.tokens_api import add_token_routes
from server.wire import (CLIENT_GONE, SSE_HEADERS, Handler, OpenAIError, invalid, openai_errors, read_json, sse,
                         write_within)

access_log = logging.getLogger("server.access")
log = logging.getLogger("server")

RETRY_AFTER_SECONDS = 1
OPEN_PATHS = frozenset({"/health"})  # what a load balancer probes: never behind the API key
CUT_MARGIN_S = 0.5  # streams are ended this long (at most half the grace) before aiohttp's grace runs out


@dataclass
class State:
    """What every handler needs, kept on the application."""

    engine: AsyncEngine
    metrics: Metrics
    card: ModelCard
    tokenizer: Tokenizer
    config: ServerConfig  # its timeouts, grace and API key
    created: int = field(default_factory=lambda: int(time.time()))
    cutoff: asyncio.TimerHandle | None = None  # set at shutdown: ends what the grace did not


STATE = web.AppKey("state", State)


def create_app(engine: LLMEngine, config: ServerConfig) -> web.Application:
    """The server for ``engine``. Its engine thread starts with the app; at shutdown the app
    first refuses new work, then (after aiohttp has let in-flight requests run for up to its
    ``shutdown_timeout``) stops the thread."""
    async_engine = AsyncEngine(engine, config.max_queue)
    card = ModelCard(config.served_model_name, engine.model.cfg.context_length, engine.model.cfg.vocab_size)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[openai_errors("server", log, _count), auth])
    app[STATE] = state = State(async_engine, Metrics(async_engine), card, engine.tokenizer, config)
    state.metrics.show_memory(engine)
    app.router.add_post("/v1/completions", partial(_generate, parse_completion, "cmpl"))
    app.router.add_post("/v1/chat/completions", partial(_generate, parse_chat, "chatcmpl"))
    app.router.add_get("/v1/models", models)
    add_token_routes(app, state)  # /tokenize, /detokenize, /v1/models/{model}
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_dashboard(app, async_engine, state.metrics, card.max_model_len, locked=config.api_key is not None,
                  client_timeout=config.client_timeout)  # chapter 11
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_accepting)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    app[STATE].engine.start()


async def _stop_accepting(app: web.Application) -> None:
    """Shutdown begins (aiohttp then waits up to the grace for handlers to finish): refuse new
    work, answer 503 to what is still queued, and end what is still running just before the
    grace is over, so each of those streams says why it ends."""
    state = app[STATE]
    state.engine.accepting = False
    state.engine.refuse_queued()
    grace = state.config.shutdown_grace
    delay = grace - min(CUT_MARGIN_S, grace / 2)
    state.cutoff = asyncio.get_running_loop().call_later(delay, state.engine.cut_off)


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    if state.cutoff is not None:
        state.cutoff.cancel()
    await state.engine.stop()


# ----------------------------------------------------------------------------- middleware


def _count(request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.http.labels(path, str(status)).inc()


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With ``--api-key``, every route but /health wants the key: the API, and also /metrics
    (which shows the traffic) and the dashboard. Clients send ``Authorization: Bearer <key>``
    (Prometheus can be configured to). A browser cannot add that header to a page it opens, so
    outside /v1 a refusal also offers HTTP Basic auth: the browser asks for a name and password
    (the key), then sends them with the page's own requests (its event stream, its fetches)."""
    key = request.app[STATE].config.api_key
    if key is not None and request.path not in OPEN_PATHS and not has_key(request.headers.get("Authorization", ""), key):
        challenge = "Bearer" if request.path.startswith("/v1") else 'Basic realm="minillm", charset="UTF-8"'
        raise OpenAIError(401, "missing or incorrect API key", code="invalid_api_key",
                          headers={"WWW-Authenticate": challenge})
    return await handler(request)


def has_key(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key``: as a bearer token, or as the password
    of HTTP Basic credentials (any user name). Compared in constant time; raw non-ASCII bytes
    arrive as surrogates, and are compared as those bytes."""
    scheme, _, credentials = authorization.partition(" ")
    given = credentials.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(given, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given, key.encode())


# ----------------------------------------------------------------------------- small routes


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_list(state.card, state.created))


async def health(request: web.Request) -> web.Response:
    """200 while the engine loop runs, takes work and keeps stepping; 503 otherwise, so a load
    balancer stops sending requests to a server that is stopping, broken or wedged (a step
    running past ``--stall-timeout``: the loop's heartbeat is its steps' completions)."""
    state = request.app[STATE]
    engine, stalled = state.engine, state.engine.stalled_for()
    if stalled > state.config.stall_timeout:
        body = {"status": "stalled", "detail": f"an engine step has run for {stalled:.0f} s "
                                               f"(--stall-timeout {state.config.stall_timeout:g} s)"}
        return web.json_response(body, status=503)
    ok = engine.alive and engine.accepting
    return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ----------------------------------------------------------------------------- completions


@dataclass
class AccessRecord:
    """What the access log says about one completion request."""

    request_id: str
    path: str
    arrival: float
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_output: float | None = None
    reasons: list[str] = field(default_factory=list)
    user: str | None = None
    n: int = 1  # choices per prompt: a prompt's cache hit is counted once, from its first choice
    cached_tokens: int = 0

    def write(self) -> None:
        now = time.monotonic()
        ttft = "-" if self.first_output is None else f"{(self.first_output - self.arrival) * 1e3:.1f}"
        access_log.info(
            "request_id=%s path=%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f "
            "finish_reason=%s user=%s", self.request_id, self.path, self.status, self.prompt_tokens,
            self.completion_tokens, ttft, (now - self.arrival) * 1e3, ",".join(self.reasons) or "-", self.user or "-")


ENGINE_ERRORS = (QueueFull, ShuttingDown, Rejected, EngineFailure)


def as_openai_error(err: Exception) -> OpenAIError:
    """The engine loop's refusals and failures, in HTTP terms."""
    if isinstance(err, QueueFull):
        return OpenAIError(429, f"the server is busy ({err}); retry shortly", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(err, ShuttingDown):
        return OpenAIError(503, str(err), code="shutting_down")
    if isinstance(err, Rejected):
        return invalid(str(err))
    return OpenAIError(500, str(err), code="engine_error")


async def _generate(parse: Callable, prefix: str, request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` or ``/v1/chat/completions`` (``parse``; ids start ``prefix``).
    Check, submit, wait for the engine to accept, then answer whole or streamed; whatever
    happens, the ``finally`` closes the stream (aborting what is unfinished) and logs."""
    state = request.app[STATE]
    record = AccessRecord(f"{prefix}-{uuid.uuid4().hex}", request.path, time.monotonic())
    stream: RequestStream | None = None
    refused = False  # by the engine loop, before it took the request on
    try:
        req: GenerationRequest = parse(await read_json(request, state.config.client_timeout), state.tokenizer,
                                         state.card)
        record.user, record.n = req.user, req.n
        choices = req.choices()
        try:
            stream = state.engine.submit(record.request_id, [p for p, _ in choices], [s for _, s in choices],
                                         record.arrival)
            await stream.ready()
        except ENGINE_ERRORS as err:
            refused = isinstance(err, (QueueFull, Rejected))
            raise as_openai_error(err) from None
        record.first_output, record.prompt_tokens = time.monotonic(), req.prompt_tokens
        state.metrics.prompt_tokens.inc(req.prompt_tokens)
        responses = Responses(record.request_id, state.card.name, req.chat, req.include_usage)
        events = _tracked(stream, record, state.metrics)
        extras = Extras(req, state.tokenizer)
        if req.stream:
            return await _stream(request, events, responses, record, extras)
        return await _whole(events, len(choices), responses, record, extras)
    except asyncio.CancelledError:  # the client went away
        record.status = CLIENT_GONE
        raise
    except Exception as err:
        record.status = getattr(err, "status", 500)
        raise
    finally:
        unfinished = stream.close() if stream is not None else 0
        # Choices the engine had taken on and did not finish: failed (500), or aborted (the
        # client left, or shutdown cut them off).
        if unfinished and not refused:
            state.metrics.finished.labels("error" if record.status == 500 else "abort").inc(unfinished)
        record.write()


async def _tracked(stream: RequestStream, record: AccessRecord, metrics: Metrics) -> AsyncIterator[Event]:
    """The stream's events, counted into the access record and the metrics on their way."""
    try:
        async for event in stream:
            out = event.output
            metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                record.cached_tokens += out.cached_tokens if event.index % record.n == 0 else 0
                record.completion_tokens += out.completion_tokens
                record.reasons.append(out.finish_reason or "")
                metrics.choice_finished(out.finish_reason or "", out.times)
            yield event
    except ENGINE_ERRORS as err:
        raise as_openai_error(err) from None


@dataclass
class Extras:
    """What a choice's answer carries beyond its generated text: with ``echo``, its prompt's
    text first; with logprobs, each token's, in the endpoint's shape (``server.responses``)."""

    req: GenerationRequest
    tokenizer: Tokenizer

    def prefix(self, index: int) -> str:
        return self.tokenizer.decode(self.req.prompts[index // self.req.n]) if self.req.echo else ""

    def entries(self, event: Event) -> list[TokenLogprobs]:
        """The positions this output scored: the echoed prompt's (first output only), then its tokens'."""
        out, prompt = event.output, self.req.prompts[event.index // self.req.n]
        echoed = [unscored(prompt[0]), *out.prompt_logprobs] if self.req.echo and out.prompt_logprobs is not None else []
        return echoed + (out.logprobs or [])

    def shape(self, entries: list[TokenLogprobs], offset: int = 0) -> dict | None:
        if not self.req.logprobs:
            return None
        if self.req.chat:
            return chat_logprobs(self.tokenizer, entries)
        return completion_logprobs(self.tokenizer, entries, offset)


async def _whole(events: AsyncIterator[Event], n: int, responses: Responses, record: AccessRecord,
                 extras: Extras) -> web.Response:
    """Collect every choice to the end, then answer once."""
    texts: list[list[str]] = [[extras.prefix(i)] for i in range(n)]
    reasons: list[str | None] = [None] * n
    scored: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    async for event in events:
        texts[event.index].append(event.output.new_text)
        reasons[event.index] = event.output.finish_reason
        scored[event.index] += extras.entries(event)
    counts = usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
    return web.json_response(responses.full(["".join(t) for t in texts], reasons, counts,
                                            [extras.shape(s) for s in scored]))


async def _stream(request: web.Request, events: AsyncIterator[Event], responses: Responses,
                  record: AccessRecord, extras: Extras) -> web.StreamResponse:
    """Server-sent events: a chunk whenever a choice has new text (or finishes), the usage
    chunk if asked for, then ``data: [DONE]``. Once the first byte is out the status is fixed
    at 200, so a later failure is an ``{"error": ...}`` event, which OpenAI's clients raise."""
    response = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": record.request_id})
    await response.prepare(request)
    timeout = request.app[STATE].config.client_timeout

    async def send(data: dict | str | None) -> None:  # None: the end of the stream
        await write_within(request, response, None if data is None else sse(data), timeout)

    started: set[int] = set()
    offsets: dict[int, int] = {}  # each choice's text_offset so far
    try:
        try:
            async for event in events:
                out, i = event.output, event.index
                entries = extras.entries(event)
                prefix = "" if i in started else extras.prefix(i)
                if out.new_text or out.finished or entries or prefix:
                    text = prefix + out.new_text
                    logprobs = extras.shape(entries, offsets.get(i, 0))
                    await send(responses.chunk(i, text, out.finish_reason, first=i not in started, logprobs=logprobs))
                    started.add(i)
                    offsets[i] = offsets.get(i, 0) + end_offset(extras.tokenizer, entries)
            if responses.include_usage:
                counts = usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
                await send(responses.usage_chunk(counts))
        except OpenAIError as err:
            record.status = err.status
            await send(err.body())
        await send("[DONE]")
        await send(None)
    except ConnectionResetError:  # the client left between two writes, or stopped reading
        record.status = CLIENT_GONE
    return response
