"""Random numbers by counter: a request's draw for a position is a pure function of where it is.

A random generator hands out numbers in the order they are asked for, so the number a request
gets at position ``p`` depends on how many it asked for before: a request preempted and
recomputed, or scheduled one step later by the overlapped engine, could draw differently. A
counter-based generator (Salmon et al. 2011's Philox, JAX's keys, gpt-fast's and nano-vllm's
samplers) has no state to advance: the number is a hash of ``(seed, counter, stream)``. Here
the counter is the index the token being drawn will have in its sequence, so the draw for
position ``p`` is the same whatever batch, order, preemption or overlap came before, and a
whole batch's numbers are one vectorised computation on the device, not a call per row.

``stream`` keeps independent uses of the same position apart: the plain sampler's draw, and
speculative decoding's draft, acceptance test and residual draw (chapter 15), which must not
share a number or the acceptance rule would no longer keep the target's distribution.

The hash is splitmix64's output function (Steele, Lea and Flood 2014), applied three times to
fold in the seed, the stream and the counter. :func:`uniforms` runs it over int64 tensors;
:func:`uniform` is the same arithmetic on Python integers, for the loops that draw one token
at a time, and gives bit-identical numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import torch


class Stream(IntEnum):
    """The independent uses of one request's randomness at one position."""

    SAMPLE = 0  # the sampler's draw of the next token
    DRAFT = 1  # a draft model's guess at the token (speculative decoding)
    ACCEPT = 2  # the test that accepts or rejects a drafted token
    RESIDUAL = 3  # the token drawn after a rejection, or the bonus token after a full accept


_MASK64 = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 over the golden ratio, odd
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# float32: its 24-bit significand holds every k / 2**24 exactly, so a number never rounds up to
# 1.0; the sampler inverts a float32 CDF, whose resolution finer bits would not change (it is
# what torch.rand gives a float32 tensor, too); and Apple's GPUs have no float64.
_BITS = 24


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits, for tensor arithmetic."""
    return x - 2**64 if x >= 2**63 else x


def _mix(x: int) -> int:
    """splitmix64's output for state ``x``: every bit of the result depends on every bit of ``x``."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """A logical right shift of int64 bits: ``>>`` copies the sign bit in, the mask clears it."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` on int64 tensors, whose addition and multiplication wrap modulo 2**64 as the
    masked Python arithmetic does."""
    z = z + _signed(_GAMMA)
    z = (z ^ _shift_right(z, 30)) * _signed(_MUL1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MUL2)
    return z ^ _shift_right(z, 31)


def uniform(seed: int, counter: int, stream: Stream) -> float:
    """The uniform number in [0, 1) that ``seed`` draws at ``counter`` for ``stream``: the same
    as :func:`uniforms` gives, bit for bit. A negative seed means its 64-bit two's complement."""
    key = _mix(_mix(_mix(seed & _MASK64) ^ int(stream)) ^ (counter & _MASK64))
    return (key >> (64 - _BITS)) * 2.0**-_BITS


def uniforms(seeds: Sequence[int] | torch.Tensor, counters: Sequence[int] | torch.Tensor, stream: Stream,
             device: torch.device | str | None = None) -> torch.Tensor:
    """One uniform number in [0, 1) per row, float32 ``[n]``: row ``i``'s is what ``seeds[i]``
    draws at ``counters[i]`` for ``stream``, computed for every row at once on ``device`` (the
    tensors' own, if given tensors). Seeds are signed 64-bit integers, as
    :class:`~minillm.decoding.sampling.SamplingParams` takes them."""
    if isinstance(seeds, torch.Tensor) and isinstance(counters, torch.Tensor):
        seeds, counters = seeds.to(device=device, dtype=torch.int64), counters.to(device=device, dtype=torch.int64)
    else:
        seeds, counters = torch.tensor([list(seeds), list(counters)], dtype=torch.int64, device=device)
    key = _mix_tensor(_mix_tensor(_mix_tensor(seeds) ^ int(stream)) ^ counters)
    return _shift_right(key, 64 - _BITS).float() * 2.0**-_BITS
