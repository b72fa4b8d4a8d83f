"""The two drafters of speculative decoding (chapter 15): a small model, and a lookup.

Both answer ``propose(tokens, k, params, seed) -> Draft``: the sequence's likely next
``k`` tokens. :class:`ModelDrafter` runs a smaller GPT with the same tokenizer, ``k`` small
passes a round; :class:`NgramDrafter`, prompt lookup (Saxena, 2023), costs no model and wins
where the output repeats its input.
"""

from __future__ import annotations

import torch

from minillm.decoding.generate import ContiguousKVCache
from minillm.model.gpt import GPT
from minillm.decoding.draws import Stream, uniform
from minillm.decoding.sampling import SamplingParams
from minillm.speedups.speculative.rule import Draft, distribution, draw


class ModelDrafter:
    """A draft model with a KV cache over one sequence. Each ``propose`` keeps the cached
    prefix that still matches the sequence (the rollback after a rejection, found by
    comparison), feeds the rest, then drafts one forward pass at a time. Sampled, the guess at
    position ``j`` is the request's ``Stream.DRAFT`` draw for ``j`` (``seed`` must be given)."""

    def __init__(self, model: GPT) -> None:
        self.model = model.eval()
        self.context = model.cfg.context_length
        self.cache = ContiguousKVCache(model, 1, self.context)
        self.device = model.device
        self._held: list[int] = []  # the tokens whose keys and values the cache holds

    @torch.no_grad()
    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, seed: int | None = None
    ) -> Draft:
        if seed is None and not params.greedy:
            raise ValueError("a sampled draft draws by the request's seed: pass seed= (minillm.decoding.sampling."
                             "request_seed(params) gives one), so that the draft and the acceptance use one stream")
        k = min(k, self.context - len(tokens) + 1)  # the last draft token is never fed
        if k <= 0 or not tokens:
            return Draft()
        keep = _common_prefix(self._held, tokens, limit=len(tokens) - 1)
        self.cache.length, self._held = keep, self._held[:keep]
        logits = self._forward(tokens[keep:])
        drafted, probs = [], []
        for i in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = distribution(logits[None], params)[0]
                token = draw(q, uniform(seed, len(tokens) + i, Stream.DRAFT))
                probs.append(q)
            drafted.append(token)
            if i < k - 1:
                logits = self._forward([token])
        return Draft(drafted, torch.stack(probs) if probs else None)

    def _forward(self, new: list[int]) -> torch.Tensor:
        """Logits after feeding ``new`` at the cache's next positions."""
        start = self.cache.length
        tokens = torch.tensor([new], device=self.device)
        positions = torch.arange(start, start + len(new), device=self.device)[None]
        hidden = self.model.hidden_states(tokens, positions, self.cache)[0, -1]
        self._held += new
        return self.model.logits(hidden).float()


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens,
    longest ``n`` first (likelier right), preferring a match with ``k`` tokens after it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams | None = None, seed: int | None = None
    ) -> Draft:
        if k <= 0:
            return Draft()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail, best = tokens[-n:], []
            for start in range(len(tokens) - n - 1, -1, -1):  # latest first, never the tail itself
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if len(follow) == k:
                        return Draft(follow)
                    best = max(best, follow, key=len)  # a match near the end has a short tail
            if best:
                return Draft(best)
        return Draft()


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
