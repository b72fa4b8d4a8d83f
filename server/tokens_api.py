"""vLLM's token routes, ``POST /tokenize`` and ``POST /detokenize``, and OpenAI's
``GET /v1/models/{model}``: what a client needs to count tokens the way the server does,
without generating anything. ``/tokenize`` takes a ``prompt``, or a chat's ``messages`` laid
out by :func:`~server.protocol.chat_prompt`, and gives exactly the ids a completion of it would
get. GPT-2's tokenizer adds no special tokens, so ``add_special_tokens`` changes nothing.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from server.protocol import chat_prompt, check_fields, model_not_found
from server.responses import models_list
from server.wire import invalid, read_json


_TOKENIZE_FIELDS = {"prompt": None, "messages": None, "add_special_tokens": "a boolean",
                    "return_token_strs": "a boolean", "model": "a string"}
_DETOKENIZE_FIELDS = {"tokens": None, "model": "a string"}


def add_token_routes(app: web.Application, state: Any) -> None:
    """Mount the routes over ``state``, the server's ``server.app.State`` (which imports this
    module): its ``tokenizer``, ``card``, ``created`` and ``config``."""
    app.router.add_post("/tokenize", partial(tokenize, state))
    app.router.add_post("/detokenize", partial(detokenize, state))
    app.router.add_get("/v1/models/{model:.+}", partial(model_card, state))  # served names may hold a "/"


async def tokenize(state: Any, request: web.Request) -> web.Response:
    body = await read_json(request, state.config.client_timeout)
    check_fields(body, _TOKENIZE_FIELDS, state.card)
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


async def detokenize(state: Any, request: web.Request) -> web.Response:
    body = await read_json(request, state.config.client_timeout)
    check_fields(body, _DETOKENIZE_FIELDS, state.card)
    tokens = body.get("tokens")
    limit = min(state.card.vocab_size, state.tokenizer.n_vocab)  # an id past the tokenizer's has no text
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < limit for t in tokens):
        raise invalid(f"tokens must be a list of token ids, integers in 0..{limit - 1}", "tokens")
    return web.json_response({"prompt": state.tokenizer.decode(tokens)})


async def model_card(state: Any, request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != state.card.name:
        raise model_not_found(name, state.card)
    return web.json_response(models_list(state.card, state.created)["data"][0])

