"""The sampler: greedy is argmax, filters never leak, draws follow the softmax, and a seeded
request's tokens do not depend on its batch neighbours (each is a function of its seed and
position, drawn for the whole batch in one call)."""

from __future__ import annotations

import ast
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minillm.decoding import sampling
from minillm.decoding.draws import Stream, uniforms
from minillm.decoding.sampling import GREEDY_TEMPERATURE, SAMPLE_CHUNK_ROWS, SEED_MAX, SEED_MIN, SamplingParams, _filter, distribution, invert_cdf, request_seed, sample

VOCAB = 1000


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0,
          neighbour: SamplingParams | None = None) -> list[int]:
    """``n`` independent draws for one row, from one batch of ``n`` copies of it: ``seed``'s
    draws at positions 0 to ``n - 1``; with a ``neighbour``, the copies alternate with rows that
    sample under the neighbour's settings."""
    batch = [params] if neighbour is None else [params, neighbour]
    rows = len(batch) * n
    tokens = sample(logits_row.expand(rows, -1), batch * n, [seed] * rows, [i // len(batch) for i in range(rows)])
    return tokens[:: len(batch)].tolist()


def expected_distribution(logits: list[float], t: float, top_k: int | None, top_p: float) -> list[float]:
    """The distribution a sampler must follow, written out in plain Python: softmax at
    temperature ``t``, keep the ``top_k`` largest, renormalise, keep the nucleus, renormalise."""
    z = [math.exp(x / t) for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])[: top_k or len(z)]
    total = sum(z[i] for i in order)
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += z[i] / total
    kept_total = sum(z[i] for i in kept)
    return [z[i] / kept_total if i in kept else 0.0 for i in range(len(z))]


def plain_filtered(logits: torch.Tensor, t: float, top_k: int | None, top_p: float) -> tuple[torch.Tensor, bool]:
    """One row's filtered distribution in float64, step by step: softmax at temperature
    ``t``, a full stable sort (ties: lowest id first, as argmax breaks them), keep the first
    ``top_k``, renormalise, mask out every token whose mass before it already reaches
    ``top_p``, renormalise. Also says whether float32 rounding could decide a cut: ``top_p``
    within 1e-5 of a running sum, or two distinct but nearly equal probabilities either side
    of a cut; there only float64 knows the answer, so a comparison must skip the row."""
    probs = torch.softmax(logits.double() / t, dim=-1)
    ranked, order = probs.sort(descending=True, stable=True)
    vocab = len(probs)
    k = min(top_k or vocab, vocab)
    renormalised = ranked[:k] / ranked[:k].sum()
    mass_before = renormalised.cumsum(0) - renormalised
    keep = mass_before < top_p if top_p < 1 else torch.ones(k, dtype=torch.bool)
    fragile = top_p < 1 and bool(((mass_before[1:] - top_p).abs() <= 1e-5).any())
    for cut in {k, int(keep.sum())}:
        if cut < vocab:
            a, b = float(ranked[cut - 1]), float(ranked[cut])
            fragile |= a != b and a - b <= 1e-5 * a
    out = torch.zeros_like(probs)
    out[order[:k][keep]] = ranked[:k][keep] / ranked[:k][keep].sum()
    return out, fragile


# Probabilities 0.4, 0.3, 0.2, 0.06, 0.04, laid out out of order so that sorting matters.
CRAFTED_PROBS = [0.06, 0.3, 0.04, 0.4, 0.2]
CRAFTED = torch.tensor(CRAFTED_PROBS).log()
# The same five among 1,000 impossible tokens: big enough that the sampler ranks with topk.
SPREAD = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:5]
PADDED = torch.full((VOCAB,), float("-inf")).index_put((SPREAD,), CRAFTED)
# Half the mass on the five, half on a long tail of 5,000 distinct small probabilities: a
# nucleus that reaches into the tail holds thousands of tokens.
TAIL = torch.linspace(1.0, 2.0, 5000)
LONG_TAIL = torch.cat([torch.tensor(CRAFTED_PROBS) * 0.5, TAIL / TAIL.sum() * 0.5]).log()


