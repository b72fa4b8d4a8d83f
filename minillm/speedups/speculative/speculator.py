"""Speculative decoding in the engine, for the steps that decode a single request.

Speculation applies only when a step's whole batch is one decode: one request running, its
prompt done, nobody else admitted this step. That is the server's batch-1 case and
``LLM.generate`` of one prompt. With two or more requests in the batch the engine takes its
ordinary continuous-batching step, one token per request, and the drafter is not run:
batching already turns the memory-bound decode step into a compute-heavier one, which is
exactly the slack speculation would spend, so the two compete for the same resource
(chapter 14 measures the batch-1 case and explains this; chapter 1 has the roofline).

It plugs in beside the engine's core rather than into it, as vLLM keeps speculation a proposer
beside its workers: :func:`~minillm.engine.build.build_engine` makes a
:class:`SpeculativeEngine`, the plain engine whose scheduler reserves the draft's slots in the
sequence's blocks (:meth:`~minillm.engine.scheduler.Scheduler.reserve_lookahead`) and whose
runner is wrapped in a :class:`SpeculativeRunner`. That runner takes the chunks with
lookahead slots: it asks the :class:`Speculator` for that many draft tokens, writes the
target's keys and values for the last token and the draft into those slots in one forward,
and applies the acceptance rule; every other step it hands to the plain runner. The engine's
step is unchanged: it appends the accepted tokens and the next one, and the scheduler
advances the sequence's computed tokens past the accepted ones only, so the rejected tokens'
slots are simply written over later (the paged rollback).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from minillm.data.tokenizer import Tokenizer
from minillm.decoding.sampling import SamplingParams
from minillm.engine.config import EngineConfig
from minillm.engine.kv_cache import PagedAttention
from minillm.engine.llm_engine import LLMEngine, Speedups
from minillm.engine.model_runner import ChunkOutput, ModelRunner
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.model.gpt import GPT
from minillm.speedups.speculative.drafters import ModelDrafter, NgramDrafter
from minillm.speedups.speculative.rule import Draft, SpeculativeStats, accept


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


class SpeculativeRunner:
    """The executor of speculative steps, around the engine's :class:`ModelRunner`: a step
    whose one chunk has lookahead slots (``chunk.num_lookahead``) drafts and verifies; every
    other step is the plain runner's."""

    def __init__(self, runner: ModelRunner, speculator: Speculator) -> None:
        self.runner, self.speculator = runner, speculator

    def execute(self, output: SchedulerOutput) -> list[ChunkOutput]:
        """:meth:`ModelRunner.execute`, with a lone decode given lookahead slots speculating:
        its output is the accepted drafts plus the next token."""
        if len(output.chunks) == 1 and output.chunks[0].num_lookahead:
            return [ChunkOutput(self.speculate(output.chunks[0]))]
        return self.runner.execute(output)

    @torch.inference_mode()
    def speculate(self, chunk: ScheduledChunk) -> list[int]:
        """A decode with ``chunk.num_lookahead`` reserved slots: draft that many tokens at
        most, verify them, and return the accepted drafts plus the next token."""
        draft = self.speculator.propose(chunk.seq, chunk.num_lookahead)
        accepted, token = self.verify(chunk, draft)
        self.speculator.stats.record(len(draft), accepted, accepted + 1)
        return draft.tokens[:accepted] + [token]

    def verify(self, chunk: ScheduledChunk, draft: Draft) -> tuple[int, int]:
        """Speculative decoding's check (chapter 14): run the target once over the sequence's
        last token and the ``draft`` tokens, writing their keys and values into its blocks
        (which hold ``num_tokens + len(draft)`` slots), and return ``(n_accepted,
        next_token)`` by the acceptance rule. Slots past the accepted tokens hold stale keys
        until a later step writes over them: the computed tokens advance only past what was
        accepted."""
        runner, seq = self.runner, chunk.seq
        span = ScheduledChunk(seq, seq.num_tokens - 1, 1 + len(draft))
        (prefill,) = runner._prefill_chunks([span], offset=0)
        tokens = torch.tensor([seq.token_ids[-1], *draft.tokens], dtype=torch.long, device=runner.device)
        positions = torch.arange(span.start, span.start + span.num_tokens, device=runner.device)
        attention = PagedAttention(runner.pool, prefill.slots[span.start :], [], [prefill], backend=runner.attention)
        hidden = runner.model.hidden_states(tokens[None], positions[None], attention)[0]
        return accept(runner.model.logits(hidden).float(), draft, seq.params, seq.generator)


class SpeculativeEngine(LLMEngine):
    """The engine with speculative decoding on the steps that decode a single request: the
    scheduler reserves up to ``speculator.k`` lookahead slots for such a step, and the
    :class:`SpeculativeRunner` fills them. ``speculator.stats`` counts every speculative step."""

    def __init__(self, model: GPT, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 speedups: Speedups | None = None, *, speculator: Speculator) -> None:
        super().__init__(model, config, tokenizer, speedups)
        self.speculator = speculator
        self.scheduler.num_lookahead_slots = speculator.k
        self.runner = SpeculativeRunner(self.runner, speculator)
