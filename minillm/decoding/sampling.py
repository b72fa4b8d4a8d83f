"""How a request wants its tokens chosen, and the sampler that chooses them.

:class:`SamplingParams` fields mean what they mean in OpenAI's API and vLLM, so the server
passes a request's JSON straight through; a bad value raises ``ValueError`` naming the field
(an HTTP 400). :func:`sample` draws each row's uniform number from its request's seed and the
position being drawn (:mod:`minillm.decoding.draws`), so a seeded request gives the same tokens
whatever else shares its batch, and whatever came before.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any

import torch

from minillm.decoding.draws import Stream, uniforms

# A seed keys 64-bit draws (minillm.decoding.draws); like vLLM, take the signed range (so -1
# and 2**64 - 1, the same 64 bits, cannot both be asked for, and nothing wider reaches a tensor).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Below this temperature a request is greedy, as in vLLM. Dividing logits by a temperature
# that float32 cannot hold (under about 1e-38) makes them infinite and the softmax NaN, and
# long before that the distribution is argmax to every digit float32 keeps.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's ranges: penalties in -2..2, a logit bias in -100..100 (-100 bans a token, 100 all but
# forces it), and up to 20 alternatives per position (the chat endpoint's top_logprobs).
MAX_PENALTY, MAX_LOGIT_BIAS, MAX_LOGPROBS = 2.0, 100.0, 20


class FinishReason(str, Enum):
    """Why generation ended, with the strings OpenAI's API uses for ``finish_reason``."""

    STOP = "stop"  # the end-of-text token, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens generated, or the model's context is full
    ABORT = "abort"  # the client went away or cancelled


@dataclass
class SamplingParams:
    """One request's decoding settings, with OpenAI's and vLLM's meanings.

    ``temperature`` 0 is greedy; ``top_k`` None or 0 keeps every token; ``stop`` strings end
    the text before them, ``stop_token_ids`` end it after them; ``ignore_eos`` runs past the
    end-of-text token (load tests fix lengths with it); ``seed`` makes the request's draws
    reproducible, each a function of the seed and the token's position. The penalties,
    ``logit_bias`` and ``min_tokens`` adjust the logits before temperature and the filters
    (:mod:`minillm.decoding.penalties`). ``logprobs`` and ``prompt_logprobs`` report the raw
    logits' view, as vLLM does (:mod:`minillm.decoding.logprobs`); with ``prompt_logprobs``,
    ``max_tokens`` may be 0 (score the prompt only). ``json_schema`` masks every step to
    tokens that can still lead to an instance (:mod:`minillm.decoding.structured`); only its
    type is checked here, the schema where it is compiled, so chapter 5's naive loop never
    loads the grammar machinery.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = None
        self.logit_bias = dict(self.logit_bias or {})
        least_tokens = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only
        problems = [
            (not _is_int(self.max_tokens) or self.max_tokens < least_tokens,
             f"max_tokens must be an integer >= {least_tokens}, got {self.max_tokens!r}"),
            (not _is_finite(self.temperature) or self.temperature < 0, f"temperature must be a finite number >= 0, got {_brief(self.temperature)}"),
            (self.top_k is not None and (not _is_int(self.top_k) or not 1 <= self.top_k <= SEED_MAX),
             f"top_k must be an integer in 1..{SEED_MAX} (or 0/None for all), got {_brief(self.top_k)}"),
            (not _is_finite(self.top_p) or not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (not all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (not all(_is_int(t) and t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}"),
            (not isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
            *((not _is_finite(v) or abs(v) > MAX_PENALTY, f"{name} must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got {_brief(v)}")
              for name, v in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty))),
            (not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0,
             f"repetition_penalty must be a number > 0 (1 is off), got {_brief(self.repetition_penalty)}"),
            (not all(_is_int(t) and t >= 0 and _is_finite(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()),
             f"logit_bias must map token ids (integers >= 0) to numbers in -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}, "
             f"got {_brief(self.logit_bias)}"),
            (not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens if _is_int(self.max_tokens) else 0),
             f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens!r}), got {_brief(self.min_tokens)}"),
            *((v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS), f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {_brief(v)}")
              for name, v in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))),
            (self.json_schema is not None and not isinstance(self.json_schema, dict),
             f"json_schema must be a JSON Schema object, got {_brief(self.json_schema)}"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(message)
        _check_seed(self.seed)
        self.temperature = float(self.temperature)
        self.logit_bias = {t: float(b) for t, b in self.logit_bias.items() if b != 0}

    def with_seed(self, seed: int) -> SamplingParams:
        """These settings drawing from ``seed``: one of a request's ``n`` choices. Only the seed
        is checked; ``dataclasses.replace`` would run every check again, once per choice."""
        _check_seed(seed)
        choice = copy.copy(self)
        choice.seed = seed
        return choice

    @cached_property
    def greedy(self) -> bool:
        """True when the choice is always the most likely token: temperature 0, or top-k 1
        (one candidate left, whatever the temperature), so no random draw is needed."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def filters(self) -> bool:
        """True when top-k or top-p narrows the candidates, so the sampler must rank them."""
        return self.top_k is not None or self.top_p < 1

    @cached_property
    def adjusts(self) -> bool:
        """True when a penalty, a bias or ``min_tokens`` changes the logits before sampling;
        the sampler skips that work for every other row."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    @cached_property
    def token_by_token(self) -> bool:
        """True when every position needs its own adjusted, reported or masked logits, which
        speculative decoding's one-pass verification does not give: one token per step."""
        return self.adjusts or self.logprobs is not None or self.json_schema is not None

    def stops_on(self, token: int, eos_token_id: int | None = None) -> bool:
        """True if ``token`` ends the request by being what it is: the end-of-text token
        (unless ``ignore_eos``) or one of ``stop_token_ids``. Such a token is not text."""
        return (token == eos_token_id and not self.ignore_eos) or token in self.stop_token_ids

    def finish_reason(self, token: int, num_generated: int, eos_token_id: int | None = None,
                      context_full: bool = False) -> FinishReason | None:
        """The stop rule of every loop that generates, from chapter 5's to the engine's: why
        ``token``, the ``num_generated``-th new token, ends the request, or None. A stop wins
        over a length limit, as in vLLM and OpenAI. Stop strings and schemas end a request by
        its text, which only the engine sees: it checks them besides."""
        if self.stops_on(token, eos_token_id):
            return FinishReason.STOP
        if num_generated >= self.max_tokens or context_full:
            return FinishReason.LENGTH
        return None