def test_greedy_is_argmax_for_a_whole_batch():
    logits = torch.randn(128, VOCAB, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams(temperature=0)] * 128, [None] * 128, [0] * 128)
    assert tokens.dtype == torch.long and tokens.shape == (128,)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_keep_their_argmax_among_sampled_rows():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0)] * 3
    tokens = sample(logits, params, [request_seed(p) for p in params], [0] * len(params))
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(32)]
    tokens = sample(logits, params, [request_seed(p) for p in params], [0] * len(params))
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 100.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=temperature, top_p=1e-6, seed=i) for i in range(32)]
    tokens = sample(logits, params, [request_seed(p) for p in params], [0] * len(params))
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("top_k", [None, 2, 500])
def test_ties_are_broken_by_vocabulary_order_as_argmax_does(top_k):
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(9))
    logits[:, [900, 17, 300, 5]] = 10.0  # four tokens tie for the top
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=1e-6, seed=i) for i in range(16)]
    tokens = sample(logits, params, [request_seed(p) for p in params], [0] * len(params))
    assert tokens.tolist() == [5] * 16


def test_a_seeded_row_with_tied_logits_ignores_a_neighbour_that_widens_the_ranking():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).float()
    row[[900, 17, 300, 5]] = 3.0
    params = SamplingParams(temperature=1.0, top_k=8, seed=3)
    wide = SamplingParams(temperature=1.0, top_k=600, seed=4)
    runs = []
    for logits, batch in ((row[None], [params]), (torch.stack([row, row]), [wide, params])):
        seeds = [request_seed(p) for p in batch]
        runs.append([int(sample(logits, batch, seeds, [step] * len(batch))[-1]) for step in range(40)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 2


@pytest.mark.parametrize(("top_k", "top_p", "allowed"), [
    (3, 1.0, {3, 1, 4}),   # the three likeliest
    (None, 0.65, {3, 1}),  # 0.4 + 0.3 reaches 0.65
    (None, 0.75, {3, 1, 4}),  # 0.4 + 0.3 falls short of 0.75
    (3, 0.75, {3, 1}),     # top-p reads the renormalised top-3: 0.44 + 0.33 reaches 0.75
    (2, 0.9, {3, 1}),      # top-k cuts first
])
@pytest.mark.parametrize("padded", [False, True])
def test_filters_never_emit_a_token_outside_the_allowed_set(top_k, top_p, allowed, padded):
    logits, ids = (PADDED, SPREAD.tolist()) if padded else (CRAFTED, list(range(5)))
    # A neighbour with a wider top-k makes the batch rank more candidates than this row keeps.
    neighbour = SamplingParams(temperature=1.0, top_k=4, top_p=0.99)
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), 2000, neighbour=neighbour))
    assert seen == {ids[i] for i in allowed}  # nothing outside, and every allowed token turns up


