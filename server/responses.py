"""OpenAI's response bodies, the way out (:mod:`server.protocol` is the way in): whole
answers, streamed chunks, usage, the model list and the engine's
:class:`~minillm.decoding.logprobs.TokenLogprobs`, in the shapes of both endpoints.

Logprobs, for completions (the legacy shape, which evaluation harnesses read)::

    {"tokens": ["Once", " upon"], "token_logprobs": [null, -2.1],
     "top_logprobs": [null, {" upon": -2.1, " a": -3.0}], "text_offset": [0, 4]}

where a ``null`` marks the prompt's first token (nothing predicts it) when ``echo`` returns
the prompt, and each ``top_logprobs`` entry holds the requested alternatives plus the chosen
token, as vLLM returns them. Chat::

    {"content": [{"token": " upon", "logprob": -2.1, "bytes": [32, 117, 112, 111, 110],
                  "top_logprobs": [{"token": " a", "logprob": -3.0, "bytes": [32, 97]}]}]}

A GPT-2 token is bytes, and may hold half a character; its ``token`` string then shows the
replacement character, while ``bytes`` (chat) keeps the exact bytes. ``text_offset`` counts
the characters of the token strings before each token, from the start of the choice's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minillm.data.tokenizer import Tokenizer
from minillm.decoding.logprobs import TokenLogprobs
from server.protocol import ModelCard


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Responses:
    """Builds one request's response bodies, all sharing its id, model and creation time."""

    id: str
    model: str
    chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, part: dict, reason: str | None, logprobs: dict | None) -> dict:
        """One choice: ``part`` is its ``text``, or for a chat its ``message`` or a stream's ``delta``."""
        return {"index": index, **part, "logprobs": logprobs, "finish_reason": reason}

    def full(self, texts: list[str], reasons: list[str | None], counts: dict,
             logprobs: list[dict | None] | None = None) -> dict:
        """The non-streaming answer: every choice's whole text (and logprobs), and the usage."""
        def part(text: str) -> dict:
            return {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}

        choices = [self._choice(i, part(t), r, lp)
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs or [None] * len(texts)))]
        return {**self._envelope(choices, chunk=False), "usage": counts}

    def chunk(self, index: int, text: str, finish_reason: str | None = None, *, first: bool = False,
              logprobs: dict | None = None) -> dict:
        """One streamed piece of one choice, with its tokens' ``logprobs`` when asked. A chat
        stream opens each choice with the assistant's role, as OpenAI's does; ``usage`` is
        null until the usage chunk."""
        if self.chat:
            part = {"delta": {"role": "assistant", "content": text} if first else ({"content": text} if text else {})}
        else:
            part = {"text": text}
        body = self._envelope([self._choice(index, part, finish_reason, logprobs)], chunk=True)
        return {**body, "usage": None} if self.include_usage else body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        return {**self._envelope([], chunk=True), "usage": counts}


def models_list(card: ModelCard, created: int) -> dict:
    return {"object": "list", "data": [{"id": card.name, "object": "model", "created": created,
                                         "owned_by": "minillm", "max_model_len": card.max_model_len}]}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs | None], start_offset: int = 0) -> dict:
    """The completions shape for ``entries``; an entry made by :func:`unscored` (the prompt's
    first token) reports ``null``. Offsets start at ``start_offset``."""
    tokens, values, tops, offsets = [], [], [], []
    offset = start_offset
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry.logprob is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def unscored(token_id: int) -> TokenLogprobs:
    """The prompt's first token, which nothing predicts: reported with ``null`` logprobs."""
    return TokenLogprobs(token_id, None, ())  # type: ignore[arg-type]


def end_offset(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> int:
    """Where the next token's ``text_offset`` starts after ``entries`` (for streamed chunks)."""
    return sum(len(token_text(tokenizer, e.token_id)) for e in entries)
