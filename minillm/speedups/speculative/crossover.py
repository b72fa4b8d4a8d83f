"""Where speculation stops paying: the batch size past which checking drafts costs more than
the tokens they save.

A round of speculation at batch ``B`` drafts ``k`` tokens per sequence and verifies ``k + 1``
per sequence in one forward; it yields, per sequence, the tokens Leviathan et al. expect,
``E(alpha, k) = 1 + alpha + ... + alpha^k`` for per-position acceptance ``alpha``. A plain step
yields one token per sequence. So speculation pays while

    E(alpha, k)  >  r(B) = (t_verify(B, k) + k * t_draft(B)) / t_step(B)

While ``B * (k + 1)`` rows keep the step memory-bound (chapter 1), ``t_verify`` is about
``t_step`` and ``r`` is small; past the ridge, verification costs ``k + 1`` plain steps and
nothing can pay for it. :func:`time_costs` measures ``r`` through the engine's own step on
this machine, and :class:`Crossover` reads the limit off it for an acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from minillm.decoding.sampling import SamplingParams
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.machine.hardware import median_seconds
from minillm.speedups.speculative.batch_drafters import PagedDrafter, SequenceView, Drafting


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per target pass, ``1 + alpha + ... + alpha^k``, when a
    round drafts ``k`` tokens and each is accepted with probability ``alpha`` given that the
    earlier ones were (``alpha`` per position, not accepted over drafted)."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass(frozen=True)
class StepCosts:
    """Median seconds, at ``batch`` sequences, of a plain decode step, of a verification of
    ``k + 1`` tokens per sequence, and of one draft step (0 for a drafter with no model)."""

    batch: int
    k: int
    step_s: float
    verify_s: float
    draft_s: float

    @property
    def ratio(self) -> float:
        """``r(B)``: a speculative round's cost in plain steps."""
        return (self.verify_s + self.k * self.draft_s) / self.step_s