@pytest.mark.parametrize("top_p", [0.6, 0.75, 0.95])
def test_a_nucleus_thousands_of_tokens_wide(top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    want = expected_distribution(LONG_TAIL.tolist(), 1.0, None, top_p)
    tokens = draws(LONG_TAIL, params, 1000, seed=8)
    assert all(want[t] > 0 for t in tokens)
    in_tail = sum(t >= 5 for t in tokens) / len(tokens)
    tail_mass = sum(want[5:])
    assert abs(in_tail - tail_mass) <= 4 * math.sqrt(tail_mass * (1 - tail_mass) / len(tokens)) + 1e-9


def test_tokens_with_minus_infinity_logits_are_never_drawn():
    logits = torch.full((VOCAB,), float("-inf"))
    logits[[7, 500, 999]] = torch.tensor([0.0, -20.0, 1.0])
    assert set(draws(logits, SamplingParams(temperature=1.0), 3000)) <= {7, 500, 999}


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, None, 1.0), (0.7, None, 1.0), (2.5, None, 1.0), (1.0, 4, 1.0), (0.8, None, 0.8), (1.3, 3, 0.9),
])
@pytest.mark.parametrize("logits", [CRAFTED, PADDED], ids=["small", "padded"])
def test_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p, logits):
    n = 10_000
    tokens = draws(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n, seed=4)
    want = expected_distribution(logits.tolist(), temperature, top_k, top_p)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(want)).tolist()
    for token, p in enumerate(want):
        freq = counts[token] / n
        assert abs(freq - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (token, freq, p)


NEIGHBOURS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=1.2, top_k=500, seed=11),  # makes the batch rank beyond 256
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.8, top_k=40, seed=1234),
    SamplingParams(temperature=1.5, top_p=0.9, seed=1234),
    SamplingParams(temperature=1.1, top_k=200, top_p=0.95, seed=1234),
])
def test_a_seeded_row_ignores_its_batch_neighbours(params):
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(VOCAB, generator=gen)
    others = torch.randn(len(NEIGHBOURS), VOCAB, generator=gen)
    batches = [
        (row[None], [params]),
        (torch.cat([others[:2], row[None], others[2:]]), NEIGHBOURS[:2] + [params] + NEIGHBOURS[2:]),
        (torch.cat([row[None], others[3:]]), [params] + NEIGHBOURS[3:]),
        (torch.cat([others[2:3], row[None]]), NEIGHBOURS[2:3] + [params]),
    ]
    sequences = []
    for logits, batch_params in batches:
        seeds = [request_seed(p) for p in batch_params]
        where = batch_params.index(params)
        sequences.append([int(sample(logits, batch_params, seeds, [step] * len(seeds))[where]) for step in range(40)])
    assert all(s == sequences[0] for s in sequences)
    assert len(set(sequences[0])) > 5  # really random, not stuck on one token


def random_filter_case(rng: random.Random) -> tuple[torch.Tensor, SamplingParams]:
    """A few rows of logits and settings that combine temperature, top-k and top-p, drawn to
    hit the corners: ties (half-precision or integer logits), masked tokens, top-k of 1, at
    or past the vocabulary, or past the sampler's ranking widths, tiny and large top-p."""
    vocab = rng.choice([2, 5, 17, 64, 300, 1000, 5000])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(rng.choice([1, 3]), vocab, generator=g) * rng.choice([0.5, 1.0, 2.0])
    kind = rng.choice(["normal", "bf16", "integers", "masked"])
    if kind == "bf16":
        logits = logits.to(torch.bfloat16).float()
    elif kind == "integers":
        logits = torch.randint(-3, 4, logits.shape, generator=g).float()
    elif kind == "masked":
        logits[torch.rand(logits.shape, generator=g) < 0.7] = float("-inf")
        logits[:, rng.randrange(vocab)] = 0.0
    top_k = rng.choice([None, 1, 2, rng.randint(1, vocab), max(vocab - 1, 1), vocab, vocab + 3, 250, 256, 600, 4096])
    top_p = rng.choice([1.0, 1.0, 0.5, 0.9, 0.99, 1e-6, max(rng.random(), 1e-3)])
    return logits, SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5, 3.0]), top_k=top_k, top_p=top_p)


def test_distribution_matches_a_plain_reference_for_combined_filters() -> None:
    """Speculative decoding accepts and resamples by ``distribution``, so it must be exactly
    the sampler's filter: top-p measured on the renormalised top-k, ties cut in vocabulary
    order. Random rows, checked against :func:`plain_filtered`; the sampler's own draws on
    the same rows must land inside the reference's support."""
    rng, compared, total = random.Random(2024), 0, 0
    for case in range(150):
        logits, params = random_filter_case(rng)
        total += len(logits)
        got = distribution(logits, params).double()
        refs = [plain_filtered(row, params.temperature, params.top_k, params.top_p) for row in logits]
        for row, (want, fragile) in enumerate(refs):
            if fragile:
                continue
            compared += 1
            assert torch.equal(got[row] > 0, want > 0), (case, row, params)
            assert torch.allclose(got[row], want, rtol=1e-4, atol=1e-7), (case, row, params)
        rows = 4 * len(logits)
        tokens = sample(logits.repeat(4, 1), [params] * rows, [case] * rows, list(range(rows))).view(4, -1)
        for row, (want, fragile) in enumerate(refs):
            assert fragile or bool((want[tokens[:, row]] > 0).all()), (case, row, params)
    assert compared >= 0.9 * total  # the fragile rows skipped are few


