"""What every HTTP program here speaks on the wire: OpenAI's error shape and server-sent events,
shared by the server, the dashboard and the router (which must stay free of torch)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

# The largest request body the server reads (413 beyond): ServerConfig's default, and the
# router's, so that the router refuses at once what every replica behind it would refuse.
MAX_BODY_BYTES = 1 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
CLIENT_GONE = 499  # nginx's status for "the client closed the connection"


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``. The
    type defaults to ``server_error`` for a 5xx, else ``invalid_request_error``."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400: the request itself is wrong, and sending it again will not help."""
    return OpenAIError(400, message, param=param)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_errors(program: str, log: logging.Logger,
                  count: Callable[[web.Request, int], None] = lambda request, status: None) -> Any:
    """A middleware that answers every failure in OpenAI's shape, never a traceback: an
    :class:`OpenAIError`, aiohttp's own refusals (404/405 routing, 413 body too large), and
    anything unexpected (a 500, ``internal <program> error``, logged). ``count`` sees the
    status of every response."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except OpenAIError as err:
            response = err.response()
        except web.HTTPException as err:
            if err.status < 400:
                raise
            response = OpenAIError(err.status, err.text or err.reason).response()
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            response = OpenAIError(500, f"internal {program} error").response()
        count(request, response.status)
        return response

    return errors


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def write_within(request: Any, response: Any, data: bytes | None, timeout: float) -> None:
    """Write one piece of a streamed ``response`` (None: ``write_eof``), or give up on a client
    that stopped reading: aiohttp's ``write`` waits while the socket's buffers are full, which
    would hold the handler (and a request's KV blocks) for ever. Past ``timeout`` the connection
    is aborted (closing would wait to flush the same bytes) and ``ConnectionResetError`` raised.

    A write that leaves the socket's buffer under its high-water mark cannot wait, so it goes
    without the timer (arming one costs about as much as the write itself, once per token)."""
    transport = request.transport
    if data is not None and transport is not None and not transport.is_closing():
        if transport.get_write_buffer_size() + len(data) < transport.get_write_buffer_limits()[1]:
            await response.write(data)
            return
    try:
        async with asyncio.timeout(timeout):
            await (response.write_eof() if data is None else response.write(data))
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client read nothing for {timeout:g} s") from None


async def read_body(request: Any, timeout: float) -> bytes:
    """A request's body, bounded by the app's ``client_max_size`` (413 past it) and in time: a
    body that takes more than ``timeout`` to arrive is a 408, since a client dribbling bytes
    would otherwise hold a connection and a handler for as long as it likes."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                          headers={"Connection": "close"}) from None


async def read_json(request: Any, timeout: float) -> object:
    """A request's body (:func:`read_body`) as JSON, or a 4xx: a charset Python does not know
    (415), bytes that are not that charset, text that is not JSON, or JSON nested too deeply to
    parse (400)."""
    body = await read_body(request, timeout)
    charset = request.charset or "utf-8"
    try:
        text = body.decode(charset)
    except LookupError:
        raise OpenAIError(415, f"unsupported charset {charset!r}: send UTF-8") from None
    except UnicodeDecodeError as err:
        raise invalid(f"the request body is not valid {charset}: {err}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise invalid("the request body is JSON nested too deeply") from None
    except ValueError as err:  # not JSON, or an integer past Python's digit limit
        raise invalid(f"the request body is not valid JSON: {err}") from None
