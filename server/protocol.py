"""OpenAI's wire format, the way in: request JSON, checked (:mod:`server.responses` is the way out).

Everything a client can get wrong is caught here, before the engine sees the request, and
becomes an :class:`OpenAIError` that names the offending field (``param``), so the client
reads *what* was wrong and nothing reaches the engine thread that could disturb other
requests. Prompts are tokenized here too, so a prompt that leaves no room to generate is a
400 naming the numbers, as OpenAI and vLLM report it.

The chat endpoint needs a chat template, and our model has none: it was trained to continue
children's stories, not to follow instructions. :func:`chat_prompt` lays the conversation out
as a plain transcript ending in ``"Assistant:"`` and lets the model continue it. That keeps
every chat client working; do not expect the answers to be helpful.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from minillm.decoding.sampling import SEED_MAX, SEED_MIN, SamplingParams
from minillm.decoding.structured import JSON_OBJECT_SCHEMA, grammar_compiler
from minillm.data.tokenizer import Tokenizer
from server.wire import OpenAIError, invalid

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 64  # prompts x n in one request; more is a batch job, not a request
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2
# OpenAI takes up to 4 stop sequences. Each is searched for after every token, for every
# choice, so a length cap too: generous for "\n\nUser:"-like stops, small beside a body.
MAX_STOPS, MAX_STOP_CHARS = 4, 512

_KINDS: dict[str, Callable[[Any], bool]] = {
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list of token ids": lambda v: isinstance(v, list),  # its items are checked by SamplingParams
}

# Fields both endpoints read, with the JSON type each must have (null always means "default").
# ``prompt``, ``messages``, ``stop`` and the rest marked None have richer shapes and are checked
# by their own code. store, metadata, service_tier and parallel_tool_calls change nothing here
# (nothing is stored, there is one tier, and no tools) and are accepted, as OpenAI accepts them.
_COMMON = {
    "model": "a string", "max_tokens": "an integer", "temperature": "a number", "top_p": "a number",
    "top_k": "an integer", "seed": "an integer", "n": "an integer", "ignore_eos": "a boolean",
    "stream": "a boolean", "stream_options": "an object", "user": "a string",
    "presence_penalty": "a number", "frequency_penalty": "a number", "repetition_penalty": "a number",
    "logit_bias": "an object", "min_tokens": "an integer", "stop_token_ids": "a list of token ids", "stop": None,
    "store": "a boolean", "metadata": "an object", "service_tier": "a string", "response_format": "an object",
}
_COMPLETION_FIELDS = {**_COMMON, "prompt": None, "logprobs": "an integer", "echo": "a boolean"}
_CHAT_FIELDS = {**_COMMON, "messages": None, "max_completion_tokens": "an integer", "logprobs": "a boolean",
                "top_logprobs": "an integer", "parallel_tool_calls": "a boolean"}

# OpenAI fields this server does not implement: refused by name unless at their neutral value
# (many clients always send them), rather than silently ignored.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported by this server; use n"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported by this server"),
    "tools": (lambda v: v in (None, []), "tools are not supported by this server"),
    "tool_choice": (lambda v: v in (None, "none"), "tool_choice is not supported by this server"),
    "functions": (lambda v: v in (None, []), "functions are not supported by this server"),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported by this server"),
}
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # OpenAI's limits for the two endpoints

CHAT_ROLES = {"system": "", "developer": "", "user": "User: ", "assistant": "Assistant: "}


@dataclass(frozen=True)
class ModelCard:
    """What the server knows about the model it serves, for checking requests against it."""

    name: str
    max_model_len: int
    vocab_size: int


@dataclass
class GenerationRequest:
    """A checked request: its prompts as token ids, and one ``SamplingParams`` per choice.

    Choice ``i * n + j`` is prompt ``i``'s ``j``-th completion, OpenAI's numbering. A seeded
    request with ``n > 1`` gives choice ``j`` the seed ``seed + j``: reproducible, yet not ``n``
    copies of one answer.
    """

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    echo: bool = False  # completions: the prompt's text (and logprobs) come before the completion's

    @property
    def logprobs(self) -> bool:
        """Whether the response reports logprobs (chat's ``logprobs: true``, completions'
        ``logprobs: k``)."""
        return self.params.logprobs is not None

    def choices(self) -> list[tuple[list[int], SamplingParams]]:
        seed = self.params.seed
        return [(prompt, self.params if seed is None else self.params.with_seed(seed + j))
                for prompt in self.prompts for j in range(self.n)]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


# ----------------------------------------------------------------------------- parsing


def parse_completion(body: Any, tokenizer: Tokenizer, card: ModelCard) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of such lists. ``max_tokens`` defaults to OpenAI's 16, cut to what fits."""
    check_fields(body, _COMPLETION_FIELDS, card)
    listed = _prompt_list(body.get("prompt"))
    n = _count_choices(len(listed), _field(body, "n", 1))  # before any tokenizing: a count costs nothing
    prompts = [_tokens(p, tokenizer, card.vocab_size) for p in listed]
    max_tokens = _field(body, "max_tokens", None)
    return _request(body, False, prompts, n, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, card, tokenizer)