EVEN = [0.0] * 8  # eight tokens of probability exactly 1/8: every running sum is exact
FOUR_TIED = [0.0 if i in (9, 2, 7, 4) else float("-inf") for i in range(10)]  # four of 1/4
TIED_AT_K = [3.0 if i in (900, 17, 300, 5) else 0.0 for i in range(VOCAB)]  # four tied on top, 996 below


@pytest.mark.parametrize(("logits", "top_k", "top_p", "kept"), [
    (EVEN, 4, 0.5, [0, 1]),           # top-k keeps 1/2; p=0.5 of that is reached after two tokens exactly
    (EVEN, None, 0.5, [0, 1, 2, 3]),  # reached exactly after four: the fifth's mass before is not short of p
    (EVEN, 8, 0.25, [0, 1]),          # top_k == vocab cuts nothing
    (EVEN, 20, 0.125, [0]),           # top_k past the vocab; p is one token's mass exactly
    (EVEN, 1, 1.0, [0]),              # top_k=1 among ties: the lowest id, as argmax
    (EVEN, 3, 0.9, [0, 1, 2]),        # 2/3 of the top three is short of 0.9
    (FOUR_TIED, 2, 0.5, [2]),         # renormalised 1/2 each: the first reaches p
    (FOUR_TIED, 3, 1.0, [2, 4, 7]),
    (FOUR_TIED, None, 0.5, [2, 4]),
    (TIED_AT_K, 6, 1.0, [0, 1, 5, 17, 300, 900]),  # the cut falls inside a 996-token tie
    (TIED_AT_K, 6, 0.999, [0, 1, 5, 17, 300, 900]),
])
def test_exact_boundaries_and_ties_in_distribution_and_sampler(
    logits: list[float], top_k: int | None, top_p: float, kept: list[int]
) -> None:
    """Cuts that land exactly on a running sum or inside a tie, where float rounding cannot
    blur the answer: the documented rule decides (a token stays while the renormalised mass
    before it is short of ``top_p``; ties go in vocabulary order)."""
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    got = distribution(torch.tensor([logits]), params)[0]
    want, _ = plain_filtered(torch.tensor(logits), 1.0, top_k, top_p)
    assert got.nonzero().flatten().tolist() == kept
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-8)
    assert set(draws(torch.tensor(logits), params, 1000, seed=13)) == set(kept)


def tie_heavy_row() -> torch.Tensor:
    """Logits over 6,000 tokens whose ranks 100..399 are one tie (as half-precision logits
    tie): the tie straddles the sampler's first ranking width (256), so a row whose top-k or
    nucleus ends inside it is ranked right only if the sampler sees the whole tie."""
    g = torch.Generator().manual_seed(12)
    row = torch.randn(6000, generator=g).clamp(max=3.0).to(torch.bfloat16).float()  # ties in the tail too
    ids = torch.randperm(6000, generator=g)
    row[ids[:100]] = torch.linspace(3.6, 5.0, 100)
    row[ids[100:400]] = 3.5
    return row


def mass_of_the_first(row: torch.Tensor, ranks: float) -> float:
    """The softmax mass of the ``ranks`` likeliest tokens (interpolating a fraction), which
    no tie order changes: a top-p that makes the nucleus end at a chosen rank."""
    probs = torch.softmax(row.double(), dim=-1).sort(descending=True).values
    whole = int(ranks)
    return float(probs[:whole].sum() + (ranks - whole) * probs[whole])


TIE_ROW = tie_heavy_row()
WIDE_NEIGHBOURS = {
    "greedy": SamplingParams(temperature=0),
    "plain": SamplingParams(temperature=0.7),
    "small": SamplingParams(temperature=1.5, top_k=5, top_p=0.5),
    "past_256": SamplingParams(temperature=1.0, top_k=300),  # a batch-wide top-k would cut the tie at 300
    "wide": SamplingParams(temperature=1.0, top_k=600),     # the batch ranks 4,096
    "widest": SamplingParams(temperature=0.8, top_k=5500),  # the batch sorts everything
    "long_nucleus": SamplingParams(temperature=1.0, top_p=0.999),  # so does a nucleus into the tail
}


