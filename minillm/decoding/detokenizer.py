"""Token ids to text, one token at a time, safe to stream.

Two things make streaming text harder than ``tokenizer.decode(ids)`` at the end:

1. A GPT-2 token is a run of *bytes*, not of characters. An emoji or a CJK character is
   three or four UTF-8 bytes, and BPE often splits them across tokens: ``"🦙"`` is the three
   tokens ``b"\\xf0\\x9f"``, ``b"\\xa6"``, ``b"\\x99"``. Decoding each token alone would show a
   reader three replacement characters. So bytes that begin a character but do not finish it
   are held back until the token that completes them arrives.
2. A stop string (``"\\n\\n"``, ``"The End"``) may arrive split across tokens too, and the text
   returned must end just before it. So text that could be the beginning of a stop string is
   held back until the next tokens show whether it is one.

Everything else is released at once, so a client sees each word as soon as it is certain.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from minillm.data.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """One request's generated text, built token by token.

    ``add(token_id)`` returns the text that became safe to show; ``flush()`` at the end
    returns whatever was held. Their concatenation is the same as ``tokenizer.decode(ids)``
    when no stop string matched, and that text cut just before the first stop string
    otherwise. It is not kept here: whoever reads the pieces keeps what it needs (a stream
    sends them on and keeps nothing). The end-of-text token is a control token, not text,
    and adds nothing.

    When a stop string completes, ``stopped`` becomes true and ``stop_reason`` holds it;
    the request is finished, so a further ``add`` raises ``RuntimeError`` (as it does after
    ``flush``), while ``flush`` may be called again and returns ``""``.

    Among stop strings, the first one *completed* while reading the text wins, as it would
    in a stream that arrived one character at a time; of two completed by the same
    character, the one starting earlier wins. So the outcome never depends on how the text
    happened to be split into tokens.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = ()) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
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
        if token_id == self._tokenizer.eot:
            return ""
        return self._release(self._utf8.decode(self._tokenizer.token_bytes(token_id)), final=False)

    def flush(self) -> str:
        """End of generation: release everything held. Bytes of a character that never
        completed become U+FFFD; held text that began a stop string is released as it was."""
        if self._finished:
            return ""
        return self._release(self._utf8.decode(b"", final=True), final=True)

    def _release(self, new_text: str, *, final: bool) -> str:
        """Append ``new_text`` to the held text, cut at a stop string if one completed, and
        emit all but the tail that could still begin one.

        Only the held text plus the new text need searching: the held tail is no longer than
        the longest stop string, and any stop string completing now must start inside it.
        """
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
    """How many leading characters of one stop string the text read so far ends with.

    That is what must be held back: text that a stop string could still complete. Knuth,
    Morris and Pratt's failure table lets the count advance a character at a time, in
    amortised constant time, and holds one integer per character of the stop string; testing
    every suffix against every prefix instead costs the square of the stop's length per token
    (and, held as a set of prefixes, as much memory).
    """

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
