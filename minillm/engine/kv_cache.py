"""The paged KV cache: one pool of fixed-size blocks shared by every running sequence.

The pool is two tensors, ``k`` and ``v``, ``[layers, num_blocks, block_size, heads,
head_dim]``; slot ``b * block_size + i`` is position ``i`` of block ``b``. One more block than
the allocator hands out, the *pad block* (the last), belongs to no sequence: block tables are
padded with it, and the padding rows of a captured decode step write into it.
:class:`PagedAttention` is the model's ``cache`` for one step: it writes the step's new keys
and values into their slots, then reads each sequence's back through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from minillm.model.gpt import fused_attention

# How decodes attend: "torch" gathers length-sorted groups, one fused call each; "torch-loop"
# one sequence at a time (chapter 8's foil); "triton" by chapter 16's kernels, in place; "cpu"
# by a C++ operator that reads the pool in place on a CPU (minillm.speedups.gemv).
ATTENTION_BACKENDS = ("torch", "torch-loop", "triton", "cpu")


@dataclass(frozen=True)
class AttentionKernels:
    """Kernels that read the pool in place (chapter 16's, handed in by ``build_engine``):
    ``decode`` has :func:`gather_decode_attention`'s signature, ``prefill(q, k, v)`` is causal."""

    name: str
    decode: Callable[..., torch.Tensor]
    prefill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def slot_of(block_table: list[int] | torch.Tensor, position: int | torch.Tensor, block_size: int) -> int | torch.Tensor:
    """The pool slot of ``position`` in a sequence whose blocks are ``block_table``: position
    ``p`` is slot ``p % block_size`` of block ``block_table[p // block_size]``. An int position
    and a list table give an int; tensors give every position's slot at once."""
    return block_table[position // block_size] * block_size + position % block_size


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A key and a value vector per layer: ``2 * layers * d_model`` numbers per token."""
    return 2 * cfg.n_layers * cfg.d_model * torch.empty((), dtype=dtype).element_size()


def blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int,
                      beside_per_token: int = 0) -> int:
    """How many whole blocks fit in ``memory_bytes``, each holding ``beside_per_token`` bytes
    a token more in a cache beside the pool (a draft model's)."""
    return memory_bytes // (block_size * (kv_bytes_per_token(cfg, dtype) + beside_per_token))


class PagedKVPool:
    """The block pool's storage. Which block belongs to whom is the allocator's business."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        shape = (cfg.n_layers, num_blocks + 1, block_size, cfg.n_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pad_block = num_blocks
        self._scratch = torch.empty(0, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values as ``[num_slots, heads, head_dim]`` views."""
        n, bs, h, d = self.k.shape[1:]
        return self.k[layer].view(n * bs, h, d), self.v[layer].view(n * bs, h, d)

    def scratch(self, blocks: int) -> torch.Tensor:
        """A flat buffer this pool keeps, room for the keys and the values of ``blocks`` blocks,
        for :func:`gather_decode_attention` to gather into; overwritten by the next gather.

        Reusing one buffer matters more than it looks. A fresh tensor of tens of megabytes is
        new memory from the operating system, and touching it for the first time costs a page
        fault per 4 KiB: on a CPU that made each gather several times slower than the copy.
        """
        need = 2 * blocks * self.k[0, 0].numel()
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, device=self.k.device, dtype=self.k.dtype)
        return self._scratch

    def table_row(self, block_table: list[int], width: int) -> list[int]:
        """The first ``width`` blocks of ``block_table``, padded to ``width`` with the pad block:
        the one padding of the attention's ``[B, W]`` tables. Padding entries lie past the
        row's length, so they are masked out (or, by a kernel, never read)."""
        row = block_table[:width]
        return row + [self.pad_block] * (width - len(row))


def gather_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                            lengths: torch.Tensor, scratch: torch.Tensor | None = None,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over its cached keys and values, the eager and the captured decode
    alike: gather the rows' blocks side by side (one ``index_select`` each for keys and values),
    mask each row past its length, one fused attention call.

    ``q`` is ``[B, heads, head_dim]``; ``k_pool``, ``v_pool`` one layer of the pool, ``[blocks,
    block_size, heads, head_dim]``; ``tables`` ``[B, W]`` block ids, padded past each row's
    blocks (:meth:`PagedKVPool.table_row`); ``lengths`` ``[B]``, each row's positions including
    the new one's. ``scratch`` (:meth:`PagedKVPool.scratch`) is gathered into when given; a
    captured step gathers into memory of its own, whose address a replay can rely on. ``mask``
    (:func:`decode_mask`) is the same for every layer of a step: the eager path builds it once.
    Returns ``[B, heads, head_dim]``."""
    b, width = tables.shape
    nb, bs, h, d = k_pool.shape
    n, row = b * width, bs * h * d
    k_rows = v_rows = None
    if scratch is not None:
        k_rows, v_rows = scratch[: n * row].view(n, row), scratch[n * row : 2 * n * row].view(n, row)
    blocks = tables.reshape(-1)
    keys = torch.index_select(k_pool.view(nb, row), 0, blocks, out=k_rows).view(b, width * bs, h, d).transpose(1, 2)
    values = torch.index_select(v_pool.view(nb, row), 0, blocks, out=v_rows).view(b, width * bs, h, d).transpose(1, 2)
    mask = decode_mask(lengths, width * bs) if mask is None else mask
    return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask)[:, :, 0]


def decode_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, 1, 1, width]``: True where a row's gathered position is one of its ``lengths``."""
    return (torch.arange(width, device=lengths.device) < lengths[:, None])[:, None, None, :]


def loop_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
    """The same, one row at a time, each through its own block table: exactly its slots are
    read, with no padding, but every row pays a handful of operations."""
    _, bs, h, d = k_pool.shape
    k_slots, v_slots = k_pool.view(-1, h, d), v_pool.view(-1, h, d)
    out = torch.empty_like(q)
    for i, n in enumerate(lengths.tolist()):
        slots = slot_of(tables[i], torch.arange(n, device=q.device), bs)
        keys = k_slots.index_select(0, slots).transpose(0, 1)  # [heads, n, head_dim]
        values = v_slots.index_select(0, slots).transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i, :, None], keys, values)[:, 0]
    return out


