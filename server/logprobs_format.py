"""The engine's :class:`~minillm.decoding.logprobs.TokenLogprobs` in OpenAI's two wire shapes.

Completions (the legacy shape, which evaluation harnesses read)::

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

from minillm.decoding.logprobs import TokenLogprobs
from minillm.data.tokenizer import Tokenizer


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