@torch.inference_mode()
def time_costs(runner: ModelRunner, drafter: PagedDrafter | None, batches: list[int], k: int, context: int = 64,
               repeats: int = 3, stop_above: float | None = None) -> list[StepCosts]:
    """:class:`StepCosts` at each batch size, in order, measured through the engine's own
    ``runner`` and ``drafter`` (the paged attention, the LM head over every verified row and
    the read-back included) on random sequences of ``context`` tokens laid in the pool's first
    blocks, so it must run before the pool holds anything. Batches the pool cannot hold are
    skipped; with ``stop_above``, the first whose ratio exceeds it is the last measured (larger
    batches only cost more)."""
    device, vocab, bs = runner.device, runner.model.cfg.vocab_size, runner.pool.block_size
    context = min(context, runner.model.cfg.context_length - k - 1)  # every position inside the model's context
    if context < 1:
        return []
    blocks = -(-(context + k + 1) // bs)
    greedy = SamplingParams(temperature=0)
    rows = []
    for b in batches:
        if b * blocks > runner.pool.num_blocks:
            break
        views = [SequenceView(i, torch.randint(vocab, (context + k + 1,)).tolist(), list(range(i * blocks, (i + 1) * blocks)),
                              1, greedy, 0) for i in range(b)]
        plain = SchedulerOutput([ScheduledChunk(replace(v, token_ids=v.token_ids[: context + 1]), context, 1)
                                 for v in views])  # type: ignore[arg-type]
        verify = SchedulerOutput([ScheduledChunk(v, context, k + 1) for v in views])  # type: ignore[arg-type]

        def verifying() -> None:
            hidden = runner.forward(runner.prepare(verify, captured=False))
            runner.model.logits(hidden).float().argmax(dim=-1).tolist()

        step = median_seconds(lambda: runner.execute_prepared(runner.prepare(plain, captured=False)), device,
                              repeats=repeats)
        verify_s = median_seconds(verifying, device, repeats=repeats)
        drafting = 0.0
        if drafter is not None:
            drafts = [ScheduledChunk(Drafting(**vars(v)), context, 1) for v in views]  # type: ignore[arg-type]
            drafting = median_seconds(lambda: drafter.draft_one(drafts), device, repeats=repeats)
        rows.append(StepCosts(b, k, step, verify_s, drafting))
        if stop_above is not None and rows[-1].ratio > stop_above:
            break
    return rows


class Crossover:
    """The measured costs of speculation against batch size, and the decision they imply.

    A sequence may draft fewer than ``k`` tokens (its draft length adapts), so a batch size
    pays if some draft length ``j <= k`` does: a round of ``j`` costs ``j`` draft steps and a
    verification taken to grow linearly from one plain step (``j = 0``) to the measured
    ``k + 1`` rows, and yields ``E(alpha, j)`` tokens."""

    def __init__(self, costs: list[StepCosts]) -> None:
        if not costs:
            raise ValueError("need the costs at one batch size at least")
        self.costs = costs
        self.k = costs[0].k

    def ratio(self, batch: int, j: int | None = None) -> float:
        """``r(batch)`` for rounds of ``j`` drafts (default ``k``), interpolated in log-batch
        between the measured sizes (held flat past them)."""
        j = self.k if j is None else j
        sizes = np.log2([c.batch for c in self.costs])
        ratios = [1 + j * ((c.verify_s - c.step_s) / self.k + c.draft_s) / c.step_s for c in self.costs]
        return float(np.interp(np.log2(max(batch, 1)), sizes, ratios))

    def pays(self, batch: int, alpha: float) -> bool:
        """Whether a speculative round (of the best draft length) beats a plain step at ``batch``
        with per-position acceptance ``alpha``."""
        return any(expected_tokens_per_pass(alpha, j) > self.ratio(batch, j) for j in range(1, self.k + 1))

    def limit(self, alpha: float) -> int:
        """The largest measured batch size at which speculation pays (0 if none)."""
        return max((c.batch for c in self.costs if self.pays(c.batch, alpha)), default=0)


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2-3, 4-7, 8-15, ... (a power of two and up)."""
    return batch.bit_length()


@dataclass
class _Timings:
    """Smoothed seconds per token of a bucket's decode steps, plain and speculative (None:
    not measured yet), and the steps decided there since the losing variant was last tried."""

    plain: float | None = None
    speculative: float | None = None
    since_retry: int = 0
    retry_every: int = 0  # steps between retries of the slower variant (0: not decided yet)
    faster: bool | None = None  # the variant found faster at the last retry (True: speculative)


class MeasuredChoice:
    """Whether to speculate at a batch size, by timing the engine's own steps.

    The cost model (:class:`Crossover`) leaves out what a round costs the host beyond its
    forwards: building the draft's steps, the catch-up of the draft's cache, judging, appending
    several tokens. So the engine also times its decode-only steps, per batch-size
    :func:`bucket`, as seconds per token each sequence gained: a plain step's time, or a
    speculative step's time over its tokens per sequence. A bucket tries each variant once
    (the one the model favours first), then takes the faster, and tries the slower again
    after ``retry_every`` steps there, so a drafter whose acceptance changes is followed. Each
    retry that finds the same variant faster doubles the wait before the next (up to
    ``max_retry_every``), so a variant that keeps losing costs ever fewer slow steps; a retry
    that changes the answer starts the waits over. A retry of speculation is dear (the draft's
    cache has to catch up on every token since it last drafted), hence the long first wait."""

    def __init__(self, retry_every: int = 64, max_retry_every: int = 4096, smoothing: float = 0.25) -> None:
        self.retry_every, self.max_retry_every, self.smoothing = retry_every, max_retry_every, smoothing
        self.buckets: dict[int, _Timings] = {}

    def choose(self, batch: int, favoured: bool) -> bool:
        """Speculate in a step of ``batch`` decodes? ``favoured`` is the model's answer, used
        until both variants are timed. Call once per step."""
        t = self.buckets.setdefault(bucket(batch), _Timings())
        if t.plain is None and t.speculative is None:
            return favoured
        if t.plain is None or t.speculative is None:
            return t.speculative is None  # the variant not timed yet
        faster = t.speculative < t.plain
        if faster != t.faster:  # decided for the first time, or the answer changed
            t.faster, t.retry_every, t.since_retry = faster, self.retry_every, 0
        t.since_retry += 1
        if t.since_retry >= t.retry_every:
            t.since_retry, t.retry_every = 0, min(2 * t.retry_every, self.max_retry_every)
            return not faster
        return faster

    def record(self, batch: int, speculative: bool, seconds: float, tokens_per_sequence: float) -> None:
        """Count a decode-only step of ``batch`` sequences that took ``seconds``."""
        t = self.buckets.setdefault(bucket(batch), _Timings())
        per_token = seconds / tokens_per_sequence
        old = t.speculative if speculative else t.plain
        new = per_token if old is None else old + self.smoothing * (per_token - old)
        if speculative:
            t.speculative = new
        else:
            t.plain = new