@dataclass
class PrefillChunk:
    """A run of ``num_tokens`` new tokens of one sequence, at ``offset`` in the flat batch,
    attending over ``slots`` (every position of the sequence up to its last new token)."""

    offset: int
    num_tokens: int
    slots: torch.Tensor


@dataclass
class DecodeGroup:
    """Decodes ``start .. end - 1`` of the flat batch, of similar lengths, attended together:
    ``tables`` ``[B, W]`` holds each one's block table padded to the longest of the group,
    ``lengths`` their lengths (new token included)."""

    start: int
    end: int
    tables: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor | None = None  # decode_mask, built once per step by PagedAttention


class PagedAttention:
    """One step's view of the pool, handed to ``GPT.forward`` as its ``cache``.

    The step's tokens are one flat ``[1, N]`` batch: the decodes, sorted by length, then the
    prefill chunks. Each group of decodes is one fused call over its gathered blocks, padded to
    the group's longest (sorting keeps the padding small); each prefill chunk attends causally
    over its own prefix. ``backend`` is ``"torch"``, ``"torch-loop"`` or :class:`AttentionKernels`.
    """

    def __init__(
        self,
        pool: PagedKVPool,
        slot_mapping: torch.Tensor,
        decodes: list[DecodeGroup],
        prefills: list[PrefillChunk],
        backend: str | AttentionKernels = "torch",
    ) -> None:
        if backend not in ("torch", "torch-loop") and not isinstance(backend, AttentionKernels):
            raise ValueError(f"attention must be 'torch', 'torch-loop' or AttentionKernels, got {backend!r}")
        self.pool, self.slot_mapping, self.decodes, self.prefills = pool, slot_mapping, decodes, prefills
        self.backend = backend
        if backend == "torch" and decodes:  # every layer masks the same positions: once a step, not once a layer
            lengths = decodes[0].lengths if len(decodes) == 1 else torch.cat([g.lengths for g in decodes])
            mask = decode_mask(lengths, max(g.tables.shape[1] for g in decodes) * pool.block_size)
            for group in decodes:  # each group's rows, as wide as its tables
                group.mask = mask[group.start - decodes[0].start : group.end - decodes[0].start,
                                  ..., : group.tables.shape[1] * pool.block_size]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_slots, v_slots = self.pool.slots(layer)
        # [1, heads, N, head_dim] -> [N, heads, head_dim], then into each token's slot
        k_slots.index_copy_(0, self.slot_mapping, k[0].transpose(0, 1))
        v_slots.index_copy_(0, self.slot_mapping, v[0].transpose(0, 1))
        out = torch.empty_like(q)
        for group in self.decodes:
            out[0, :, group.start : group.end] = self.decode(layer, q[0, :, group.start : group.end], group)
        prefill = self.backend.prefill if isinstance(self.backend, AttentionKernels) else fused_attention
        for chunk in self.prefills:
            rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
            keys = k_slots.index_select(0, chunk.slots).transpose(0, 1)[None]
            values = v_slots.index_select(0, chunk.slots).transpose(0, 1)[None]
            out[:, :, rows] = prefill(q[:, :, rows], keys, values)
        return out

    def decode(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One decode group's attention, by this view's backend: ``q`` is ``[heads, B,
        head_dim]``, one query per sequence of the group; returns the same shape."""
        args = (q.transpose(0, 1), self.pool.k[layer], self.pool.v[layer], group.tables, group.lengths)
        if self.backend == "torch":
            out = gather_decode_attention(*args, scratch=self.pool.scratch(group.tables.numel()), mask=group.mask)
        elif self.backend == "torch-loop":
            out = loop_decode_attention(*args)
        else:
            out = self.backend.decode(*args)
        return out.transpose(0, 1)
