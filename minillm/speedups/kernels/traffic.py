"""How many bytes attention moves between main memory (HBM) and the chip, in closed form.

An attention layer's speed is set less by its FLOPs than by its bytes (chapter 1's ridge).
*Naive* attention is three kernels whose two ``T_q x T_k`` intermediates round-trip through
memory; *tiled* (FlashAttention) keeps a query block on chip while keys and values stream
past, once per query block, and nothing square reaches memory. :class:`TrafficCounter` does
the same bookkeeping by running code, and the tests check these formulas against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

import torch

from minillm.machine.hardware import DeviceSpec


@dataclass(frozen=True)
class Traffic:
    """Bytes read from and written to main memory by one attention call."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.read + other.read, self.written + other.written)


class TrafficCounter:
    """Adds up the bytes of every tensor an implementation says it loaded or stored."""

    def __init__(self) -> None:
        self.read = self.written = 0

    def load(self, *tensors: torch.Tensor) -> None:
        self.read += sum(t.numel() * t.element_size() for t in tensors)

    def store(self, *tensors: torch.Tensor) -> None:
        self.written += sum(t.numel() * t.element_size() for t in tensors)

    @property
    def traffic(self) -> Traffic:
        return Traffic(self.read, self.written)


def naive_kernels(
    t_q: int, t_k: int, head_dim: int, *, heads: int = 1, batch: int = 1, dtype_bytes: int = 2
) -> list[tuple[str, int, Traffic]]:
    """Naive attention's three kernels as ``(name, FLOPs, Traffic)``, scores stored in the
    inputs' dtype, as PyTorch's matmul does; the softmax counts five FLOPs an entry."""
    _check(t_q, t_k, head_dim, heads, batch, dtype_bytes)
    n, scores = heads * batch, t_q * t_k
    e = n * dtype_bytes
    return [
        ("S = QK^T", 2 * scores * head_dim * n, Traffic((t_q + t_k) * head_dim * e, scores * e)),
        ("P = softmax(S)", 5 * scores * n, Traffic(scores * e, scores * e)),
        ("O = PV", 2 * scores * head_dim * n, Traffic((scores + t_k * head_dim) * e, t_q * head_dim * e)),
    ]


def naive_bytes(t_q: int, t_k: int, head_dim: int, *, heads: int = 1, batch: int = 1, dtype_bytes: int = 2) -> Traffic:
    """The three kernels' traffic together: every intermediate makes a round trip to memory."""
    kernels = naive_kernels(t_q, t_k, head_dim, heads=heads, batch=batch, dtype_bytes=dtype_bytes)
    return sum((traffic for _, _, traffic in kernels), Traffic(0, 0))


def roofline_seconds(flops: float, traffic: Traffic, spec: DeviceSpec, dtype: str) -> float:
    """The least time a kernel can take on ``spec`` (chapter 1): its FLOPs at peak compute or
    its bytes at full bandwidth, whichever is longer."""
    return max(flops / spec.flops[dtype], traffic.total / spec.bandwidth)


def tiled_bytes(
    t_q: int,
    t_k: int,
    head_dim: int,
    *,
    block_q: int,
    block_k: int,
    causal: bool = False,
    heads: int = 1,
    batch: int = 1,
    dtype_bytes: int = 2,
) -> Traffic:
    """Q and O cross memory once; K and V once per block of queries, and, when causal, only
    up to the key block that holds the diagonal (query ``i`` sees keys ``<= i + t_k - t_q``)."""
    _check(t_q, t_k, head_dim, heads, batch, dtype_bytes)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    n_blocks = ceil(t_q / block_q)
    if not causal:
        key_rows = n_blocks * t_k
    else:
        offset = t_k - t_q
        ends = (min((i + 1) * block_q, t_q) + offset for i in range(n_blocks))
        key_rows = sum(min(ceil(e / block_k) * block_k, t_k) for e in ends)
    n = heads * batch * dtype_bytes
    return Traffic((t_q * head_dim + 2 * key_rows * head_dim) * n, t_q * head_dim * n)


def decode_bytes(kv_len: int, head_dim: int, *, heads: int = 1, dtype_bytes: int = 2, gathered: bool) -> Traffic:
    """One new token attending over ``kv_len`` cached positions, in a paged cache: the cache
    crosses memory three times ``gathered`` (read, write the copy, read it) and once in place.
    """
    _check(1, kv_len, head_dim, heads, 1, dtype_bytes)
    kv = 2 * kv_len * head_dim * heads * dtype_bytes
    vec = head_dim * heads * dtype_bytes
    if gathered:
        return Traffic(vec + 2 * kv, kv + vec)
    return Traffic(vec + kv, vec)


def _check(t_q: int, t_k: int, head_dim: int, heads: int, batch: int, dtype_bytes: int) -> None:
    for name, value in dict(t_q=t_q, t_k=t_k, head_dim=head_dim, heads=heads, batch=batch, dtype_bytes=dtype_bytes).items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
