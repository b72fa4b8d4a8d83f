"""The router's proxying: one request, forwarded to replicas until one takes it, and relayed.

The router retries only what it knows a replica did not start: a retry of anything else could
run the work twice, and a request that broke one replica (a query of death) would go on to
break the next. What can go wrong, and what the client sees:

- **Not taken**: the connection was refused or not made within ``--connect-timeout``, or the
  replica answered 429 or 503. Another replica is tried, up to ``--max-attempts`` in all; then
  a 502 or 503 (or the last replica's own refusal, such as its 429). A failed connection, or a
  503 (our server: shutting down), ejects the replica.
- **Taken, failed before the first byte**: its own 500, 502 or 504 goes back as it is; a
  connection that breaks after sending, or a stream that ends before its first event, is a 502
  and ejects the replica. No retry.
- **Silent**: no status line, or for a stream no first event, within ``--first-byte-timeout``:
  a 504 (``replica_timeout``), and the upstream connection is closed, so the replica aborts the
  request. No retry, and no ejection: a slow answer is not a dead replica (a wedged one turns
  its ``/health`` to 503, and the active checks eject it).
- **Mid-stream**: the tokens sent cannot be taken back, so the stream ends with an ``{"error":
  ...}`` event and ``data: [DONE]``, which a client library raises: a truncated answer is never
  mistaken for a finished one.
- **The client leaves** (the handler is cancelled, or a write to the client fails): status 499,
  the upstream connection is closed, and the replica, seeing its client gone, aborts the
  request and frees its KV blocks. The replica is not blamed.
- **A body over** ``--max-body-bytes``: 413, before any replica sees it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from server.router.replicas import Replica, ReplicaSet
from server.router.config import RouterConfig
from server.router.policy import Policy, affinity_key
from server.wire import CLIENT_GONE, SSE_HEADERS, OpenAIError, read_body, sse, write_within

log = logging.getLogger("server.router")

RETRY_STATUSES = {429, 503}  # refusals: the replica did nothing, and another may not refuse
NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)  # no connection, so no request
FORWARDED_HEADERS = ("Content-Type", "Authorization", "Accept", "X-Request-Id")
DONE = sse("[DONE]")


@dataclass
class RouterState:
    """What every handler needs, kept on the application."""

    replicas: ReplicaSet
    policy: Policy
    config: RouterConfig
    session: aiohttp.ClientSession | None = None
    statuses: Counter = field(default_factory=Counter)  # final status of each proxied request
    retries: int = 0  # attempts after a request's first
    midstream_failures: int = 0
    checker: asyncio.Task | None = None


ROUTER = web.AppKey("router", RouterState)


class AttemptFailed(Exception):
    """One replica did not take this request; another may. ``response`` is what the client
    gets if no other replica can: the replica's own refusal, or the router's 502."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class ClientGone(Exception):
    """A write to the client failed: it has left. ``response`` is the handler's answer, begun."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__(CLIENT_GONE)
        self.response = response


async def proxy(request: web.Request) -> web.StreamResponse:
    """Forward to replicas chosen by the policy until one answers, at most ``max_attempts``."""
    state = request.app[ROUTER]
    body = await read_body(request, state.config.client_timeout)
    try:
        key = affinity_key(json.loads(body))
    except ValueError:  # not JSON: the replica will answer the 400
        key = None
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    tried: list[Replica] = []
    last = OpenAIError(503, "no healthy replica to send the request to", code="no_healthy_replica").response()
    try:
        for attempt in range(state.config.max_attempts):
            candidates = [r for r in state.replicas.healthy() if r not in tried]
            if not candidates:
                break
            replica = state.policy.choose(candidates, key)
            tried.append(replica)
            if attempt:
                state.retries += 1
            try:
                response = await _forward(request, state, replica, body, headers)
            except AttemptFailed as failed:
                last = failed.response
                continue
            except ClientGone as gone:
                state.statuses[CLIENT_GONE] += 1
                return gone.response
            state.statuses[response.status] += 1
            return response
    except asyncio.CancelledError:
        state.statuses[CLIENT_GONE] += 1
        raise
    state.statuses[last.status] += 1
    return last


async def _forward(request: web.Request, state: RouterState, replica: Replica, body: bytes,
                   headers: dict[str, str]) -> web.StreamResponse:
    """One attempt on one replica. Raises :class:`AttemptFailed` when the replica did not take
    the request (no connection, or a 429 or 503) and another may; whatever else happens (its
    answer, a 502 when it broke, a 504 when it was silent) is the client's answer."""
    replica.outstanding += 1
    replica.requests += 1
    upstream: aiohttp.ClientResponse | None = None
    reusable = False  # only a connection whose answer was read to the end goes back to the pool
    first = data = b""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=state.config.connect_timeout)
    try:
        try:
            async with asyncio.timeout(state.config.first_byte_timeout):
                upstream = await state.session.request(request.method, replica.url + request.path,
                                                       data=body or None, headers=headers, timeout=timeout)
                if upstream.status == 200 and upstream.content_type == "text/event-stream":
                    first = await upstream.content.readuntil(b"\n\n")
                    if not first.endswith(b"\n\n"):
                        raise aiohttp.ClientPayloadError("the stream ended before its first event")
            if upstream.status in RETRY_STATUSES:
                raise AttemptFailed(await _refusal(state, replica, upstream))
            if not first:
                data = await upstream.read()
        except NEVER_SENT as err:
            state.replicas.report_failure(replica, f"{type(err).__name__}: {err}")
            raise AttemptFailed(OpenAIError(502, f"replica {replica.url} could not be reached: {type(err).__name__}",
                                            code="replica_failed").response()) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            state.replicas.report_failure(replica, f"{type(err).__name__}: {err}")
            error = OpenAIError(502, f"replica {replica.url} failed: {type(err).__name__}", code="replica_failed")
            return error.response()
        except TimeoutError:  # the first-byte deadline (aiohttp's own timeouts are ClientConnectionErrors)
            replica.errors += 1
            log.warning("replica %s sent nothing in %g s (--first-byte-timeout)", replica.url,
                        state.config.first_byte_timeout)
            return OpenAIError(504, f"replica {replica.url} sent nothing in {state.config.first_byte_timeout:g} s; "
                                    "not retried, as it may have begun the work", code="replica_timeout").response()
        if first:
            return await _relay(request, state, replica, upstream, first)
        if upstream.status >= 500:  # its own failure, passed on as it is
            replica.errors += 1
        reusable = True
        return web.Response(body=data, status=upstream.status, content_type=upstream.content_type,
                            headers={"X-Replica": replica.url})
    finally:
        replica.outstanding -= 1
        if upstream is not None:  # closing a half-read answer is how the replica sees its client go
            upstream.release() if reusable else upstream.close()


