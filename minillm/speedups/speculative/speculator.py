"""Speculative decoding in the engine, for the steps that decode a single request.

Speculation applies only when a step's whole batch is one decode: one request running, its
prompt done, nobody else admitted this step. That is the server's batch-1 case and
``LLM.generate`` of one prompt. With two or more requests in the batch the engine takes its
ordinary continuous-batching step, one token per request, and the drafter is not run:
batching already turns the memory-bound decode step into a compute-heavier one, which is
exactly the slack speculation would spend, so the two compete for the same resource
(chapter 14 measures the batch-1 case and explains this; chapter 1 has the roofline).

It runs through the engine's one step path. The scheduler reserves the draft's slots in the
sequence's blocks (:meth:`~minillm.engine.scheduler.Scheduler.reserve_lookahead`); the model
runner asks the :class:`Speculator` for that many draft tokens, writes the target's keys and
values for the last token and the draft into those slots in one forward, and applies the
acceptance rule; the engine appends the accepted tokens and the next one; and the scheduler
advances the sequence's computed tokens past the accepted ones only, so the rejected tokens'
slots are simply written over later (the paged rollback).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from minillm.speedups.speculative.drafters import ModelDrafter, NgramDrafter
from minillm.engine.sequence import Sequence
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.speedups.speculative.rule import Draft, SpeculativeStats


class Drafter(Protocol):
    def propose(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        ...


class Speculator:
    """How drafts are made (a drafter per request, kept on its ``Sequence``), how many a step
    may verify (``k``), and the counters of every speculative step."""

    def __init__(self, make_drafter: Callable[[], Drafter], num_speculative_tokens: int, name: str) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.make_drafter, self.k, self.name = make_drafter, num_speculative_tokens, name
        self.stats = SpeculativeStats()

    @classmethod
    def with_draft_model(cls, draft: GPT, target: GPT, num_speculative_tokens: int) -> Speculator:
        """Speculate with a smaller model; it must speak the target's vocabulary."""
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs the same tokenizer"
            )
        draft = draft.to(device=target.device, dtype=target.dtype).eval()
        return cls(lambda: ModelDrafter(draft), num_speculative_tokens, "draft model")

    @classmethod
    def with_ngram(cls, num_speculative_tokens: int, max_ngram: int = 3) -> Speculator:
        """Speculate by prompt lookup: no draft model at all."""
        return cls(lambda: NgramDrafter(max_ngram), num_speculative_tokens, "n-gram lookup")

    def propose(self, seq: Sequence, room: int) -> Draft:
        """Up to ``room`` draft tokens for ``seq`` (the slots the scheduler reserved), from the
        drafter it keeps for its whole life, made on its first draft."""
        if seq.drafter is None:
            seq.drafter = self.make_drafter()
        return seq.drafter.propose(seq.token_ids, room, seq.params, seq.generator)
