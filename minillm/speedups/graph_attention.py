"""Attention for a padded decode batch, as one opaque operator a compiler can carry whole.

A captured decode step (:mod:`minillm.speedups.decode_graphs`) has ``B`` rows padded to a
bucket and block tables ``[B, W]`` as wide as the context allows. This operator writes one
layer's new keys and values and attends as an eager decode does
(:func:`~minillm.engine.kv_cache.gather_decode_attention`), or by the engine's kernels. A
compiled CPU step whose engine attends by the C++ kernel (``attention="cpu"``, the CPU default)
calls :func:`minillm.speedups.gemv.decode_attention` instead: no gather, no Python in the step.

Registered with ``torch.library`` (``padded_decode_op``), it is one node to ``torch.compile``,
so on a CPU it can read only the blocks the longest row needs (``trim``): traced, that width
would recompile the graph every few steps. A CUDA graph cannot ask the device for it without
stalling, so there it reads the full width, or lets a Triton kernel stop at each row's length.
"""

from __future__ import annotations

from typing import Callable

import torch

from minillm.engine.kv_cache import AttentionKernels, PagedKVPool, gather_decode_attention
from minillm.speedups import gemv

# The decode attentions the operator can run, by name (an operator's arguments are tensors and
# plain values, not functions): the gather, and the kernels a captured engine was built with.
DECODE_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {"torch": gather_decode_attention}
# The backend that is not this operator at all: the CPU's C++ decode attention (the engine's
# attention="cpu"), itself an operator a compiled step calls directly, which writes the pool and
# reads it in place
CPU_KERNEL = "cpu"


def padded_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    trim: bool,
    backend: str,
) -> torch.Tensor:
    """``q``, ``k``, ``v``: ``[1, heads, B, head_dim]``, one new token per row; ``k_pool``,
    ``v_pool``: the pool's ``[layers, blocks, block_size, heads, head_dim]``; ``slots``,
    ``lengths``: ``[B]``; ``tables``: ``[B, W]`` block ids; ``backend``: a
    :data:`DECODE_ATTENTION` name. Returns ``q``'s shape."""
    _, nb, bs, h, d = k_pool.shape
    k_pool[layer].view(nb * bs, h, d).index_copy_(0, slots, k[0].transpose(0, 1))
    v_pool[layer].view(nb * bs, h, d).index_copy_(0, slots, v[0].transpose(0, 1))
    if trim:
        tables = tables[:, : -(-int(lengths.max()) // bs)]
    out = DECODE_ATTENTION[backend](q[0].transpose(0, 1), k_pool[layer], v_pool[layer], tables, lengths)
    return out.transpose(0, 1)[None]


# The same function as one opaque operator, for torch.compile: traced, the trimmed width would
# be a new shape (a recompile) every time the longest row crosses a block boundary.
padded_decode_op = torch.library.custom_op(
    "minillm::padded_decode_attention", padded_decode_attention, mutates_args=("k_pool", "v_pool")
)


@padded_decode_op.register_fake
def _(q, k, v, k_pool, v_pool, layer, slots, tables, lengths, trim, backend):  # noqa: ANN001
    return torch.empty_like(q)


def decode_backend(kernels: AttentionKernels | None) -> str:
    """The :data:`DECODE_ATTENTION` name of ``kernels`` (registered now, outside any traced
    code), or of the gather when there are none."""
    if kernels is None:
        return "torch"
    DECODE_ATTENTION[kernels.name] = kernels.decode
    return kernels.name


class PaddedDecodeAttention:
    """The ``cache`` a captured decode step hands the model: every layer's attention through
    :func:`padded_decode_attention`, over static buffers the runner refills each step, by the
    :data:`DECODE_ATTENTION` named ``backend``."""

    def __init__(self, pool: PagedKVPool, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                 trim: bool, backend: str) -> None:
        self.pool, self.slots, self.tables, self.lengths = pool, slots, tables, lengths
        self.trim, self.backend = trim, backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == CPU_KERNEL:  # [1, heads, B, head_dim] <-> the kernel's [B, heads, head_dim]
            rows = [t[0].transpose(0, 1) for t in (q, k, v)]
            out = gemv.decode_attention(rows[0], self.pool.k, self.pool.v, layer, self.tables, self.lengths,
                                        rows[1], rows[2], self.slots)
            return out.transpose(0, 1)[None]
        attention = padded_decode_op if self.trim else padded_decode_attention  # a CUDA graph records its kernels
        return attention(
            q, k, v, self.pool.k, self.pool.v, layer, self.slots, self.tables, self.lengths, self.trim, self.backend
        )