SEEDED_WIDTHS = [replace(params, seed=seed) for seed in (0, 1) for params in [
    SamplingParams(temperature=1.0, top_k=250),  # ends inside the tie; alone: width 256
    SamplingParams(temperature=0.9, top_k=250, top_p=0.98),
    SamplingParams(temperature=1.0, top_p=mass_of_the_first(TIE_ROW, 230.5)),  # nucleus ends inside the tie
    SamplingParams(temperature=1.2, top_k=1000),  # alone: width 4,096
]]


def test_seeded_rows_ignore_neighbours_that_change_the_ranking_width() -> None:
    """The sampler ranks only as many candidates as the batch's filters can reach, so a
    neighbour with a larger top-k or a long nucleus widens the ranking for everyone. Seeded
    rows must not notice: each draws the same sequence alone as batched with the others,
    between greedy, plain, narrow and wide neighbours, or beside top-k rows only (which a
    shortcut for large top-k might treat differently)."""
    steps = 15
    alone = []
    for params in SEEDED_WIDTHS:
        alone.append([int(sample(TIE_ROW[None], [params], [params.seed], [step])[0]) for step in range(steps)])
    alone = torch.tensor(alone).T  # [step, seeded row]
    others = torch.randn(len(WIDE_NEIGHBOURS), 6000, generator=torch.Generator().manual_seed(14))
    neighbour_row = dict(zip(WIDE_NEIGHBOURS, others))
    every = list(range(len(SEEDED_WIDTHS)))
    top_k_only = [i for i, p in enumerate(SEEDED_WIDTHS) if p.top_k]
    inside_the_tie = [i for i, p in enumerate(SEEDED_WIDTHS) if p.top_k == 250]
    for names, chosen in [(["greedy", "plain"], every), (["wide", "small"], every), (["widest"], every),
                          (["long_nucleus", "small", "greedy"], every), (["past_256"], inside_the_tie), (["wide"], top_k_only)]:
        before, after = names[: len(names) // 2], names[len(names) // 2 :]
        batch = [WIDE_NEIGHBOURS[n] for n in before] + [SEEDED_WIDTHS[i] for i in chosen] + [WIDE_NEIGHBOURS[n] for n in after]
        rows = [neighbour_row[n] for n in before] + [TIE_ROW] * len(chosen) + [neighbour_row[n] for n in after]
        seeds = [request_seed(p) for p in batch]
        ours = slice(len(before), len(before) + len(chosen))
        batched = torch.stack([sample(torch.stack(rows), batch, seeds, [step] * len(batch))[ours] for step in range(steps)])
        assert torch.equal(batched, alone[:, chosen]), (names, (batched != alone[:, chosen]).nonzero().tolist())
    assert len(set(alone.flatten().tolist())) > 20
    assert int((TIE_ROW[alone[:, inside_the_tie]] == 3.5).sum()) >= 3  # the draws that matter happen


def test_different_seeds_give_different_tokens():
    row = torch.zeros(1, VOCAB)
    runs = []
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed)
        runs.append([int(sample(row, [params], [seed], [step])) for step in range(20)])
    assert runs[0] != runs[1]


def test_request_seeds_greedy_none_seeded_its_own_unseeded_from_the_global_rng():
    assert request_seed(SamplingParams(temperature=0)) is None
    assert request_seed(SamplingParams(temperature=2.0, top_k=1, seed=3)) is None  # greedy never draws
    assert request_seed(SamplingParams(seed=9)) == 9
    torch.manual_seed(0)
    first = [request_seed(SamplingParams()) for _ in range(2)]
    torch.manual_seed(0)
    again = [request_seed(SamplingParams()) for _ in range(2)]
    assert first == again and first[0] != first[1]  # reproducible, and each request its own


def test_one_row_and_low_precision_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0)
    token = int(sample(logits, [params], [params.seed], [0])[0])
    assert token in set(torch.topk(logits[0].float(), 20).indices.tolist())
    assert int(sample(logits, [SamplingParams(temperature=0)], [None], [0])[0]) == int(logits.argmax())