def parse_chat(body: Any, tokenizer: Tokenizer, card: ModelCard) -> GenerationRequest:
    """``POST /v1/chat/completions``: ``messages`` through :func:`chat_prompt`. Without a
    limit the answer may run to the end of the context, as OpenAI's does."""
    check_fields(body, _CHAT_FIELDS, card)
    n = _count_choices(1, _field(body, "n", 1))
    prompt = tokenizer.encode(chat_prompt(body.get("messages")))
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request(body, True, [prompt], n, _field(body, param, None, _CHAT_FIELDS), card.max_model_len, card,
                    tokenizer, param)


def check_fields(body: Any, fields: dict[str, str | None], card: ModelCard) -> None:
    """``body`` must be a JSON object of known ``fields`` (name: JSON type, or None for a field
    checked elsewhere), naming the served model if any."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name, value in body.items():
        if name in _REFUSED:
            neutral, message = _REFUSED[name]
            if not neutral(value):
                raise invalid(message, name)
        elif name not in fields:
            raise invalid(f"unrecognized request argument supplied: {name}", name)
        elif fields[name] is not None:
            _field(body, name, None, fields)
    model = body.get("model")
    if model is not None and model != card.name:
        raise model_not_found(model, card)


def model_not_found(model: str, card: ModelCard) -> OpenAIError:
    return OpenAIError(404, f"the model {model!r} does not exist; this server serves {card.name!r}",
                       param="model", code="model_not_found")


def _field(body: dict, name: str, default: Any, fields: dict[str, str | None] | None = None) -> Any:
    """``body[name]`` checked against its JSON type in ``fields`` (by default the type both
    endpoints agree on), or ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kind = (fields or _COMMON)[name]
    if kind is not None and not _KINDS[kind](value):
        raise invalid(f"{name} must be {kind}, got {_short(value)}", name)
    return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """The four shapes OpenAI accepts for ``prompt``, as a list of single prompts."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_KINDS["an integer"](t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt must be a string, a list of strings, a list of token ids, or a list of those", "prompt")
    if not prompt or not all(prompt):
        raise invalid("prompt must not be empty", "prompt")
    return prompt


def _tokens(prompt: str | list, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not all(_KINDS["an integer"](t) and 0 <= t < vocab_size for t in prompt):
        raise invalid(f"prompt token ids must be integers in 0..{vocab_size - 1}", "prompt")
    return list(prompt)


def chat_prompt(messages: Any) -> str:
    """The conversation as a transcript the story model can continue::

        You are a storyteller.           <- system (or developer) messages, as they are

        User: Tell me about a cat.
        Assistant: Once upon a time ...
        User: And then?
        Assistant:                       <- the model writes from here
    """
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    lines = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", "messages")
        text = _content(message.get("content"), i)
        lines.append(f"{CHAT_ROLES[role]}{text}\n" + ("\n" if CHAT_ROLES[role] == "" else ""))
    return "".join(lines) + "Assistant:"


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return content


def _request(body: dict, chat: bool, prompts: list[list[int]], n: int, max_tokens: int | None, default_max: int,
             card: ModelCard, tokenizer: Tokenizer, max_tokens_param: str = "max_tokens") -> GenerationRequest:
    """Check lengths against the context, then build the ``SamplingParams`` (``n``: the
    choices per prompt, already checked)."""
    prompt_param = "messages" if chat else "prompt"
    longest = max(len(p) for p in prompts)
    if longest == 0:
        raise invalid("the prompt encodes to no tokens", prompt_param)
    room = card.max_model_len - longest
    if room < 1:
        raise invalid(f"this model's maximum context length is {card.max_model_len} tokens, "
                      f"and the prompt has {longest}, leaving no room to generate", prompt_param)
    echo = not chat and _field(body, "echo", False, _COMPLETION_FIELDS)
    least = 0 if echo else 1  # max_tokens 0 with echo scores the prompt without generating
    if max_tokens is not None and max_tokens < least:
        raise invalid(f"{max_tokens_param} must be >= {least}{'' if echo else ' (0 only with echo)'}, "
                      f"got {max_tokens}", max_tokens_param)
    if max_tokens is not None and max_tokens > room:
        raise invalid(f"this model's maximum context length is {card.max_model_len} tokens; you requested "
                      f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} in the completion)",
                      max_tokens_param)
    seed = _field(body, "seed", None)  # SamplingParams checks its range; choice j draws with seed + j, so that must fit too
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX - (n - 1):
        raise invalid(f"seed must be in {SEED_MIN}..{SEED_MAX - (n - 1)} with n={n} "
                      "(choice j draws with seed + j)", "seed")
    stream = _field(body, "stream", False)
    options = _field(body, "stream_options", None)
    if options is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage must be a boolean", "stream_options")
    top_k = _field(body, "top_k", None)
    if top_k is not None and top_k < -1:
        raise invalid(f"top_k must be -1 or 0 (all tokens) or a count >= 1, got {_short(top_k)}", "top_k")
    temperature = _field(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise invalid(f"temperature must be in 0..{MAX_TEMPERATURE:g}, got {_short(temperature)}", "temperature")
    logprobs = _logprobs(body, chat)
    json_schema = _response_format(body, tokenizer)
    try:
        params = SamplingParams(
            max_tokens=min(default_max, room) if max_tokens is None else max_tokens,
            temperature=temperature,
            top_p=_field(body, "top_p", 1.0),
            top_k=None if top_k == -1 else top_k,  # vLLM's -1 also means "all tokens"
            stop=_stop(body.get("stop")),
            stop_token_ids=_field(body, "stop_token_ids", []),
            ignore_eos=_field(body, "ignore_eos", False),
            seed=seed,
            presence_penalty=_field(body, "presence_penalty", 0.0),
            frequency_penalty=_field(body, "frequency_penalty", 0.0),
            repetition_penalty=_field(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body, card.vocab_size),
            min_tokens=_field(body, "min_tokens", 0),
            logprobs=logprobs,
            prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or max_tokens == 0) else None,
            json_schema=json_schema,
        )
    except ValueError as err:
        raise invalid(str(err), str(err).split()[0]) from None
    return GenerationRequest(chat, prompts, params, n, stream, include_usage, _field(body, "user", None), echo)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to report per token, or None for no logprobs: completions'
    ``logprobs`` (0..5), chat's ``top_logprobs`` (0..20, with ``logprobs: true``)."""
    if not chat:
        k = _field(body, "logprobs", None, _COMPLETION_FIELDS)
        if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise invalid(f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}, got {_short(k)}", "logprobs")
        return k
    wanted, k = _field(body, "logprobs", False, _CHAT_FIELDS), _field(body, "top_logprobs", None, _CHAT_FIELDS)
    if k is not None and not wanted:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {_short(k)}", "top_logprobs")
    return (k or 0) if wanted else None


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias``: a JSON object from token ids (as strings) to -100..100."""
    bias = _field(body, "logit_bias", {})
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdecimal() and int(key) < vocab_size):
            raise invalid(f"logit_bias keys must be token ids in 0..{vocab_size - 1}, got {_short(key)}", "logit_bias")
        if not _KINDS["a number"](value):
            raise invalid(f"logit_bias values must be numbers, got {_short(value)}", "logit_bias")
        out[int(key)] = value
    return out


def _response_format(body: dict, tokenizer: Tokenizer) -> dict | None:
    """The JSON Schema the answer must follow, or None for free text: OpenAI's
    ``{"type": "json_object"}`` (any object) and ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}`` (``strict`` and ``description`` change nothing: every
    schema here is enforced). The schema is compiled here, once for all of the request's
    choices: :func:`~minillm.decoding.structured.grammar_compiler` is the engine's compiler too."""
    fmt = _field(body, "response_format", None) or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise invalid(f"response_format type must be \"text\", \"json_object\" or \"json_schema\", got {_short(kind)}",
                      "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
        raise invalid("response_format json_schema must be an object with a \"name\" (a string) and a \"schema\" "
                      "(an object)", "response_format")
    try:
        grammar_compiler(tokenizer).check(spec["schema"])
    except ValueError as err:
        raise invalid(f"response_format {err}", "response_format") from None
    return spec["schema"]


def _count_choices(prompts: int, n: int) -> int:
    """``n``, checked with the number of prompts against :data:`MAX_CHOICES`."""
    if prompts > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} prompts per request, got {prompts}", "prompt")
    if not 1 <= n <= MAX_CHOICES // prompts:
        raise invalid(f"n must be in 1..{MAX_CHOICES // prompts} for {prompts} prompt(s): at most "
                      f"{MAX_CHOICES} completions per request", "n")
    return n


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each", "stop")
    return stop
