"""Speculative decoding: a cheap drafter guesses ``k`` tokens, the target checks them in one pass.

A batch-1 decode step is memory-bound, so feeding the target ``k + 1`` tokens costs about what
one does, and gives its distribution at every one of those positions. The acceptance rule
(Leviathan, Kalman and Matias 2023; Chen et al. 2023) keeps the output distribution *exactly*
the target's: with ``p`` the target's and ``q`` the drafter's distribution, accept each drafted
``x`` with probability ``min(1, p(x) / q(x))``; on the first rejection draw from
``max(0, p - q)``, normalised, and stop; if all ``k`` pass, draw a bonus token from ``p``.
Greedy, both are one-hot: accept while the draft matches the argmax. Every pass yields at least
one token; what speculation can lose is the drafter's time.

Sampled, every number is a request's counter-based draw (:mod:`minillm.decoding.draws`) for
the position of the token it decides, in a stream of its own: the draft's guess
(``Stream.DRAFT``), the test of it (``Stream.ACCEPT``) and the token drawn after a rejection or
all accepted (``Stream.RESIDUAL``). Separate streams keep the test's number independent of the
guess it tests, as the rule's proof needs; positions past a rejection are drafted again the
next round, and nothing decided so far used their numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.decoding.generate import ContiguousKVCache, check_prompt
from minillm.model.gpt import GPT
from minillm.decoding.draws import Stream, uniform
from minillm.decoding.sampling import SamplingParams, distribution, invert_cdf, request_seed


@dataclass
class Draft:
    """Tokens a drafter proposes, and the distributions ``[len(tokens), vocab]`` they were
    drawn from (``None``: chosen deterministically, one-hot at each token)."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class SpeculativeStats:
    """Counters over a run: how many target passes, how many drafted and accepted tokens, and
    how many rounds ended in a rejection (the rest accepted every token they drafted)."""

    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    rejections: int = 0
    # by draft position i: rounds that drafted a token i, and rounds that accepted it
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """Count one sequence's verification: ``drafted`` tokens, the first ``accepted`` of
        them kept, ``emitted`` tokens in all (the accepted and the target's own)."""
        self.target_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.generated += emitted
        self.rejections += accepted < drafted  # the round stopped at a rejected token
        for counts, n in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            counts += [0] * (n - len(counts))
            for i in range(n):
                counts[i] += 1

    def merge(self, other: SpeculativeStats) -> None:
        """Add another run's counters to these."""
        for name in ("target_passes", "drafted", "accepted", "generated", "rejections"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine += [0] * (len(theirs) - len(mine))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_by_position(self) -> list[float]:
        """For each draft position, the share of the rounds that drafted a token there which
        accepted it (every earlier one was accepted too): how far into a draft the target agrees."""
        accepted = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        return [a / d for a, d in zip(accepted, self.drafted_at)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones. Not Leviathan et al.'s ``alpha``: tokens after
        a rejection are never judged, so this falls with ``k`` even when ``alpha`` does not."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> float:
        """Accepted tokens over judged ones (accepted plus one rejection per round that had
        one): the maximum-likelihood estimate of ``alpha`` for independent acceptances."""
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens produced per target forward pass; plain decoding has exactly 1."""
        return self.generated / self.target_passes if self.target_passes else 0.0


def draw(probs: torch.Tensor, u: float) -> int:
    """The token at ``u`` (in [0, 1)) of a (possibly unnormalised) probability row's CDF, in
    vocabulary order: a draw from the row, when ``u`` is uniform."""
    return int(invert_cdf(probs[None], torch.tensor([u], device=probs.device))[0])


@torch.no_grad()
def accept(
    target_logits: torch.Tensor, draft: Draft, params: SamplingParams, seed: int | None = None, position: int = 0
) -> tuple[int, int]:
    """Check ``draft`` against the target; returns ``(n_accepted, next_token)``.

    ``target_logits`` is ``[len(draft) + 1, vocab]``: row ``i`` is the target's prediction
    after the context plus the first ``i`` drafted tokens. The output of the step is
    ``draft.tokens[:n_accepted] + [next_token]``: the accepted prefix, then either the
    replacement for the first rejected token or, if none was rejected, a bonus token. Drafted
    token ``i`` is the sequence's token ``position + i``; sampled, each decision draws by
    ``seed`` at the position of the token it decides (None only for greedy params).
    """
    k = len(draft)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of target logits for {k} draft tokens, got {target_logits.shape[0]}")
    if params.greedy:
        return accept_greedy(target_logits.argmax(dim=-1).tolist(), draft.tokens)
    if seed is None:
        raise ValueError("a sampled acceptance test needs the request's seed")
    p = distribution(target_logits, params)
    for i, x in enumerate(draft.tokens):
        q_x = 1.0 if draft.probs is None else float(draft.probs[i, x])
        if uniform(seed, position + i, Stream.ACCEPT) * q_x < float(p[i, x]):  # u < p(x) / q(x), without dividing
            continue
        if draft.probs is None:
            residual = p[i].clone()
            residual[x] = 0.0  # max(0, p - onehot(x)): everything but x, in proportion
        else:
            residual = (p[i] - draft.probs[i]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is empty
            residual = p[i]
        return i, draw(residual, uniform(seed, position + i, Stream.RESIDUAL))
    return k, draw(p[k], uniform(seed, position + k, Stream.RESIDUAL))


def accept_greedy(best: list[int], drafted: list[int]) -> tuple[int, int]:
    """The greedy rule, given the target's choice ``best`` after the context and each drafted
    token (``len(drafted) + 1`` of them): accept while the draft agrees, then take the target's."""
    n = next((i for i, token in enumerate(drafted) if token != best[i]), len(drafted))
    return n, best[n]


def rollback(cache: ContiguousKVCache, length: int) -> None:
    """Forget every position from ``length`` on. The keys and values of rejected draft tokens
    stay in memory, but the next step writes over them: rollback is only a shorter length."""
    if not 0 <= length <= cache.length:
        raise ValueError(f"cannot roll a cache of {cache.length} positions back to {length}")
    cache.length = length


@torch.no_grad()
def verify_logits(target: GPT, cache: ContiguousKVCache, last_token: int, draft: Draft) -> torch.Tensor:
    """The target's logits at the last token and every draft token, ``[len(draft) + 1, vocab]``,
    in one forward that appends their keys and values (:func:`rollback` drops the rejected)."""
    device = target.device
    tokens = torch.tensor([[last_token, *draft.tokens]], device=device)
    positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=device)[None]
    return target(tokens, positions, cache)[0].float()


@dataclass
class SpeculativeOutput:
    """The new tokens (as :func:`~minillm.decoding.generate.generate_kv_cache` returns them) and the
    counters that say how the speculation went."""

    tokens: list[int]
    stats: SpeculativeStats


@torch.no_grad()
def generate_speculative(
    target: GPT,
    drafter,
    prompt: list[int],
    max_new_tokens: int,
    *,
    num_speculative_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | None = None,
    seed: int | None = None,
) -> SpeculativeOutput:
    """Continue ``prompt`` like :func:`minillm.decoding.generate.generate_kv_cache`, with speculation.

    ``drafter`` is a :class:`minillm.speedups.speculative.drafters.ModelDrafter` or :class:`~minillm.speedups.speculative.drafters.NgramDrafter`
    (anything with ``propose(tokens, k, params, seed) -> Draft``). The target's cache
    always holds every token but the last; each round drafts up to ``num_speculative_tokens``,
    runs the target once over the last token and the draft, keeps what :func:`accept` accepts
    and rolls the cache back past the rest. Greedy output equals the target's alone, token for
    token; sampled output has the target's distribution, and the same ``seed`` gives the same
    tokens.
    """
    check_prompt(target, prompt, max_new_tokens, slide=False)
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    params = SamplingParams(max_tokens=max(max_new_tokens, 1), temperature=temperature, top_k=top_k, seed=seed)
    seed = request_seed(params)  # one for the whole run, as the engine keeps one per request
    stats, tokens, new = SpeculativeStats(), list(prompt), []
    if max_new_tokens == 0:
        return SpeculativeOutput(new, stats)
    cache = ContiguousKVCache(target, 1, len(prompt) + max_new_tokens)
    if len(prompt) > 1:  # prefill all but the last token, which every round feeds first
        target.hidden_states(torch.tensor([prompt[:-1]], device=target.device), cache=cache)
    while len(new) < max_new_tokens:
        k = min(num_speculative_tokens, max_new_tokens - len(new) - 1)
        draft = drafter.propose(tokens, k, params, seed) if k > 0 else Draft()
        n, token = accept(verify_logits(target, cache, tokens[-1], draft), draft, params, seed, len(tokens))
        rollback(cache, len(tokens) + n)
        emitted = draft.tokens[:n] + [token]
        stats.record(len(draft), n, len(emitted))
        for t in emitted:
            new.append(t)
            tokens.append(t)
            if params.finish_reason(t, len(new), stop_token):
                return SpeculativeOutput(new, stats)
    return SpeculativeOutput(new, stats)