def test_mismatched_lengths_and_a_sampled_row_without_a_seed_are_refused():
    with pytest.raises(ValueError, match="2 rows"):
        sample(torch.zeros(2, VOCAB), [SamplingParams()], [None], [0])
    with pytest.raises(ValueError, match=r"rows \[1\] have none"):
        sample(torch.zeros(2, VOCAB), [SamplingParams(seed=1), SamplingParams()], [1, None], [0, 0])


def test_a_target_rounded_up_to_the_total_still_lands_on_a_possible_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]])
    assert int(invert_cdf(probs, torch.tensor([1.0]))) == 2
    assert int(invert_cdf(probs, torch.tensor([0.0]))) == 1


def test_top_p_one_keeps_a_tail_that_rounding_pushed_past_the_total():
    probs = torch.tensor([[1.0, 1e-9, 1e-9]])  # in float32 the running sum is 1 after one token
    assert torch.equal(_filter(probs, torch.tensor([[2]]), torch.tensor([[1.0]]), vocab=3), probs * torch.tensor([1, 1, 0]))


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_k", -1), ("top_k", 1.5),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("ignore_eos", 1), ("seed", 1.0), ("seed", "7"),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("frequency_penalty", float("inf")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("logit_bias", {3: 101}), ("logit_bias", {-1: 1}),
    ("logit_bias", {"3": 1}), ("min_tokens", 17), ("min_tokens", -1), ("logprobs", 21), ("logprobs", True),
    ("prompt_logprobs", -1), ("json_schema", "not an object"),
])
def test_bad_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_good_fields_are_normalised():
    params = SamplingParams(stop="\n", top_k=0, stop_token_ids=None)
    assert params.stop == ["\n"] and params.top_k is None and params.stop_token_ids == []
    assert not params.adjusts and not params.token_by_token
    assert SamplingParams(logit_bias={3: 0, 4: -100}).logit_bias == {4: -100.0}  # a zero bias is no bias


def test_max_tokens_zero_only_scores_a_prompt():
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0, logprobs=1)


def test_a_seed_outside_64_bits_is_refused_when_the_params_are_made() -> None:
    """Draws are keyed by int64 tensors of seeds: past the signed 64-bit range the engine step
    itself would raise, failing every request in the batch, so the params refuse it where they
    are built. Both ends of the range draw."""
    for edge in (SEED_MIN, SEED_MAX):
        params = SamplingParams(temperature=1.0, seed=edge)
        assert request_seed(params) == edge
        assert 0 <= int(sample(torch.zeros(1, VOCAB), [params], [edge], [SEED_MAX])[0]) < VOCAB
    for bad in (SEED_MIN - 1, SEED_MAX + 1, 10**30):
        with pytest.raises(ValueError, match="^seed must be an integer in"):
            SamplingParams(temperature=1.0, seed=bad)
        with pytest.raises(ValueError, match="^seed must be an integer in"):
            SamplingParams(temperature=1.0, seed=0).with_seed(bad)


def test_a_choices_seed_is_set_without_checking_the_rest_again(monkeypatch) -> None:
    """A request's ``n`` choices share its settings, checked once when they were made."""
    params = SamplingParams(temperature=1.0, seed=7, stop=["\n"], logit_bias={3: 1.0})
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: pytest.fail("checked again"))
    choice = params.with_seed(8)
    assert vars(choice) == {**vars(params), "seed": 8} and params.seed == 7


