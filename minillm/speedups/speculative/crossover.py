"""Where speculation stops paying, found by timing the engine's own steps.

A round of speculation at batch ``B`` yields, per sequence, the drafts accepted plus one token,
and costs a verification of ``k + 1`` tokens per sequence and ``k`` draft steps. While ``B * (k +
1)`` rows keep the step memory-bound (chapter 1) the verification costs about one plain step;
past the ridge it costs ``k + 1``, and no acceptance pays for it. Where the crossover lies
depends on the machine, the models, the text and the host's own work for a round, so the
engine does not predict it: it measures both kinds of step at each batch size
(:class:`MeasuredChoice`). ``python -m minillm.bench speculative`` puts the prediction from
the round's timed parts beside the measurement.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2-3, 4-7, 8-15, ... (a power of two and up)."""
    return batch.bit_length()


@dataclass
class _Timings:
    """A bucket's latest seconds per token of decode steps, plain and speculative, and the steps
    decided there since the losing variant was last tried."""

    plain_samples: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    speculative_samples: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    since_retry: int = 0
    retry_every: int = 0  # steps between retries of the slower variant (0: not decided yet)
    faster: bool | None = None  # the variant found faster at the last retry (True: speculative)
    trying: bool = False  # speculation is being retried, until one of its steps is timed
    trial_seconds: float = 0.0  # the latest trial of speculation: its steps' seconds,
    trial_tokens: float = 0.0  # and the tokens per sequence they gained

    @property
    def plain(self) -> float | None:
        """Seconds per token of a plain step: the median of the latest (None: none timed)."""
        return statistics.median(self.plain_samples) if self.plain_samples else None

    @property
    def speculative(self) -> float | None:
        """Seconds per token a speculative step gained each sequence: the median of the latest."""
        return statistics.median(self.speculative_samples) if self.speculative_samples else None


WINDOW = 5  # the latest timed steps of each variant whose median is its estimate


class MeasuredChoice:
    """Whether to speculate at a batch size, by timing the engine's own steps.

    A cost model of a round's forwards leaves out what the round costs the host beyond them
    (building the draft's steps, the catch-up of the draft's cache, judging, appending several
    tokens), which on a small model is most of the difference. So the engine times its
    decode-only steps, per batch-size :func:`bucket`, as seconds per token each sequence gained:
    a plain step's time, or a speculative step's time over its tokens per sequence, each
    variant's estimate the median of its latest :data:`WINDOW` steps (one slow step, a garbage
    collection or a page fault, moves a median not at all, where it moved an average for many
    steps after). A bucket first times ``first_steps`` steps of each variant (speculation first:
    it is what a draft was given for), then takes the faster, and tries the slower again
    after ``retry_every`` steps there, so a drafter whose acceptance changes is followed. Each
    retry that finds the same variant faster doubles the wait before the next (up to
    ``max_retry_every``), so a variant that keeps losing costs ever fewer slow steps; a retry
    that changes the answer starts the waits over. A retry of speculation is dear (the draft's
    cache has to catch up on every token since it last drafted), hence the long first wait.

    That catch-up is the price of switching to speculation, not of a speculative step: a step
    that speculates after one that did not is left untimed, and the trial goes on to the next
    (else a retry would time the catch-up of every token since the last, and speculation would
    look slower for ever than it is). It is a price all the same, and at a large batch, where
    the draft catches up on every sequence, a trial can cost many plain steps: so where plain
    decoding is the faster, the wait before the next trial is at least what keeps the trials'
    cost (the time of their steps beyond what plain steps would have taken for the same
    tokens) within ``retry_budget`` of the time between them."""

    def __init__(self, retry_every: int = 64, max_retry_every: int = 4096, first_steps: int = 3,
                 retry_budget: float = 0.02) -> None:
        self.retry_every, self.max_retry_every, self.first_steps = retry_every, max_retry_every, first_steps
        self.retry_budget = retry_budget
        self.buckets: dict[int, _Timings] = {}
        self._speculated = False  # whether the latest timed-or-not decode step speculated

    def choose(self, batch: int) -> bool:
        """Speculate in a step of ``batch`` decodes? Call once per step."""
        t = self.buckets.setdefault(bucket(batch), _Timings())
        if len(t.speculative_samples) < self.first_steps or t.trying:
            return True  # speculation first, until its first steps are timed
        if len(t.plain_samples) < self.first_steps:
            return False
        faster = t.speculative < t.plain
        if faster != t.faster:  # decided for the first time, or the answer changed
            t.faster, t.retry_every, t.since_retry = faster, max(self.retry_every, self._least_wait(t, faster)), 0
        t.since_retry += 1
        if t.since_retry >= t.retry_every:
            wait = max(2 * t.retry_every, self._least_wait(t, faster))
            t.since_retry, t.retry_every = 0, min(wait, self.max_retry_every)
            t.trying = not faster
            return not faster
        return faster

    def _least_wait(self, t: _Timings, faster: bool) -> int:
        """Steps to wait before trying speculation again where plain decoding is faster, so that
        the last trial's cost is at most ``retry_budget`` of the plain steps between trials
        (0 where speculation is the ``faster``: the retries are then of plain steps, which cost
        no catch-up, or where no trial was timed)."""
        if faster or t.plain is None or not t.trial_tokens:
            return 0
        extra = t.trial_seconds - t.trial_tokens * t.plain  # beyond plain steps for the same tokens
        return math.ceil(max(extra, 0.0) / (self.retry_budget * t.plain))

    def record(self, batch: int, speculative: bool, seconds: float, tokens_per_sequence: float) -> None:
        """Count a decode-only step of ``batch`` sequences that took ``seconds`` (a step that
        switched to speculation is not counted)."""
        switched, self._speculated = speculative and not self._speculated, speculative
        t = self.buckets.setdefault(bucket(batch), _Timings())
        if switched:  # a trial of speculation begins: its cost counts towards the wait for the next
            t.trial_seconds, t.trial_tokens = seconds, tokens_per_sequence
            return
        if speculative and (t.trying or len(t.speculative_samples) < self.first_steps):  # the trial's timed steps
            t.trial_seconds += seconds
            t.trial_tokens += tokens_per_sequence
        t.trying = False
        (t.speculative_samples if speculative else t.plain_samples).append(seconds / tokens_per_sequence)
