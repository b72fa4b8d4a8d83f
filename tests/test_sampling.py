"""The sampler: greedy is argmax, filters never leak, draws follow the softmax, and a seeded
request's tokens do not depend on its batch neighbours."""

from __future__ import annotations

import math

import pytest
import torch

from minillm.sampling import SamplingParams, _filter, _invert_cdf, make_generator, sample

VOCAB = 1000


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0,
          neighbour: SamplingParams | None = None) -> list[int]:
    """``n`` independent draws for one row, from one batch of ``n`` copies of it (the same
    draws for the same ``seed``); with a ``neighbour``, the copies alternate with rows that
    sample under the neighbour's settings."""
    torch.manual_seed(seed)
    batch = [params] if neighbour is None else [params, neighbour]
    tokens = sample(logits_row.expand(len(batch) * n, -1), batch * n, [None] * (len(batch) * n))
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
    tokens = sample(logits, [SamplingParams(temperature=0)] * 128, [None] * 128)
    assert tokens.dtype == torch.long and tokens.shape == (128,)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_keep_their_argmax_among_sampled_rows():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0)] * 3
    tokens = sample(logits, params, [make_generator(p, "cpu") for p in params])
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(32)]
    tokens = sample(logits, params, [make_generator(p, "cpu") for p in params])
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 100.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=temperature, top_p=1e-6, seed=i) for i in range(32)]
    tokens = sample(logits, params, [make_generator(p, "cpu") for p in params])
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("top_k", [None, 2, 500])
def test_ties_are_broken_by_vocabulary_order_as_argmax_does(top_k):
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(9))
    logits[:, [900, 17, 300, 5]] = 10.0  # four tokens tie for the top
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=1e-6, seed=i) for i in range(16)]
    tokens = sample(logits, params, [make_generator(p, "cpu") for p in params])
    assert tokens.tolist() == [5] * 16


def test_a_seeded_row_with_tied_logits_ignores_a_neighbour_that_widens_the_ranking():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).float()
    row[[900, 17, 300, 5]] = 3.0
    params = SamplingParams(temperature=1.0, top_k=8, seed=3)
    wide = SamplingParams(temperature=1.0, top_k=600, seed=4)
    runs = []
    for logits, batch in ((row[None], [params]), (torch.stack([row, row]), [wide, params])):
        generators = [make_generator(p, "cpu") for p in batch]
        runs.append([int(sample(logits, batch, generators)[-1]) for _ in range(40)])
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
        generators = [make_generator(p, "cpu") for p in batch_params]
        where = batch_params.index(params)
        sequences.append([int(sample(logits, batch_params, generators)[where]) for _ in range(40)])
    assert all(s == sequences[0] for s in sequences)
    assert len(set(sequences[0])) > 5  # really random, not stuck on one token


def test_different_seeds_give_different_tokens():
    row = torch.zeros(1, VOCAB)
    runs = []
    for seed in (1, 2):
        params = SamplingParams(temperature=1.0, seed=seed)
        generator = make_generator(params, "cpu")
        runs.append([int(sample(row, [params], [generator])) for _ in range(20)])
    assert runs[0] != runs[1]


def test_generators_greedy_none_seeded_fixed_unseeded_from_the_global_rng():
    assert make_generator(SamplingParams(temperature=0), "cpu") is None
    assert make_generator(SamplingParams(temperature=2.0, top_k=1), "cpu") is None
    seeded = [make_generator(SamplingParams(seed=9), "cpu") for _ in range(2)]
    assert torch.equal(torch.rand(4, generator=seeded[0]), torch.rand(4, generator=seeded[1]))
    torch.manual_seed(0)
    first = [torch.rand(4, generator=make_generator(SamplingParams(), "cpu")) for _ in range(2)]
    torch.manual_seed(0)
    again = [torch.rand(4, generator=make_generator(SamplingParams(), "cpu")) for _ in range(2)]
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], first[1])  # each request its own stream


def test_one_row_and_low_precision_logits():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0)
    token = int(sample(logits, [params], [make_generator(params, "cpu")])[0])
    assert token in set(torch.topk(logits[0].float(), 20).indices.tolist())
    assert int(sample(logits, [SamplingParams(temperature=0)], [None])[0]) == int(logits.argmax())


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 rows"):
        sample(torch.zeros(2, VOCAB), [SamplingParams()], [None])


def test_a_target_rounded_up_to_the_total_still_lands_on_a_possible_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]])
    assert int(_invert_cdf(probs, torch.tensor([1.0]))) == 2
    assert int(_invert_cdf(probs, torch.tensor([0.0]))) == 1


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
])
def test_bad_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_good_fields_are_normalised():
    params = SamplingParams(stop="\n", top_k=0, stop_token_ids=None)
    assert params.stop == ["\n"] and params.top_k is None and params.stop_token_ids == []
