"""Speculative decoding in the engine, for the steps that decode a single request.

Speculation applies only when a step's whole batch is one decode (the server's batch-1 case,
``LLM.generate`` of one prompt): batching already spends the slack of a memory-bound decode
step that drafts would spend, so the two compete for the same resource (chapter 15).

It plugs in beside the engine's core, as vLLM keeps speculation a proposer beside its workers:
the scheduler reserves the draft's slots in the sequence's blocks
(:meth:`~minillm.engine.scheduler.Scheduler.reserve_lookahead`), and the
:class:`SpeculativeRunner` drafts into them, verifies in one forward and applies the
acceptance rule. The engine's step is unchanged: the scheduler advances the computed tokens
past the accepted ones only, so the rejected tokens' slots are written over later (the paged
rollback).
"""

from __future__ import annotations

import weakref
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
    def propose(self, tokens: list[int], k: int, params: SamplingParams, seed: int | None) -> Draft:
        ...


class Speculator:
    """How drafts are made (a drafter per request, dropped with its ``Sequence``), how many a
    step may verify (``k``), and the counters of every speculative step."""

    def __init__(self, make_drafter: Callable[[], Drafter], num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.make_drafter, self.k = make_drafter, num_speculative_tokens
        self.stats = SpeculativeStats()
        self.drafters: weakref.WeakKeyDictionary[Sequence, Drafter] = weakref.WeakKeyDictionary()

    @classmethod
    def with_draft_model(cls, draft: GPT, target: GPT, num_speculative_tokens: int) -> Speculator:
        """Speculate with a smaller model; it must speak the target's vocabulary."""
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs the same tokenizer"
            )
        draft = draft.to(device=target.device, dtype=target.dtype).eval()
        return cls(lambda: ModelDrafter(draft), num_speculative_tokens)

    @classmethod
    def with_ngram(cls, num_speculative_tokens: int, max_ngram: int = 3) -> Speculator:
        """Speculate by prompt lookup: no draft model at all."""
        return cls(lambda: NgramDrafter(max_ngram), num_speculative_tokens)

    def propose(self, seq: Sequence, room: int) -> Draft:
        """Up to ``room`` draft tokens for ``seq`` (the slots the scheduler reserved), from the
        drafter it keeps for its whole life, made on its first draft."""
        if seq not in self.drafters:
            self.drafters[seq] = self.make_drafter()
        return self.drafters[seq].propose(seq.token_ids, room, seq.params, seq.seed)


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

    def close(self) -> None:
        self.runner.close()

    @torch.inference_mode()
    def speculate(self, chunk: ScheduledChunk) -> list[int]:
        """Draft up to ``chunk.num_lookahead`` tokens, verify them, and return the accepted
        drafts plus the next token."""
        draft = self.speculator.propose(chunk.seq, chunk.num_lookahead)
        accepted, token = self.verify(chunk, draft)
        self.speculator.stats.record(len(draft), accepted, accepted + 1)
        return draft.tokens[:accepted] + [token]

    def verify(self, chunk: ScheduledChunk, draft: Draft) -> tuple[int, int]:
        """Run the target once over the sequence's last token and the ``draft``, writing their
        keys and values into its blocks, and return ``(n_accepted, next_token)`` by the
        acceptance rule (chapter 15)."""
        runner, seq = self.runner, chunk.seq
        span = ScheduledChunk(seq, chunk.start, 1 + len(draft))
        (prefill,) = runner.prefill_chunks([span])
        tokens = torch.tensor([seq.token_ids[-1], *draft.tokens], dtype=torch.long, device=runner.device)
        positions = torch.arange(span.start, span.start + span.num_tokens, device=runner.device)
        attention = PagedAttention(runner.pool, prefill.slots[span.start :], [], [prefill], backend=runner.attention)
        hidden = runner.model.hidden_states(tokens[None], positions[None], attention)[0]
        return accept(runner.model.logits(hidden).float(), draft, seq.params, seq.seed, span.start + 1)


class SpeculativeEngine(LLMEngine):
    """The engine with speculative decoding on the steps that decode a single request: the
    scheduler reserves up to ``speculator.k`` lookahead slots for such a step, and the
    :class:`SpeculativeRunner` fills them."""

    def __init__(self, model: GPT, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
                 speedups: Speedups | None = None, *, speculator: Speculator) -> None:
        super().__init__(model, config, tokenizer, speedups)
        self.speculator = speculator
        self.scheduler.num_lookahead_slots = speculator.k
        self.overlap = False  # a speculative step's tokens decide the next step's length
        self.runner = SpeculativeRunner(self.runner, speculator)
