"""Counter-based draws: a pure function of (seed, counter, stream), the same from the batched
tensor version and the one-at-a-time Python version, uniform on [0, 1), and sensitive to each
of its three inputs."""

from __future__ import annotations

import random

import pytest
import torch

from minillm.decoding import draws
from minillm.decoding.draws import Stream, uniform, uniforms
from minillm.decoding.sampling import SEED_MAX, SEED_MIN

EXTREME_SEEDS = [0, 1, -1, 2, -2, SEED_MIN, SEED_MAX, SEED_MIN + 1, SEED_MAX - 1, 2**32, -(2**32), 2**62, 12345]


def chi_square(u: torch.Tensor, bins: int) -> float:
    """Pearson's statistic of ``u``'s counts in ``bins`` equal bins of [0, 1)."""
    counts = torch.bincount((u.double() * bins).long(), minlength=bins).double()
    expected = len(u) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def too_far(statistic: float, dof: int) -> bool:
    """Beyond six standard deviations of a chi-square with ``dof`` degrees of freedom: a fixed
    sample of a good hash lands well inside, a hash that ignores an input lands far outside."""
    return statistic > dof + 6 * (2 * dof) ** 0.5


def test_the_mix_is_splitmix64() -> None:
    """splitmix64 seeded with 0 first outputs 0xE220A8397B1DCDAF (the reference implementation
    by Vigna): the hash is the well-known one, not a near miss."""
    assert draws._mix(0) == 0xE220A8397B1DCDAF
    assert draws._mix(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_tensor_and_scalar_draws_are_bit_identical() -> None:
    rng = random.Random(0)
    seeds = EXTREME_SEEDS + [rng.randrange(SEED_MIN, SEED_MAX + 1) for _ in range(3000)]
    counters = [rng.choice([0, 1, 2047, 2**31 - 1, 2**40, SEED_MAX, rng.randrange(4096)]) for _ in seeds]
    for stream in Stream:
        batched = uniforms(seeds, counters, stream)
        assert batched.dtype == torch.float32 and batched.shape == (len(seeds),)
        assert batched.tolist() == [uniform(s, c, stream) for s, c in zip(seeds, counters)]
    as_tensors = uniforms(torch.tensor(seeds), torch.tensor(counters), Stream.DRAFT)
    assert torch.equal(as_tensors, uniforms(seeds, counters, Stream.DRAFT))


def test_a_negative_seed_is_its_64_bit_twos_complement() -> None:
    for seed in (-1, SEED_MIN, -12345):
        assert uniform(seed, 7, Stream.SAMPLE) == uniform(seed + 2**64, 7, Stream.SAMPLE)


def test_a_rows_number_does_not_depend_on_its_batch() -> None:
    seeds, counters = list(range(-50, 50)), list(range(100, 200))
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
    together = uniforms(seeds, counters, Stream.SAMPLE)
    shuffled = uniforms([seeds[i] for i in order], [counters[i] for i in order], Stream.SAMPLE)
    assert torch.equal(shuffled, together[order])
    assert uniforms([], [], Stream.SAMPLE).shape == (0,)


def test_draws_lie_in_zero_one_and_reach_both_ends() -> None:
    u = uniforms([3] * 2**17, list(range(2**17)), Stream.SAMPLE).double()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert float(u.min()) < 1e-4 and float(u.max()) > 1 - 1e-4
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002


N = 2**16


def samples(draw) -> dict[str, torch.Tensor]:
    """``N`` numbers from ``draw(seeds, counters, stream)`` along each input: one seed's
    counters, consecutive seeds (the server's ``seed + j``) at one counter, the four streams,
    and pairs whose seed and counter have the same sum."""
    quarter = list(range(N // 4))
    return {
        "counter": draw([42] * N, list(range(N)), Stream.SAMPLE),
        "seed": draw(list(range(-N // 2, N // 2)), [5] * N, Stream.SAMPLE),
        "stream": torch.cat([draw(quarter, [9] * len(quarter), stream) for stream in Stream]),
        "seed against counter": draw(list(range(N)), [N - s for s in range(N)], Stream.SAMPLE),
    }


def failed_checks(draw) -> set[str]:
    """The samples of :func:`samples` that fail a check: 64 equal bins (chi-square), pairs of
    neighbours on a 16 x 16 grid (a mix uniform alone but correlated between neighbours fails),
    and repeats (24-bit numbers repeat by chance about 128 times in 65,536)."""
    failed = set()
    for name, u in samples(draw).items():
        pairs = ((u[:-1:2].double() * 16).long() * 16 + (u[1::2].double() * 16).long()).double() / 256
        if too_far(chi_square(u, 64), 63) or too_far(chi_square(pairs, 256), 255) or distinct_fraction(u) < 0.99:
            failed.add(name)
    return failed


def distinct_fraction(u: torch.Tensor) -> float:
    return len(set(u.tolist())) / len(u)


def test_draws_are_uniform_and_independent_along_each_input() -> None:
    assert failed_checks(uniforms) == set()


@pytest.mark.parametrize(("broken", "caught"), [
    (lambda seeds, counters, stream: draws._mix_tensor(draws._mix_tensor(seeds) ^ int(stream)), "counter"),
    (lambda seeds, counters, stream: draws._mix_tensor(draws._mix_tensor(seeds) ^ counters), "stream"),
    (lambda seeds, counters, stream: draws._mix_tensor(seeds + counters + int(stream)), "seed against counter"),
    (lambda seeds, counters, stream: seeds * 0x9E3779B97F4A7C15 ^ counters << 40, "counter"),  # no mixing at all
], ids=["ignores the counter", "ignores the stream", "adds counter to seed", "linear"])
def test_the_checks_catch_a_broken_mix(broken, caught: str) -> None:
    """The checks are strong enough to fail a mix that drops an input, folds the counter into
    the seed (so neighbouring requests share their numbers), or does not mix at all."""
    def draw(seeds, counters, stream):
        key = broken(torch.tensor(seeds), torch.tensor(counters), stream)
        return draws._shift_right(key, 40).float() * 2.0**-24

    assert caught in failed_checks(draw)


def test_each_input_changes_the_draw() -> None:
    """Streams, neighbouring counters and neighbouring seeds, including the pairs a sum of seed
    and counter would confuse, give different numbers (a 24-bit number collides by chance about
    once in 16 million comparisons: none is expected here)."""
    seeds, counters = list(range(-500, 500)), list(range(1000))
    by_stream = [uniforms(seeds, counters, stream) for stream in Stream]
    for a in range(len(Stream)):
        for b in range(a + 1, len(Stream)):
            assert int((by_stream[a] == by_stream[b]).sum()) == 0
    base = by_stream[Stream.SAMPLE]
    assert int((base == uniforms(seeds, [c + 1 for c in counters], Stream.SAMPLE)).sum()) == 0
    assert int((base == uniforms([s + 1 for s in seeds], counters, Stream.SAMPLE)).sum()) == 0
    swapped = uniforms([s + 1 for s in seeds], [c - 1 for c in counters[1:]] + [0], Stream.SAMPLE)
    assert int((base[1:] == swapped[:-1]).sum()) == 0
    assert distinct_fraction(torch.cat(by_stream)) > 0.999


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draws_on_a_gpu_equal_the_cpus() -> None:
    rng = random.Random(1)
    seeds = EXTREME_SEEDS + [rng.randrange(SEED_MIN, SEED_MAX + 1) for _ in range(1000)]
    counters = [rng.randrange(2**40) for _ in seeds]
    on_gpu = uniforms(seeds, counters, Stream.RESIDUAL, "cuda")
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), uniforms(seeds, counters, Stream.RESIDUAL))
