"""vLLM's token routes, and OpenAI's route for one model: what a client needs to count tokens
the way the server does, without generating anything.

- ``POST /tokenize``: ``{"prompt": "..."}``, or a chat's ``{"messages": [...]}`` laid out by
  :func:`~server.protocol.chat_prompt`, to ``{"count", "max_model_len", "tokens", "token_strs"}``
  (``token_strs``, each token's own text, only with ``"return_token_strs": true``; null otherwise,
  as in vLLM). The ids are exactly those a completion of that prompt would be given.
- ``POST /detokenize``: ``{"tokens": [...]}`` to ``{"prompt": "..."}``.
- ``GET /v1/models/{model}``: the model's card, the object ``GET /v1/models`` lists; 404 for any
  other id.

Bad input is a 400 naming the field, an unknown ``model`` a 404, as on the completion routes.
GPT-2's tokenizer adds no special tokens (no BOS, no EOS), so ``add_special_tokens`` is accepted
and changes nothing; ``<|endoftext|>`` in a prompt is ordinary text here as it is in completions.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from minillm.data.tokenizer import Tokenizer
from server.protocol import ModelCard, chat_prompt
from server.responses import models_list
from server.wire import OpenAIError, invalid, read_json


class Served(Protocol):
    """What these routes read of the server's state (``server.app.State``, which imports this
    module, so it is described here rather than imported)."""

    tokenizer: Tokenizer
    card: ModelCard
    created: int
    client_timeout: float


SERVED: web.AppKey[Served] = web.AppKey("tokens_api.state")

_TOKENIZE_FIELDS = {"prompt", "messages", "add_special_tokens", "return_token_strs", "model"}
_DETOKENIZE_FIELDS = {"tokens", "model"}


def add_token_routes(app: web.Application, state: Served) -> None:
    app[SERVED] = state
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models/{model:.+}", model_card)  # served names may hold a "/"


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[SERVED]
    body = _checked(await read_json(request, state.client_timeout), _TOKENIZE_FIELDS, state.card)
    for name in ("add_special_tokens", "return_token_strs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(f"{name} must be a boolean", name)
    if "messages" in body:
        if "prompt" in body:
            raise invalid("give prompt or messages, not both", "messages")
        text = chat_prompt(body["messages"])
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise invalid("prompt must be a string (or send messages, a chat, instead)", "prompt")
    tokens = state.tokenizer.encode(text)
    strs = [state.tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") else None
    return web.json_response({"count": len(tokens), "max_model_len": state.card.max_model_len, "tokens": tokens,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[SERVED]
    body = _checked(await read_json(request, state.client_timeout), _DETOKENIZE_FIELDS, state.card)
    tokens = body.get("tokens")
    limit = min(state.card.vocab_size, state.tokenizer.n_vocab)  # an id past the tokenizer's has no text
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < limit for t in tokens):
        raise invalid(f"tokens must be a list of token ids, integers in 0..{limit - 1}", "tokens")
    return web.json_response({"prompt": state.tokenizer.decode(tokens)})


async def model_card(request: web.Request) -> web.Response:
    state = request.app[SERVED]
    name = request.match_info["model"]
    if name != state.card.name:
        raise _not_found(name, state.card)
    return web.json_response(models_list(state.card, state.created)["data"][0])


def _checked(body: Any, fields: set[str], card: ModelCard) -> dict:
    """``body`` as a JSON object holding only ``fields``, and naming the served model if any."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in body:
        if name not in fields:
            raise invalid(f"unrecognized request argument supplied: {name}", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model must be a string", "model")
    if model is not None and model != card.name:
        raise _not_found(model, card)
    return body


def _not_found(model: str, card: ModelCard) -> OpenAIError:
    return OpenAIError(404, f"the model {model!r} does not exist; this server serves {card.name!r}",
                       "invalid_request_error", "model", "model_not_found")
