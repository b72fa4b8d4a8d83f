"""What every HTTP program here speaks on the wire: OpenAI's error shape and server-sent events.

The server, the dashboard and the router share these, and the router is a plain HTTP proxy,
so this module imports nothing but the standard library.
"""

from __future__ import annotations

import json

# The largest request body the server reads (413 beyond): ServerConfig's default, and the
# router's, so that the router refuses at once what every replica behind it would refuse.
MAX_BODY_BYTES = 1 << 20


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    """A 400: the request itself is wrong, and sending it again will not help."""
    return OpenAIError(400, message, "invalid_request_error", param)


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