def test_the_sampler_never_imports_the_grammar_machinery() -> None:
    """Chapter 5's naive loop samples with this module; chapter 10's grammars (llguidance, a
    torch table) must not come with it, at import or from inside any of its functions."""
    probe = "import sys, minillm.decoding.sampling; print([m for m in sys.modules if m.startswith(('minillm', 'llguidance'))])"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    assert "minillm.decoding.sampling" in loaded and not {"minillm.decoding.structured", "llguidance"} & loaded
    tree = ast.parse(Path(sampling.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert "torch" in imported and not [m for m in imported if m and "structured" in m]


def test_a_batch_larger_than_a_chunk_draws_each_row_as_if_alone() -> None:
    """Sampled rows go through the filters ``SAMPLE_CHUNK_ROWS`` at a time, to bound the
    sort's memory; every row of a batch spanning several chunks, whatever its settings and
    wherever it falls, must draw what it draws on its own."""
    rng = random.Random(3)
    settings = [SamplingParams(temperature=0), SamplingParams(temperature=0.9), SamplingParams(top_k=50),
                SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(top_k=VOCAB, top_p=0.999)]
    rows = 3 * SAMPLE_CHUNK_ROWS + 7
    params = [replace(rng.choice(settings), seed=i) for i in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    logits[rows - 1] = logits[rows - 1].round()  # ties at the cut, in the last, partial chunk
    together = sample(logits, params, [request_seed(p) for p in params], [5] * rows).tolist()
    alone = [int(sample(logits[i:i + 1], [p], [request_seed(p)], [5])[0]) for i, p in enumerate(params)]
    assert together == alone
    assert len(set(together)) > rows // 2  # distinct rows, distinct draws: nothing collapsed onto one index


@pytest.mark.parametrize("temperature", [1e-50, 1e-38, math.nextafter(GREEDY_TEMPERATURE, 0)])
def test_a_temperature_too_small_for_float32_is_greedy_not_nan(temperature: float) -> None:
    """logits / 1e-50 is infinite in float32 and its softmax NaN, which drew token 0 for ever:
    below GREEDY_TEMPERATURE a request is greedy, as in vLLM."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=temperature, seed=1)] * 3
    assert all(p.greedy for p in params)
    assert sample(logits, params, [request_seed(p) for p in params], [0] * 3).tolist() == logits.argmax(-1).tolist()


def test_the_smallest_sampled_temperature_still_gives_a_proper_distribution() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 30
    params = SamplingParams(temperature=GREEDY_TEMPERATURE, seed=1)
    assert not params.greedy
    probs = distribution(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert sample(logits, [params] * 2, [1, 1], [0, 1]).tolist() == logits.argmax(-1).tolist()


def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    """A top_k of 2**63 - 1 is valid and means "all": the sampler clamps it to the vocabulary
    (a tensor of it overflowed inside the engine step before)."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    huge, every = SamplingParams(top_k=SEED_MAX, seed=4), SamplingParams(top_k=VOCAB, seed=4)
    assert torch.equal(distribution(logits, huge), distribution(logits, every))
    drawn = [sample(logits, [p] * 2, [4, 4], [0, 1]).tolist() for p in (huge, every)]
    assert drawn[0] == drawn[1]


def test_every_sampled_row_draws_its_number_in_one_batched_call(monkeypatch) -> None:
    """No call per row: the uniform numbers of a batch's sampled rows, filtering or not, across
    several chunks, come from one call of the counter-based draw, given every row's seed and
    position; greedy rows ask for none, and a greedy batch makes no call at all."""
    calls = []

    def counted(seeds, counters, stream, device=None):
        calls.append((list(seeds), list(counters), stream))
        return uniforms(seeds, counters, stream, device)

    monkeypatch.setattr(sampling, "uniforms", counted)
    rows = 3 * SAMPLE_CHUNK_ROWS + 7
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.9), SamplingParams(top_k=50)]
    params = [kinds[i % 3] if i % 3 == 0 else replace(kinds[i % 3], seed=100 + i) for i in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1))
    sample(logits, params, [request_seed(p) for p in params], list(range(rows)))
    assert len(calls) == 1
    seeds, counters, stream = calls[0]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert sorted(counters) == sampled and sorted(seeds) == [100 + i for i in sampled]
    assert stream == Stream.SAMPLE
    sample(logits, [kinds[0]] * rows, [None] * rows, [0] * rows)
    assert len(calls) == 1


def test_a_seeded_rows_token_is_its_positions_draw_whatever_came_before() -> None:
    """No state advances between calls: a row's token at a position is the same asked first,
    last, or after other positions, and the draws move with the position."""
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=21)
    forward = [int(sample(row, [params], [21], [p])[0]) for p in range(30)]
    backward = [int(sample(row, [params], [21], [p])[0]) for p in reversed(range(30))]
    assert forward == backward[::-1] and len(set(forward)) > 10