def _check_seed(seed: object) -> None:
    """A seed's one check, for the params and for each choice's copy (:meth:`SamplingParams.with_seed`)."""
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):  # type: ignore[operator]
        raise ValueError(f"seed must be an integer in {SEED_MIN}..{SEED_MAX}, got {_brief(seed)}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    """A number a float holds: not NaN or infinite, and not an integer too large to convert."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))
    except OverflowError:
        return False


def _brief(x: object) -> str:
    """``repr(x)``, cut short: an error message must not echo a thousand-digit number back."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:37]}..."


def request_seed(params: SamplingParams) -> int | None:
    """The seed a request's draws are keyed by for its whole life (None for greedy ones, which
    never draw): its own, or for an unseeded request one drawn from torch's global generator,
    so runs are random, yet reproducible after ``torch.manual_seed``."""
    if params.greedy:
        return None
    return params.seed if params.seed is not None else int(torch.randint(2**62, (1,)))


# Sampled rows go through the filters this many at a time. A row that sorts its whole
# vocabulary holds about 40 bytes per token in temporaries: 480 MiB for 256 rows of GPT-2's
# vocabulary, 60 MiB for 32. Chunks change no token, and on a CPU they are faster too (256
# rows took 223 ms in one piece, 83 ms in chunks of 32).
SAMPLE_CHUNK_ROWS = 32


# A CPU's argmax over the vocabulary reads a row at a fraction of the speed of its max (which
# is vectorised): 65 µs for GPT-2's 50,257 logits, 2 ms for 32 rows, on one core of a Xeon.
# So find each row's largest block of ARGMAX_BLOCK logits by their maxima, then the argmax
# inside that block alone: 41 µs and 0.31 ms. A small vocabulary (under 8 blocks) gains nothing.
ARGMAX_BLOCK = 256


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of ``logits`` ``[n, vocab]``, exactly ``logits.argmax(-1)`` (the first
    of tied maxima, the first NaN if any), read block by block on a CPU (:data:`ARGMAX_BLOCK`)."""
    n, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 8 * ARGMAX_BLOCK or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    body = vocab - vocab % ARGMAX_BLOCK
    blocks = logits[:, :body].view(n, body // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding the row's maximum (or NaN)
    index = best * ARGMAX_BLOCK + blocks[torch.arange(n), best].argmax(dim=-1)
    if body == vocab:
        return index
    tail = logits[:, body:]
    tail_index = tail.argmax(dim=-1)
    tail_max, body_max = tail.gather(1, tail_index[:, None])[:, 0], logits.gather(1, index[:, None])[:, 0]
    later_wins = (tail_max > body_max) | (tail_max.isnan() & ~body_max.isnan())
    return torch.where(later_wins, tail_index + body, index)


@torch.no_grad()
def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], positions: list[int]
) -> torch.Tensor:
    """One token per row of ``logits`` ``[n, vocab]``, row ``i`` by ``params[i]``, drawn by
    ``seeds[i]`` (:func:`request_seed`; None only for greedy rows) at ``positions[i]``, the
    index the token will have in its sequence. Greedy rows cost one batched ``argmax``; only
    sampled rows go through temperature, top-k, top-p and a draw, and their uniform numbers
    come from one batched call (:func:`~minillm.decoding.draws.uniforms`)."""
    if not len(params) == len(seeds) == len(positions) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params, {len(seeds)} seeds, "
                         f"{len(positions)} positions")
    tokens = argmax_rows(logits)
    # Sampled rows that filter (top-k or top-p) go apart from those that don't: a draw inverts
    # the CDF in the order the candidates are laid out (vocabulary order, or largest first when
    # filtering), so that order depends on a row's own settings only, and a seeded row's
    # uniform number always lands on the same token.
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    if any(seeds[i] is None for i in sampled):
        raise ValueError(f"sampled rows need a seed: rows {[i for i in sampled if seeds[i] is None]} have none")
    groups = [i for i in sampled if not params[i].filters], [i for i in sampled if params[i].filters]
    in_order = groups[0] + groups[1]
    u = uniforms([seeds[i] for i in in_order], [positions[i] for i in in_order], Stream.SAMPLE, logits.device)
    done = 0
    for group in groups:
        for start in range(0, len(group), SAMPLE_CHUNK_ROWS):
            rows = group[start:start + SAMPLE_CHUNK_ROWS]
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = _sample_rows(logits[index].float(), [params[i] for i in rows], u[done:done + len(rows)])
            done += len(rows)
    return tokens


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from, as float32 probabilities ``[n, vocab]``.
    Speculative decoding's acceptance rule (chapter 15) needs it whole, and it must be the
    sampler's own, or speculation would change what a request's settings mean."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if not params.filters:
        return probs
    ranked, order = _ranked_and_filtered(probs, [params] * probs.shape[0])  # the sampler's own ranking
    kept = torch.zeros_like(probs).scatter_(-1, order, ranked)
    return kept / kept.sum(dim=-1, keepdim=True)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then one draw per row by inverting its CDF at ``u``.

    ``logits`` holds rows that all filter or none that do (see :func:`sample`).
    """
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    order = None
    if params[0].filters:
        probs, order = _ranked_and_filtered(probs, params)
    picked = invert_cdf(probs, u)
    return picked if order is None else order.gather(1, picked[:, None])[:, 0]


def _ranked_and_filtered(probs: torch.Tensor,
                         params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities largest first, zero outside its top-k and nucleus, with their token ids."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=probs.device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
    ranked, order = _largest_first(probs, top_k, top_p)
    return _filter(ranked, top_k, top_p, vocab), order


def _largest_first(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' probabilities, largest first, with their token ids, as far as the filters
    can reach.

    Sorting all 50,257 costs milliseconds a row on a CPU, while a nucleus rarely holds more
    than a few hundred tokens: so take the largest 256, then 4,096, and sort everything only
    when some row reaches further. A width serves only if each row's last candidate is
    strictly likelier than the smallest value taken (or 0): ``topk`` keeps an arbitrary few of
    the tokens tied at its cut, which would differ from the stable full sort's.
    """
    vocab, width = probs.shape[-1], 256
    while width < vocab:
        values, order = torch.topk(probs, width, dim=-1)  # values in order; tied ids in any
        nucleus = ((values.cumsum(dim=-1) - values) < top_p).sum(dim=-1, keepdim=True)
        reach = torch.where(top_k < vocab, top_k, torch.where(top_p < 1, nucleus, vocab))
        reach = reach.expand(values.shape[0], 1)
        last = values.gather(1, reach.clamp(max=width) - 1)
        if bool(((reach <= width) & ((last > values[:, -1:]) | (last == 0))).all()):
            return _ties_in_vocabulary_order(values, order)
        width *= 16
    return torch.sort(probs, dim=-1, descending=True, stable=True)