async def _refusal(state: RouterState, replica: Replica, upstream: aiohttp.ClientResponse) -> web.Response:
    """A 429 or 503, as the client gets it if no other replica takes the request. A 503 ejects
    the replica (our server answers it while shutting down); a 429 is load, not ill health."""
    if upstream.status == 503:
        state.replicas.report_failure(replica, "it answered 503")
    else:
        replica.errors += 1
    retry_after = {"Retry-After": upstream.headers["Retry-After"]} if "Retry-After" in upstream.headers else {}
    return web.Response(body=await upstream.read(), status=upstream.status, content_type=upstream.content_type,
                        headers=retry_after)


async def _relay(request: web.Request, state: RouterState, replica: Replica, upstream: aiohttp.ClientResponse,
                 first: bytes) -> web.StreamResponse:
    """Send the first event on, then each following one as it arrives; a stream that breaks, or
    ends without ``data: [DONE]``, gets an error event. A failed read is the replica's fault
    (ejected); a failed write is the client leaving (:class:`ClientGone`), not the replica's."""
    response = web.StreamResponse(headers={**SSE_HEADERS, "X-Replica": replica.url})
    if "X-Request-Id" in upstream.headers:
        response.headers["X-Request-Id"] = upstream.headers["X-Request-Id"]
    event = first
    try:
        await response.prepare(request)
        while event.endswith(b"\n\n"):
            await write_within(request, response, event, state.config.client_timeout)
            if event == DONE:
                break
            event = await _next_event(upstream)
        if event != DONE:
            state.midstream_failures += 1
            state.replicas.report_failure(replica, "its stream broke after the first event")
            error = OpenAIError(502, f"replica {replica.url} failed mid-stream; the answer is incomplete",
                                code="replica_failed")
            await write_within(request, response, sse(error.body()) + DONE, state.config.client_timeout)
        await write_within(request, response, None, state.config.client_timeout)
    except ConnectionError:  # only writes get here: the client left or stopped reading (write_within)
        raise ClientGone(response) from None
    return response


async def _next_event(upstream: aiohttp.ClientResponse) -> bytes:
    """The replica's next event; what it sent before breaking (no blank line: not an event)
    when its stream breaks or ends early."""
    try:
        return await upstream.content.readuntil(b"\n\n")
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError):
        return b""
