"""Logits processors: what a request asks of its row of a step's logits beyond plain sampling.

Between the forward pass and the sampler, :func:`process_` hands each processor of
:data:`PROCESSORS`, in order, the rows that ask for it: :class:`Logprobs` copies them raw (vLLM's
raw logprobs), :class:`Penalties` adjusts them, :class:`GrammarMask` masks them last, so the
mask wins. A processor no row asks for is never called, so plain requests do no tensor work
here, and a captured step's argmax still answers their greedy rows. Modelled on vLLM's logits
processors, except that ours read their state from the request instead of carrying it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from minillm.decoding.logprobs import TokenLogprobs, token_logprobs
from minillm.decoding.penalties import adjust_logits_
from minillm.decoding.sampling import SamplingParams
from minillm.decoding.structured import TokenGrammar, mask_logits_, token_bias

# What a processor that reports returns: from the step's sampled tokens, one report per row
# that asked.
Report = Callable[[torch.Tensor], list[TokenLogprobs]]


class Row(Protocol):
    """What a processor reads of one request (the engine's ``Sequence`` is one)."""

    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    eos_token_id: int | None
    grammar: TokenGrammar | None

    @property
    def output_ids(self) -> list[int]: ...


class LogitsProcessor(Protocol):
    """One thing a request may ask of its row. ``shapes``: whether it changes what the sampler
    sees (``False``: it only reads the rows)."""

    shapes: bool

    def asks(self, row: Row) -> bool:
        """Whether ``row`` asks for it: its settings only, no tensor work."""
        ...

    def apply_(self, logits: torch.Tensor, rows: list[int], asking: list[Row]) -> Report | None:
        """Process ``logits[rows]``, the rows of ``asking``, in place; a processor that reports
        on the sampled tokens returns how."""
        ...


class Logprobs:
    """``logprobs``: the sampled token's log-probability and its top alternatives, from the raw row."""

    shapes = False

    def asks(self, row: Row) -> bool:
        return row.params.logprobs is not None

    def apply_(self, logits: torch.Tensor, rows: list[int], asking: list[Row]) -> Report:
        raw = logits[rows]  # a copy: the processors after this one change logits
        return lambda tokens: token_logprobs(raw, tokens[rows], [row.params.logprobs for row in asking])


class Penalties:
    """Presence, frequency and repetition penalties, logit biases and ``min_tokens``."""

    shapes = True

    def asks(self, row: Row) -> bool:
        return row.params.adjusts

    def apply_(self, logits: torch.Tensor, rows: list[int], asking: list[Row]) -> None:
        adjust_logits_(logits, rows, [r.params for r in asking], [r.token_ids[: r.prompt_len] for r in asking],
                       [r.output_ids for r in asking], [r.eos_token_id for r in asking])


class GrammarMask:
    """A schema's grammar: every token that could not continue valid JSON goes to ``-inf``."""

    shapes = True

    def asks(self, row: Row) -> bool:
        return row.grammar is not None

    def apply_(self, logits: torch.Tensor, rows: list[int], asking: list[Row]) -> None:
        mask_logits_(logits, rows, token_bias([r.grammar for r in asking], logits.shape[1], logits.device))


PROCESSORS: tuple[LogitsProcessor, ...] = (Logprobs(), Penalties(), GrammarMask())


@dataclass
class Processed:
    """What :func:`process_` did to a step's logits: whether it changed any row, and the reports
    still to make on the tokens sampled from them (each with the rows it covers)."""

    shaped: bool = False
    reports: list[tuple[list[int], Report]] = field(default_factory=list)

    def logprobs(self, tokens: torch.Tensor) -> list[list[TokenLogprobs] | None]:
        """For each row, its sampled token ``tokens[row]`` scored, or ``None`` if not asked."""
        scored: list[list[TokenLogprobs] | None] = [None] * len(tokens)
        for rows, report in self.reports:
            for row, entry in zip(rows, report(tokens)):
                scored[row] = [entry]
        return scored


def shapes_logits(row: Row) -> bool:
    """Whether a processor will change ``row``'s logits: each that does reads the request's
    tokens so far (penalties count them, a grammar follows them), so its next logits cannot be
    shaped before its latest token is known."""
    return any(p.shapes and p.asks(row) for p in PROCESSORS)


def process_(rows: list[Row], logits: torch.Tensor) -> Processed:
    """Run every processor of :data:`PROCESSORS`, in order, on the rows of ``logits`` (``[n,
    vocab]``, float, one row per request in ``rows``) that ask for it, in place."""
    done = Processed()
    candidates = [i for i, row in enumerate(rows) if row.params.token_by_token]  # plain rows ask for nothing
    if not candidates:
        return done
    for processor in PROCESSORS:
        asking = [i for i in candidates if processor.asks(rows[i])]
        if not asking:
            continue  # nobody asks: no tensor work
        report = processor.apply_(logits, asking, [rows[i] for i in asking])
        done.shaped |= processor.shapes
        if report is not None:
            done.reports.append((asking, report))
    return done


def prompt_logprobs(logits: torch.Tensor, targets: list[int], row: Row) -> list[TokenLogprobs]:
    """``row``'s prompt tokens ``targets`` scored from the raw ``logits`` rows that predicted
    them, as :class:`Logprobs` scores a sampled token, with ``prompt_logprobs`` alternatives."""
    return token_logprobs(logits, targets, [row.params.prompt_logprobs] * len(targets))