def _ties_in_vocabulary_order(values: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put tied candidates from ``topk`` back in vocabulary order, as the stable full sort
    leaves them, so a seeded row keeps its token when a neighbour widens the ranking."""
    order, by_id = order.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, order.gather(1, by_value)


def _filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Zero every probability (sorted largest first) outside each row's top-k, then outside
    its nucleus: the smallest set whose mass reaches ``top_p`` of what top-k kept. Rows with
    ``top_p == 1`` skip the test, lest rounding in the running sum cut the far tail."""
    rank = torch.arange(probs.shape[-1], device=probs.device)
    probs = probs * (rank < top_k)
    kept_by_top_k = torch.where(top_k < vocab, probs.sum(dim=-1, keepdim=True), 1.0)
    mass_before = probs.cumsum(dim=-1) - probs
    return probs * ((mass_before < top_p * kept_by_top_k) | (top_p >= 1))


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column ``j`` of each row with ``cdf[j-1] <= u * total < cdf[j]``: a draw from the row's
    (unnormalised) distribution, so only a column with positive probability can be picked.
    Should rounding ever put the target at the total, the clamp picks the last such column
    (the first where the CDF reaches its total)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)[:, 0]
    last_positive = (cdf < total).sum(dim=-1)
    return torch.minimum(picked, last_positive)
