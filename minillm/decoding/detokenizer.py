"""Token ids to text, one token at a time, safe to stream.

Two things are held back: bytes that begin a UTF-8 character but do not finish it (BPE splits
``"🦙"`` into three tokens, which alone would show three replacement characters), and text
that could begin a stop string (which may arrive split across tokens, and the text must end
just before it). Everything else is released at once.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from minillm.data.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One request's generated text, built token by token.

    ``add(token_id)`` returns the text that became safe to show, ``flush()`` what was held:
    together, ``tokenizer.decode(ids)`` cut just before the first stop string. The text is not
    kept here (a stream sends it on). When a stop string completes, ``stop_reason`` holds it
    and a further ``add`` raises. The stop string *completed* first wins (of two completed by
    one character, the earlier-starting), so the outcome never depends on the tokenization.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self._eot, self._token_bytes = tokenizer.eot, tokenizer.token_bytes  # read once, used per token
        self._stop = stop
        # How much of each stop string the text ends with: the text we may have to hold back.
        self._matches = [_SuffixMatch(s) for s in stop]
        # Python's incremental UTF-8 decoder keeps an unfinished character's bytes until they
        # are complete and turns bytes that can never be completed into U+FFFD, exactly as a
        # one-shot ``decode(errors="replace")`` of the whole stream would.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._finished = False
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared: the request's text is complete."""
        return self.stop_reason is not None

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the new text that is now safe to show."""
        if self._finished:
            raise RuntimeError("this detokenizer is finished (a stop string matched or flush() was called)")
        if token_id == self._eot:
            return ""
        text = self._utf8.decode(self._token_bytes(token_id))
        return self._release(text, final=False) if self._stop else text  # no stop string: nothing to hold

    def flush(self) -> str:
        """End of generation: release everything held. Bytes of a character that never
        completed become U+FFFD; held text that began a stop string is released as it was."""
        if self._finished:
            return ""
        return self._release(self._utf8.decode(b"", final=True), final=True)

    def _release(self, new_text: str, *, final: bool) -> str:
        """Append ``new_text`` to the held text, cut at a stop string if one completed, and
        emit all but the tail that could still begin one (any stop completing now starts in it)."""
        window = self._held + new_text
        held = max((m.feed(new_text) for m in self._matches), default=0)
        match = self._first_stop(window)
        if match is not None:
            start, self.stop_reason = match
            window, self._held, final = window[:start], "", True
        keep = 0 if final else held
        out, self._held = window[: len(window) - keep], window[len(window) - keep :]
        self._finished = final
        return out

    def _first_stop(self, window: str) -> tuple[int, str] | None:
        """``(start, stop string)`` of the stop string completed first in ``window``, if any."""
        found = [(i + len(s), i, s) for s in self._stop if (i := window.find(s)) >= 0]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop


class _SuffixMatch:
    """How many leading characters of one stop string the text read so far ends with: what
    must be held back. Knuth, Morris and Pratt's failure table advances it in amortised
    constant time per character, where testing every suffix costs the stop's length squared."""

    def __init__(self, stop: str) -> None:
        self.stop, self.matched = stop, 0
        # fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        """Read ``text``; returns the new count (``len(stop)`` when the text ends with all of it)."""
        stop, fail, k = self.stop, self.fail, self.matched
        for ch in text:
            if k == len(stop):
                k = fail[k - 1]
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
        self.matched = k
        return k
