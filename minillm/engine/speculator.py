"""Speculative decoding in the engine, for the steps that decode a single request.

The engine applies speculation only when a step's whole batch is one decode: one request
running, its prompt done, nobody else admitted this step. That is the server's batch-1 case
and ``LLM.generate`` of one prompt. With two or more requests in the batch the engine takes
its ordinary continuous-batching step, one token per request, and the drafter is not run:
batching already turns the memory-bound decode step into a compute-heavier one, which is
exactly the slack speculation would spend, so the two compete for the same resource
(chapter 12 measures the batch-1 case and explains this; chapter 1 has the roofline).

Per step, the :class:`Speculator` asks its drafter for up to ``k`` tokens; the model runner
writes the target's keys and values for the last token and the draft into the sequence's
paged blocks in one forward and applies the acceptance rule; the engine appends the accepted
tokens and the next one, and advances the sequence's computed tokens past the accepted ones
only, so the rejected tokens' slots are simply written over later (the paged rollback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from minillm.drafters import ModelDrafter, NgramDrafter
from minillm.engine.scheduler import SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.model import GPT
from minillm.sampling import SamplingParams
from minillm.speculative import Draft, SpeculativeStats


class Drafter(Protocol):
    def propose(self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        ...


class Speculator:
    """Drafters for the engine's requests (one each, kept while the request lives) and the
    counters of every speculative step."""

    def __init__(self, make_drafter: Callable[[], Drafter], num_speculative_tokens: int, name: str) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.make_drafter, self.k, self.name = make_drafter, num_speculative_tokens, name
        self.stats = SpeculativeStats()
        self._drafters: dict[str, Drafter] = {}

    @classmethod
    def with_draft_model(cls, draft: GPT, target: GPT, num_speculative_tokens: int) -> Speculator:
        """Speculate with a smaller model; it must speak the target's vocabulary."""
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                f"({target.cfg.vocab_size}); speculative decoding needs the same tokenizer"
            )
        weight = target.tok_emb.weight
        draft = draft.to(device=weight.device, dtype=weight.dtype).eval()
        return cls(lambda: ModelDrafter(draft), num_speculative_tokens, "draft model")

    @classmethod
    def with_ngram(cls, num_speculative_tokens: int, max_ngram: int = 3) -> Speculator:
        """Speculate by prompt lookup: no draft model at all."""
        return cls(lambda: NgramDrafter(max_ngram), num_speculative_tokens, "n-gram lookup")

    @staticmethod
    def applies(output: SchedulerOutput) -> bool:
        """True when this step's batch is exactly one decode (see the module docstring)."""
        if len(output.chunks) != 1:
            return False
        chunk = output.chunks[0]
        return chunk.num_tokens == 1 and chunk.samples and chunk.start >= chunk.seq.prompt_len

    def propose(self, seq: Sequence, generator: torch.Generator | None) -> Draft:
        """Up to ``k`` draft tokens for ``seq``, no more than it can still use: each round
        emits the accepted drafts plus one token, within ``max_tokens`` and the context."""
        room = min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1, seq.max_model_len - seq.num_tokens - 1)
        if room < 1:
            return Draft()
        drafter = self._drafters.get(seq.request_id)
        if drafter is None:
            drafter = self._drafters[seq.request_id] = self.make_drafter()
        return drafter.propose(seq.token_ids, room, seq.params, generator)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's drafter (and the draft model's cache with it)."""
        self._drafters.pop(request_id, None)


NGRAM = "ngram"  # the --speculative-draft value that asks for prompt lookup instead of a model


def build_speculator(draft: GPT | str | Path | None, target: GPT, num_speculative_tokens: int) -> Speculator | None:
    """The speculator that ``LLM(speculative_draft=...)`` and ``--speculative-draft`` ask for:
    ``None`` for none, ``"ngram"`` for prompt lookup, a ``GPT`` or a checkpoint path for a
    draft model (loaded onto the target's device and dtype)."""
    if draft is None:
        return None
    if draft == NGRAM:
        return Speculator.with_ngram(num_speculative_tokens)
    if not isinstance(draft, GPT):
        from minillm.checkpoint import load_model

        draft = load_model(draft, target.tok_emb.weight.device)
    return Speculator.with_draft_model(draft, target, num_speculative_tokens)
