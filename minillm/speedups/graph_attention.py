"""Attention for a padded decode batch, as one opaque operator a compiler can carry whole.

A captured decode step (:mod:`minillm.speedups.decode_graphs`) has fixed shapes: ``B`` rows
(the batch padded up to a bucket), each with one new token, a slot for its key and value, a
block table ``[B, W]`` wide enough for the longest sequence the model allows, and a length.
This operator does one layer's paged attention for such a batch: it writes the new keys and
values into their slots, reads each row's blocks back and attends over them, masked past
each row's length.

It is also registered with ``torch.library`` (``padded_decode_op``) so that ``torch.compile``
treats it as one node whose only side effect is writing the pool, instead of tracing into it. That lets it do one thing
a traced graph could not: on a CPU it reads only as many blocks as the longest row needs
(``trim``), a width that changes every few steps and would otherwise recompile the graph
or force it to read the whole context every step. A CUDA graph cannot ask the device how
long the longest row is without stopping the stream, so there it reads the full width
(``trim=False``) or, with ``backend="triton"``, lets chapter 15's kernel stop at each row's
own length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minillm.engine.kv_cache import PagedKVPool


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
    ``lengths``: ``[B]``; ``tables``: ``[B, W]`` block ids. Returns ``q``'s shape."""
    _, nb, bs, h, d = k_pool.shape
    b = q.shape[2]
    k_slots, v_slots = k_pool[layer].view(nb * bs, h, d), v_pool[layer].view(nb * bs, h, d)
    k_slots.index_copy_(0, slots, k[0].transpose(0, 1))
    v_slots.index_copy_(0, slots, v[0].transpose(0, 1))
    queries = q[0].transpose(0, 1)  # [B, heads, head_dim]
    if backend == "triton":
        from minillm.speedups.kernels.paged_triton import paged_decode_attention

        out = paged_decode_attention(queries, k_pool[layer], v_pool[layer], tables, lengths)
        return out.transpose(0, 1)[None]
    width = -(-int(lengths.max()) // bs) if trim else tables.shape[1]
    blocks = tables[:, :width].reshape(-1)
    row = bs * h * d
    keys = k_pool[layer].view(nb, row).index_select(0, blocks).view(b, width * bs, h, d).transpose(1, 2)
    values = v_pool[layer].view(nb, row).index_select(0, blocks).view(b, width * bs, h, d).transpose(1, 2)
    mask = torch.arange(width * bs, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(queries[:, :, None], keys, values, attn_mask=mask[:, None, None, :])
    return out[:, :, 0].transpose(0, 1)[None]


# The same function as one opaque operator, for torch.compile: traced, the trimmed width would
# be a new shape (a recompile) every time the longest row crosses a block boundary.
padded_decode_op = torch.library.custom_op(
    "minillm::padded_decode_attention", padded_decode_attention, mutates_args=("k_pool", "v_pool")
)


@padded_decode_op.register_fake
def _(q, k, v, k_pool, v_pool, layer, slots, tables, lengths, trim, backend):  # noqa: ANN001
    return torch.empty_like(q)


class PaddedDecodeAttention:
    """The ``cache`` a captured decode step hands the model: every layer's attention through
    :func:`padded_decode_attention`, over static buffers the runner refills each step."""

    def __init__(self, pool: PagedKVPool, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                 trim: bool, backend: str) -> None:
        self.pool, self.slots, self.tables, self.lengths = pool, slots, tables, lengths
        self.trim, self.backend = trim, backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attention = padded_decode_op if self.trim else padded_decode_attention  # a CUDA graph records its kernels
        return attention(
            q, k, v, self.pool.k, self.pool.v, layer, self.slots, self.tables, self.lengths, self.trim, self.backend
        )
