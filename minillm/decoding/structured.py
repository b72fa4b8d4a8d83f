"""Structured output: decoding held to a JSON Schema by a mask over the vocabulary, each step.

A request with ``SamplingParams.json_schema`` gets a :class:`TokenGrammar`, which knows the
tokens that keep the text on its way to valid JSON: every other logit becomes ``-inf`` before
sampling, the chosen token advances it, and the request finishes when the value is complete.
The output always validates, unless ``max_tokens`` cuts it short (finish reason ``"length"``).

The matcher is llguidance's (llama.cpp's; vLLM uses its sibling xgrammar): an Earley parser
walked against a trie of the vocabulary, a fraction of a millisecond per mask, covering most
of JSON Schema. Chapter 10 builds the same idea by hand and checks it against this one.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minillm.data.tokenizer import Tokenizer

# ``response_format: {"type": "json_object"}`` asks for any JSON object: the schema of one.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

_BITS = 32  # llguidance's masks are int32 words, one bit a token
# How many compiled schemas a compiler keeps, the most recently used: a server's clients tend
# to send the same few schemas again and again.
SCHEMA_CACHE = 64
# The JSON's layout: json.dumps spacing and no other whitespace, or a model that has never seen
# JSON pads forever. A schema's "x-guidance" key can still override these.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    """The library, imported on first use: a server that is never asked for JSON never loads
    it. (Not its ``llguidance.torch`` helpers: importing them compiles a kernel with
    ``torch.compile``, 5 s here, for a job :func:`token_bias` does in a table lookup.)"""
    import llguidance

    return llguidance


def _schema_text(schema: object) -> str:
    """``schema`` as JSON text, which llguidance compiles and the cache is keyed by (keys in the
    schema's order: it orders the output's properties)."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema cannot be enforced: a JSON Schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as err:  # not serialisable: NaN, a set...
        raise ValueError(f"json_schema cannot be enforced: {err}") from None


@functools.cache
def grammar_compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    """The one :class:`GrammarCompiler` over ``tokenizer``'s vocabulary in this process: the
    engine compiles each choice's grammar with it, and the server checks a schema on arrival with
    it, so a request's schema is compiled once, and the vocabulary indexed once."""
    return GrammarCompiler(tokenizer)


class GrammarCompiler:
    """Makes :class:`TokenGrammar` matchers over one tokenizer's vocabulary, indexed on first
    use (about 0.2 s for GPT-2's). A schema compiles once (about a millisecond, kept by its
    text) and each choice starts from a copy (10 microseconds); one it cannot use raises
    ``ValueError`` saying why."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._indexed: Any = None
        self._indexing = threading.Lock()  # the server's handlers and its engine thread share one compiler
        self._start = functools.lru_cache(maxsize=SCHEMA_CACHE)(self._compile)

    @property
    def vocabulary(self) -> Any:
        """llguidance's index of the tokenizer's tokens (built on first use, by one thread)."""
        with self._indexing:
            if self._indexed is None:
                self._indexed = self._index()
        return self._indexed

    def _index(self) -> Any:
        import llguidance.tiktoken

        encoding = getattr(self.tokenizer, "encoding", None)
        if encoding is None:
            raise ValueError("structured output needs a tiktoken tokenizer (this engine's has no .encoding)")
        return llguidance.tiktoken.lltokenizer_from_encoding(encoding, eos_token=self.tokenizer.eot)

    def check(self, schema: object) -> None:
        """Compile ``schema`` (kept for the choices that follow), or raise ``ValueError`` saying
        why it cannot constrain decoding: not an object, not JSON Schema, or a part the matcher
        does not support."""
        self._start(_schema_text(schema))

    def compile(self, schema: object) -> TokenGrammar:
        """A fresh matcher for one choice of a request; raises as :meth:`check` does."""
        return TokenGrammar(self._start(_schema_text(schema)).deep_copy(), self.vocabulary.vocab_size)

    def _compile(self, text: str) -> Any:
        """The matcher at the start of the grammar of the schema ``text``, laid out as
        :data:`_LAYOUT` says."""
        llguidance = _llguidance()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_LAYOUT)
        matcher = llguidance.LLMatcher(self.vocabulary, grammar)
        if matcher.is_error():
            raise ValueError(f"json_schema cannot be enforced: {matcher.get_error()[:300]}")
        return matcher


class TokenGrammar:
    """One request's position in its grammar: which tokens may come next, and the step on."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` for token ``t``). The matcher writes through a raw pointer, so the row is
        checked to be the memory it expects: CPU, int32, contiguous, wide enough."""
        words = bitmask[row]
        if not (words.device.type == "cpu" and words.dtype == torch.int32 and words.is_contiguous()
                and words.numel() * _BITS >= self.vocab_size):
            raise ValueError(f"a bitmask row must be contiguous CPU int32 of >= {self.vocab_size} bits")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token: int) -> None:
        """Advance past ``token``, which the last mask allowed; anything else is a bug upstream
        (a sampler that ignored the mask), so it raises rather than derail silently."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"token {token} is not allowed by the grammar: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """True once the value is complete: the grammar allows nothing more but the end."""
        return self._matcher.is_stopped()


def token_bias(grammars: list[TokenGrammar], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """What each row's grammar adds to its logits, ``[len(grammars), vocab]``: 0 where the
    token is allowed, ``-inf`` where not (and past the grammar's vocabulary). Raises
    ``RuntimeError`` if a grammar allows nothing. Each byte of the matcher's bits picks its
    eight biases from :func:`_byte_bias` in one ``index_select``: 2 ms for 32 rows of GPT-2's
    vocabulary on a 2-core CPU, where shifts and ``masked_fill`` took 14."""
    words = -(-max(vocab, max(g.vocab_size for g in grammars)) // _BITS)
    bitmask = torch.zeros(len(grammars), words, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask, row)
    if not bitmask[:, : -(-vocab // _BITS)].any(dim=1).all():  # on the bits: 32x less to read than the biases
        raise RuntimeError("a grammar allows no token at all")
    as_bytes = bitmask.to(device).view(torch.uint8).flatten().long()  # little-endian (x86, Arm): token order
    return _byte_bias(torch.device(device)).index_select(0, as_bytes).view(len(grammars), -1)[:, :vocab]


@functools.cache
def _byte_bias(device: torch.device) -> torch.Tensor:
    """Row b: the eight biases (0 allowed, -inf not) that byte b of a mask stands for, lowest
    bit first; made on ``device`` once, on first use, rather than every step or at import."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return torch.zeros(256, 8, device=device).masked_fill(bits == 0, float("-inf"))


def mask_logits_(logits: torch.Tensor, rows: list[int], bias: torch.Tensor) -> None:
    """Add a :func:`token_bias` to ``logits[rows]``, in place. The mask wins over a request's
    own adjustments: a row they left with no allowed token chooses evenly among the allowed."""
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, bias)  # one pass; gathering the rows and scattering them back took 9x longer
    dead = torch.isneginf(logits.amax(dim=1)[index])
    if dead.any():
        logits[index[dead]] = bias[dead]
