"""Speculative decoding in the engine, for every decoding sequence of a step at once.

Each decode of a step gets up to ``k`` lookahead slots (fewer for a sequence whose drafts keep
being rejected, none once the batch is past the size where speculation stops paying); the
drafter proposes for all of them together; one forward of the target verifies every sequence's
last token and drafts, beside whatever else the step runs (prefills of new arrivals, decodes
that do not speculate); the acceptance rule runs per sequence, with its own draws.

Speculation competes with batching for one resource, the slack of a memory-bound step (chapter
1): checking ``k`` drafts per sequence costs about one token's time only while the batch times
``k + 1`` stays under the ridge. Past it the extra rows are paid in full and speculation loses,
so the speculator turns itself down as the batch grows (:meth:`Speculator.lookahead`).

It plugs in beside the engine's core, as vLLM keeps speculation a proposer beside its workers:
the scheduler reserves the drafts' slots in the sequences' blocks
(:meth:`~minillm.engine.scheduler.Scheduler.reserve_lookahead`, asking
:meth:`Speculator.lookahead` how many), and the :class:`SpeculativeRunner` drafts into them,
verifies through the plain runner's step (a :class:`VerifyChunk` feeds a sequence's drafts
past its end) and applies the acceptance rule. The engine's step is unchanged: the scheduler
advances the computed tokens past the accepted ones only, so the rejected tokens' slots are
written over later (the paged rollback).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import torch

from minillm.data.tokenizer import Tokenizer
from minillm.engine.config import EngineConfig
from minillm.engine.kv_cache import AttentionKernels, PagedKVPool, kv_bytes_per_token
from minillm.engine.llm_engine import LLMEngine, Speedups
from minillm.engine.model_runner import ChunkOutput, ModelRunner, PreparedStep, StepResult
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.model.gpt import GPT
from minillm.speedups.speculative.batch_drafters import BatchDrafter, EachSequence, PagedDrafter
from minillm.speedups.speculative.crossover import MeasuredChoice
from minillm.speedups.speculative.drafters import NgramDrafter
from minillm.speedups.speculative.rule import Draft, SpeculativeStats, accept, accept_greedy


class Speculator:
    """How drafts are made (a batch drafter, made once the engine's pool exists), how many a
    sequence may verify (up to ``k``, adapted to its acceptance), up to which batch size
    speculation runs, and the counters of every verification.

    A sequence's draft length follows its acceptance, much as Hugging Face's assisted
    generation adjusts its own (two more after a full acceptance, one fewer after a
    rejection): here one more after a round whose drafts were all accepted, one fewer (down to
    one) after a rejection, so a sequence the drafter predicts badly wastes little."""

    def __init__(self, make_drafter: Callable[[PagedKVPool, str | AttentionKernels], BatchDrafter],
                 num_speculative_tokens: int, disable_by_batch_size: int | None = None, draft_kv_bytes_per_token: int = 0) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if disable_by_batch_size is not None and disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 1, got {disable_by_batch_size}")
        self.make_drafter, self.k = make_drafter, num_speculative_tokens
        self.draft_kv_bytes_per_token = draft_kv_bytes_per_token  # the drafter's own cache, per token of the engine's pool
        # speculate in steps of at most so many sequences; None: where the engine's timed steps say it pays
        self.disable_by_batch_size = disable_by_batch_size
        self.measured = MeasuredChoice()  # the engine's own steps, timed, when no limit is given
        self.drafter: BatchDrafter | None = None
        self.stats = SpeculativeStats()
        self.draft_lengths: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @classmethod
    def with_draft_model(cls, draft: GPT, target: GPT, num_speculative_tokens: int,
                         disable_by_batch_size: int | None = None,
                         prepare: Callable[[GPT], GPT] | None = None,
                         vocabulary: torch.Tensor | None = None) -> Speculator:
        """Speculate with a smaller model; it must speak the target's vocabulary. ``prepare``
        gets it once cast to the target's device and dtype (the engine packs its weights as it
        packs the target's: a draft step is mostly the read of its LM head). ``vocabulary``:
        the token ids it may guess (:func:`~minillm.speedups.speculative.draft_vocab.draft_vocabulary`),
        None for all."""
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs the same tokenizer"
            )
        draft = draft.to(device=target.device, dtype=target.dtype).eval()
        if prepare is not None:
            draft = prepare(draft)
        return cls(lambda pool, attention: PagedDrafter(draft, pool, vocabulary, attention), num_speculative_tokens,
                   disable_by_batch_size, kv_bytes_per_token(draft.cfg, target.dtype))

    @classmethod
    def with_ngram(cls, num_speculative_tokens: int, max_ngram: int = 3,
                   disable_by_batch_size: int | None = None) -> Speculator:
        """Speculate by prompt lookup: no draft model at all."""
        return cls(lambda pool, attention: EachSequence(NgramDrafter(max_ngram)), num_speculative_tokens,
                   disable_by_batch_size)

    def start(self, pool: PagedKVPool, attention: str | AttentionKernels = "torch") -> None:
        """Make the drafter, beside the engine's KV ``pool`` (a draft model's cache mirrors it
        and reads itself with the engine's ``attention``)."""
        self.drafter = self.make_drafter(pool, attention)

    def speculates(self, batch: int) -> bool:
        """Whether a step of ``batch`` sequences speculates: up to the given limit, or else as
        the engine's timed steps say (:class:`~minillm.speedups.speculative.crossover.MeasuredChoice`).
        Asked once a step."""
        if self.disable_by_batch_size is not None:
            return batch <= self.disable_by_batch_size
        return self.measured.choose(batch)

    def lookahead(self, batch: int, seqs: list[Sequence]) -> list[int]:
        """Draft slots for each of a step's decoding ``seqs``, in a step of ``batch`` sequences
        (the scheduler's question)."""
        if not self.speculates(batch):
            return [0] * len(seqs)
        return [self.draft_lengths.get(seq, self.k) for seq in seqs]

    def propose(self, chunks: list[ScheduledChunk]) -> list[Draft]:
        """A draft for each chunk, into the lookahead slots the scheduler reserved for it."""
        return self.drafter.propose([(c.seq, c.num_lookahead) for c in chunks])

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count one verification and adapt ``seq``'s draft length to it."""
        self.stats.record(drafted, accepted, accepted + 1)
        if drafted:
            length = self.draft_lengths.get(seq, self.k)
            self.draft_lengths[seq] = min(self.k, length + 1) if accepted == drafted else max(1, length - 1)


@dataclass
class VerifyChunk(ScheduledChunk):
    """A decode that feeds its sequence's last token and then a ``draft`` into the lookahead
    slots: the target computes all their keys and values, and samples nothing for it (its
    ``samples`` is False: the tokens run past the sequence's end); the rows go to the
    acceptance rule instead."""

    draft: Draft = field(default_factory=Draft)

    def input_tokens(self) -> list[int]:
        return [self.seq.token_ids[self.start], *self.draft.tokens]


class SpeculativeRunner:
    """The executor of speculative steps, around the engine's :class:`ModelRunner`: a step
    with lookahead slots drafts for them, verifies in the plain runner's one forward, and
    returns, for each speculating decode, its accepted drafts plus the next token; every
    other chunk's output is the plain runner's."""

    def __init__(self, runner: ModelRunner, speculator: Speculator) -> None:
        self.runner, self.speculator = runner, speculator
        self._last_done = 0.0  # when the latest step's outputs were in hand

    def execute(self, output: SchedulerOutput) -> list[ChunkOutput]:
        """Run a step, and time it for the speculator if it decodes only."""
        start = time.perf_counter()
        # a sequence that ended in the overlapped step before this one drafts nothing: its tokens would be dropped
        speculating = [c for c in output.chunks if c.num_lookahead and not c.seq.is_finished]
        outputs = self.speculate(output, speculating) if speculating else self.runner.execute(output)
        self._timed(output, outputs, bool(speculating), start)
        return outputs

    def prepare(self, output: SchedulerOutput) -> PreparedStep:
        """Prepare a step that does not speculate, for :meth:`submit` (an overlapping engine's)."""
        return self.runner.prepare(output)

    def submit(self, step: PreparedStep) -> StepResult:
        """Start a step that does not speculate and return at once (overlap scheduling). Its
        time for the speculator runs from when it could start computing (submitted, or the
        step before it done) to when its outputs are in hand: with the host's work hidden
        behind the device's, that is what a plain step costs, while a speculative step (run
        serially) pays both."""
        result, submitted = self.runner.submit(step), time.perf_counter()

        def wait() -> list[ChunkOutput]:
            outputs = result.wait()
            self._timed(step.output, outputs, False, max(submitted, self._last_done))
            return outputs

        return StepResult(wait)

    def _timed(self, output: SchedulerOutput, outputs: list[ChunkOutput], speculative: bool, start: float) -> None:
        """Count a decode-only step that began at ``start`` for the speculator's choice."""
        self._last_done = done = time.perf_counter()
        chunks = output.chunks
        tokens = sum(len(o.tokens) for o in outputs) / len(chunks)
        if tokens and all(c.is_decode for c in chunks):
            self.speculator.measured.record(len(chunks), speculative, done - start, tokens)

    def speculate(self, output: SchedulerOutput, speculating: list[ScheduledChunk]) -> list[ChunkOutput]:
        """Draft for the ``speculating`` chunks, verify in the step's one forward, and return
        every chunk's output (a speculating decode's: its accepted drafts and the next token)."""
        with torch.inference_mode():
            drafts = self.speculator.propose(speculating)
        verifying = {id(c): VerifyChunk(c.seq, c.start, 1 + len(d), d) for c, d in zip(speculating, drafts) if d.tokens}
        for c, d in zip(speculating, drafts):
            if not d.tokens:  # nothing drafted: a plain decode, which the plain runner samples
                self.speculator.record(c.seq, 0, 0)
        step = self.runner.prepare(SchedulerOutput([verifying.get(id(c), c) for c in output.chunks]), captured=False)
        computed = self.runner.compute(step)
        outputs = self.runner.read(computed)
        if verifying:
            judged = self.judge([c for c in step.ordered if isinstance(c, VerifyChunk)], step.ordered, computed.hidden)
            for i, c in enumerate(output.chunks):
                if id(c) in verifying:
                    outputs[i] = ChunkOutput(judged[id(verifying[id(c)])])
        return outputs

    def close(self) -> None:
        self.runner.close()

    @torch.inference_mode()
    def judge(self, verifying: list[VerifyChunk], ordered: list[ScheduledChunk], hidden: torch.Tensor) -> dict[int, list[int]]:
        """Each verifying chunk's new tokens (by ``id``), from its rows of the forward's
        ``hidden`` states (``ordered`` is the forward's order): one LM head over all of them,
        then the acceptance rule per sequence (chapter 15), with its own draws."""
        ends = dict(zip(map(id, ordered), accumulate(c.num_tokens for c in ordered)))
        rows = [r for c in verifying for r in range(ends[id(c)] - c.num_tokens, ends[id(c)])]
        logits = self.runner.model.logits(hidden[torch.tensor(rows, device=hidden.device)]).float()
        best = logits.argmax(dim=-1).tolist() if any(c.seq.params.greedy for c in verifying) else None
        judged, first = {}, 0
        for c in verifying:
            seq, draft, last = c.seq, c.draft, first + c.num_tokens
            if seq.params.greedy:
                accepted, token = accept_greedy(best[first:last], draft.tokens)
            else:
                accepted, token = accept(logits[first:last], draft, seq.params, seq.seed, c.start + 1)
            self.speculator.record(seq, len(draft), accepted)
            judged[id(c)] = draft.tokens[:accepted] + [token]
            first = last
        return judged


class SpeculativeEngine(LLMEngine):
    """The engine with speculative decoding: the scheduler reserves lookahead slots for the
    decodes the speculator asks for, and the :class:`SpeculativeRunner` fills them."""

    def __init__(self, model: GPT, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 speedups: Speedups | None = None, *, speculator: Speculator) -> None:
        self.speculator = speculator  # before the pool is sized: the draft's cache shares its budget
        super().__init__(model, config, tokenizer, speedups)
        speculator.start(self.pool, self.runner.attention)
        self.scheduler.num_lookahead_slots = speculator.k
        self.scheduler.lookahead = speculator.lookahead
        self.runner = SpeculativeRunner(self.runner, speculator)

    def kv_bytes_beside_per_token(self) -> int:
        """The draft model's keys and values: its pool has as many blocks as the target's."""
        return self.speculator.draft_kv_bytes_per_token
