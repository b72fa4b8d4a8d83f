"""One request's state, from arrival to finish: the ``Sequence``.

The prompt and the tokens generated so far are one list, ``token_ids``, so a sequence that is
recomputed after a preemption is simply "a longer prompt". The rest is the scheduler's and the
allocator's bookkeeping (status, block table, computed tokens, tokens pending), timestamps for
the server's latencies, and what the request owns while it lives (detokenizer, the seed its
draws are keyed by, grammar).

A token is *pending* from the moment a step that samples it is scheduled until the engine
appends it. The scheduler counts pending tokens as tokens (``num_tokens``), so an engine that
schedules step N+1 while step N still runs (overlap scheduling) gives each sequence its next
position at once; the token itself is read from step N's output where it is computed.
The sequence is the request's one record: finishing a request is dropping this object.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from minillm.decoding.sampling import FinishReason, SamplingParams

if TYPE_CHECKING:
    from minillm.decoding.detokenizer import IncrementalDetokenizer
    from minillm.decoding.logprobs import TokenLogprobs
    from minillm.decoding.structured import TokenGrammar


class SequenceStatus(Enum):
    """Where a sequence is in its life. Only RUNNING sequences hold KV blocks."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again: its blocks were freed, it will be recomputed
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTimes:
    """A request's timestamps (``time.monotonic()`` seconds), as the server reports them."""

    arrival: float
    first_scheduled: float
    first_token: float
    finish: float
    token_times: tuple[float, ...]

    @property
    def queue_time(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(eq=False)
class Sequence:
    """A request being served, made from its prompt: ``token_ids`` starts as a copy of it, and
    ``prompt_len`` is its length. ``eq=False``: two requests with the same tokens are still two
    requests, so sequences compare (and hash) by identity and can live in sets and dicts.

    ``request_id`` is any hashable key unique among the unfinished requests: ``LLM`` uses
    strings, the server a (request, choice) pair. ``max_model_len`` is the model's context:
    ``num_tokens`` never exceeds it, because the position embedding has no row for a position
    beyond it.
    """

    request_id: Hashable
    token_ids: list[int]
    prompt_len: int = field(init=False)  # the first prompt_len of token_ids are the prompt
    params: SamplingParams
    max_model_len: int
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # positions whose keys and values a scheduled step computes
    num_pending: int = 0  # tokens scheduled to be sampled, not yet appended (see the module docstring)
    num_steps_in_flight: int = 0  # scheduled steps with this sequence not yet accounted for: its blocks stay
    num_cached_prompt_tokens: int = 0  # prefix-cache hit, in tokens, at the last admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the engine, which knows the tokenizer
    seed: int | None = None  # what its draws are keyed by, with each token's position; None for greedy (sampling.request_seed)
    grammar: TokenGrammar | None = None  # with params.json_schema: which tokens may come next
    # With params.prompt_logprobs: entry j scores prompt token j + 1, filled in by the prefill
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.prompt_len = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known or pending: the scheduler's length of the sequence."""
        return len(self.token_ids) + self.num_pending

    @property
    def awaits_last_token(self) -> bool:
        """True when the tokens pending are all the request may still produce (``max_tokens``
        or the context reached): no step needs scheduling until they are appended."""
        return self.num_pending > 0 and (self.num_output_tokens + self.num_pending >= self.params.max_tokens
                                         or self.num_tokens >= self.max_model_len)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated and appended (pending ones are not counted)."""
        return len(self.token_ids) - self.prompt_len

    @property
    def scoring_prompt(self) -> bool:
        """True while the request wants prompt logprobs that its prefill has not yet made."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    def record_prompt_logprobs(self, start: int, scored: list[TokenLogprobs]) -> None:
        """Keep what a prefill chunk from position ``start`` scored (entry ``j`` scores token
        ``start + 1 + j``), skipping positions already held: a preempted request computes its
        prompt again, and scores it again, from the start."""
        if start > len(self.prompt_logprobs):
            raise RuntimeError(f"request {self.request_id!r}: prompt scored from {start}, "
                               f"only {len(self.prompt_logprobs)} positions before it held")
        self.prompt_logprobs += scored[len(self.prompt_logprobs) - start :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def times(self) -> RequestTimes:
        """The timestamps so far; a stamp not reached yet reads as the arrival time."""
        arrival = self.arrival_time
        return RequestTimes(arrival, self.first_scheduled_time or arrival, self.first_token_time or arrival,
                            self.finish_time or arrival, tuple(self.token_times))

    def append_token(self, token: int, now: float) -> None:
        """Add one sampled token (the oldest pending one, if any), record when it came, and
        finish if it ends the request (:meth:`SamplingParams.finish_reason`). A request held to a schema stops as soon as its
        value is complete, with no end-of-text token to wait for (and so even with
        ``ignore_eos``: the grammar allows nothing more). Appending to a finished sequence is a
        bug in the caller (for example a sequence aborted while its step ran), so it raises
        instead of silently growing a finished answer.
        """
        if self.status is SequenceStatus.FINISHED:
            raise RuntimeError(f"request {self.request_id!r} is finished ({self.finish_reason}); cannot append")
        grammar = self.grammar
        if grammar is not None:
            grammar.accept(token)
        self.token_ids.append(token)
        if self.num_pending:
            self.num_pending -= 1
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        if grammar is not None and grammar.done:
            reason: FinishReason | None = FinishReason.STOP
        else:
            length = len(self.token_ids)
            reason = self.params.finish_reason(token, length - self.prompt_len, self.eos_token_id,
                                               length >= self.max_model_len)
        if reason is not None:
            self.finish(reason, now)

    def finish(self, reason: FinishReason, now: float) -> None:
        """Mark the request done; a token still pending will never be appended. Its blocks are
        returned by the scheduler, which owns them."""
        self.status = SequenceStatus.FINISHED
        self.num_pending = 0
        self.finish_reason = reason
        self.finish_time = now
