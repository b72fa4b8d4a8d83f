"""OpenAI's response bodies, the way out (:mod:`server.protocol` is the way in): whole
answers, streamed chunks, usage and the model list, in the shapes of both endpoints."""

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

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, text: str, reason: str | None, logprobs: dict | None, chat: dict) -> dict:
        """One choice: its text, or for a chat ``chat`` (a message, or a stream's delta)."""
        part = chat if self.chat else {"text": text}
        return {"index": index, **part, "logprobs": logprobs, "finish_reason": reason}

    def full(self, texts: list[str], reasons: list[str | None], counts: dict,
             logprobs: list[dict | None] | None = None) -> dict:
        """The non-streaming answer: every choice's whole text (and logprobs), and the usage."""
        choices = [self._choice(i, t, r, lp, {"message": {"role": "assistant", "content": t}})
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs or [None] * len(texts)))]
        return {**self._envelope(choices, chunk=False), "usage": counts}

    def chunk(self, index: int, text: str, finish_reason: str | None = None, *, first: bool = False,
              logprobs: dict | None = None) -> dict:
        """One streamed piece of one choice, with its tokens' ``logprobs`` when asked. A chat
        stream opens each choice with the assistant's role, as OpenAI's does; ``usage`` is
        null until the usage chunk."""
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        body = self._envelope([self._choice(index, text, finish_reason, logprobs, {"delta": delta})], chunk=True)
        return {**body, "usage": None} if self.include_usage else body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        return {**self._envelope([], chunk=True), "usage": counts}


def models_list(card: ModelCard, created: int) -> dict:
    return {"object": "list", "data": [{"id": card.name, "object": "model", "created": created,
                                         "owned_by": "minillm", "max_model_len": card.max_model_len}]}
