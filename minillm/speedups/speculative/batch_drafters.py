"""Drafting for a whole batch: what the engine's speculator asks each step.

A batch drafter answers ``propose([(seq, k), ...]) -> [Draft, ...]``: up to ``k`` tokens for
every speculating sequence of the step. :class:`EachSequence` runs a one-sequence drafter
(prompt lookup) on each in turn, which costs no model. :class:`PagedDrafter` runs the draft
model over all of them together, one forward a round, so drafting for eight sequences costs
about what drafting for one does, as verifying them does (chapter 1's flat step, again).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from minillm.decoding.draws import Stream, uniform
from minillm.decoding.sampling import SamplingParams, distribution
from minillm.engine.kv_cache import AttentionKernels, PagedKVPool
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.model.gpt import GPT
from minillm.speedups.speculative.rule import Draft, draw


class BatchDrafter(Protocol):
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[Draft]:
        ...


class OneSequenceDrafter(Protocol):
    def propose(self, tokens: list[int], k: int, params: SamplingParams, seed: int | None) -> Draft:
        ...


class EachSequence:
    """A drafter that needs no batching (prompt lookup), asked once per sequence."""

    def __init__(self, drafter: OneSequenceDrafter) -> None:
        self.drafter = drafter

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[Draft]:
        return [self.drafter.propose(seq.token_ids, k, seq.params, seq.seed) for seq, k in wants]


@dataclass
class SequenceView:
    """What a :class:`ModelRunner` reads of a sequence, standing in for one: its tokens and
    its blocks. The draft model runs on views of the engine's sequences (their tokens with the
    drafts so far appended); the speculative benchmark's timing on views of random ones."""

    request_id: object
    token_ids: list[int]
    block_table: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int | None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Drafting(SequenceView):
    """A sequence being drafted for: the target's blocks (which have the lookahead slots), and
    the ``want`` tokens to draft, with their distributions when sampled."""

    want: int = 0
    drafted: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class PagedDrafter:
    """The draft model over every speculating sequence at once.

    Its keys and values live in a pool of its own with the target pool's shape in blocks (as
    many, as large), addressed through the *target's* block tables: the scheduler, which
    reserves each sequence's lookahead slots, allocates for both models, and a block holds the
    same positions in either pool (a block shared through the prefix cache holds the same
    tokens for every sharer, so their drafts write the same values there). What the draft pool
    holds for a sequence is remembered as the tokens fed; a round keeps the longest prefix that
    still agrees with the sequence (a rejection cuts it, a preemption empties it) and feeds the
    rest, one ragged forward over every sequence, then drafts one forward a round.
    Sampled, the guess at position ``j`` is the request's ``Stream.DRAFT`` draw for ``j``.

    ``vocabulary`` (token ids) limits the guesses to those tokens, scored through their rows
    of the output matrix alone (:mod:`~minillm.speedups.speculative.draft_vocab`); None
    scores the whole vocabulary. ``attention`` is the engine's (its kernels read any pool)."""

    def __init__(self, model: GPT, target_pool: PagedKVPool, vocabulary: torch.Tensor | None = None,
                 attention: str | AttentionKernels = "torch") -> None:
        self.model = model.eval()
        self.vocabulary = None if vocabulary is None else vocabulary.to(model.device)
        # the kept tokens' rows of the (tied) output matrix, contiguous: the draft's LM head
        self.head = None if vocabulary is None else model.tok_emb.weight.detach()[self.vocabulary].contiguous()
        pool = PagedKVPool(model.cfg, target_pool.num_blocks, target_pool.block_size, model.device, model.dtype)
        self.runner = ModelRunner(self.model, pool, attention)
        self.context = model.cfg.context_length
        # per sequence: the tokens whose draft keys and values its blocks hold, and its preemptions by then
        self.held: weakref.WeakKeyDictionary[Sequence, tuple[list[int], int]] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[Draft]:
        drafting = [Drafting(seq.request_id, list(seq.token_ids), seq.block_table, seq.prompt_len, seq.params,
                              seq.seed, max(0, min(k, self.context - seq.num_tokens + 1)))  # the last draft is never fed
                    for seq, k in wants]
        chunks = []
        for (seq, _), d in zip(wants, drafting):
            if d.want:
                start = self.valid_prefix(seq)
                chunks.append(ScheduledChunk(d, start, d.num_tokens - start))  # type: ignore[arg-type]
        while chunks:
            self.draft_one(chunks)
            chunks = [ScheduledChunk(c.seq, c.seq.num_tokens - 1, 1) for c in chunks if len(c.seq.drafted) < c.seq.want]
        for (seq, _), d in zip(wants, drafting):
            if d.want:
                self.held[seq] = (d.token_ids[:-1], seq.num_preemptions)
        return [Draft(d.drafted, torch.stack(d.probs) if d.probs else None) for d in drafting]

    def valid_prefix(self, seq: Sequence) -> int:
        """How many of ``seq``'s first tokens the draft pool holds; at most all but the last,
        which every round feeds. A preempted sequence lost its blocks (others may have written
        them since), so it holds none."""
        tokens, preemptions = self.held.get(seq, ([], -1))
        if preemptions != seq.num_preemptions:
            return 0
        limit = min(len(tokens), seq.num_tokens - 1)
        return next((i for i in range(limit) if tokens[i] != seq.token_ids[i]), limit)

    def draft_one(self, chunks: list[ScheduledChunk]) -> None:
        """One forward of the draft model over ``chunks`` (each feeding its sequence's tokens
        not yet in the pool), and one drafted token appended to each."""
        step = self.runner.prepare(SchedulerOutput(chunks), captured=False)
        hidden = self.runner.forward(step)
        last = hidden if step.last_rows is None else hidden[step.last_rows]
        drafting: list[Drafting] = [c.seq for c in step.sampling]  # type: ignore[misc]
        logits = (self.model.logits(last) if self.head is None else F.linear(last, self.head)).float()
        if all(d.params.greedy for d in drafting):
            best = logits.argmax(dim=-1)
            self._append(drafting, (best if self.vocabulary is None else self.vocabulary[best]).tolist())
            return
        if self.vocabulary is not None:  # a sampled guess needs a distribution over the whole vocabulary:
            logits = logits.new_full((len(drafting), self.model.cfg.vocab_size), -math.inf).index_copy_(
                1, self.vocabulary, logits)  # the tokens left out score -inf, probability 0
        tokens = []
        for row, d in zip(logits, drafting):
            if d.params.greedy:
                tokens.append(int(row.argmax()))
                continue
            q = distribution(row[None], d.params)[0]
            tokens.append(draw(q, uniform(d.seed, d.num_tokens, Stream.DRAFT)))
            d.probs.append(q)
        self._append(drafting, tokens)

    @staticmethod
    def _append(drafting: list[Drafting], tokens: list[int]) -> None:
        for d, token in zip(drafting, tokens):
            d.drafted.append(token)
            d.token_ids.append(token)
