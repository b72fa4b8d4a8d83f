"""OpenAI's response bodies: whole answers, streamed chunks, usage and the model list.

:mod:`server.protocol` turns a request's JSON into what the engine runs; this module turns
what the engine produced back into the JSON a client reads, in the two shapes of the two
endpoints (``text_completion`` and ``chat.completion``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, texts: list[str], reasons: list[str | None], counts: dict,
             logprobs: list[dict | None] | None = None) -> dict:
        """The non-streaming answer: every choice's whole text (and logprobs), and the usage."""
        logprobs = logprobs or [None] * len(texts)
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": r} for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                       for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, choices), "usage": counts}

    def chunk(self, index: int, text: str, finish_reason: str | None = None, *, first: bool = False,
              logprobs: dict | None = None) -> dict:
        """One streamed piece of one choice, with its tokens' ``logprobs`` when asked. A chat
        stream opens each choice with the assistant's role, as OpenAI's does; ``usage`` is
        null until the usage chunk."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return {**body, "usage": None} if self.include_usage else body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": counts}


def models_list(card: ModelCard, created: int) -> dict:
    return {"object": "list", "data": [{"id": card.name, "object": "model", "created": created,
                                         "owned_by": "minillm", "max_model_len": card.max_model_len}]}
