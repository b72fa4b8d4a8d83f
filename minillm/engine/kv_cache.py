"""The paged KV cache: one pool of fixed-size blocks shared by every running sequence.

Chapter 6's cache reserves ``max_len`` positions per sequence up front. Here memory is cut
into blocks of ``block_size`` token slots (vLLM's PagedAttention), and each sequence owns a
*block table*, the list of blocks holding its positions in order. A sequence grows a block at
a time, so at most ``block_size - 1`` slots per sequence sit empty, and blocks holding a shared
prompt prefix can be shared outright.

The pool is two tensors, ``k`` and ``v``, of shape ``[layers, num_blocks, block_size, heads,
head_dim]``. Viewed as ``[layers, num_slots, heads, head_dim]``, slot ``b * block_size + i``
is position ``i`` of block ``b``. One block more than the allocator hands out, the *pad
block* (``pad_block``, the last), belongs to no sequence: the padding rows of a captured decode
step (:mod:`minillm.speedups.decode_graphs`) write into it. :class:`PagedAttention` is what the model sees as its
``cache`` for one step: it writes the step's new keys and values into their slots, then
gathers each sequence's keys and values back through its block table to attend over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig
from minillm.model.gpt import fused_attention

# How the engine attends: "torch" gathers length-sorted groups of decodes and makes one fused
# attention call per group; "torch-loop" attends one sequence at a time (chapter 8's foil);
# "triton" runs chapter 15's kernels, which read the blocks in place.
ATTENTION_BACKENDS = ("torch", "torch-loop", "triton")


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A key and a value vector per layer: ``2 * layers * d_model`` numbers per token."""
    return 2 * cfg.n_layers * cfg.d_model * torch.empty((), dtype=dtype).element_size()


def blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int) -> int:
    """How many whole blocks fit in ``memory_bytes``."""
    return memory_bytes // (block_size * kv_bytes_per_token(cfg, dtype))


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

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``blocks`` (a flat list of block ids), copied side by side
        into a scratch buffer this pool keeps: ``[len(blocks) * block_size, heads, head_dim]``.

        Reusing one buffer matters more than it looks. A fresh tensor of tens of megabytes is
        new memory from the operating system, and touching it for the first time costs a page
        fault per 4 KiB: on a CPU that made each gather several times slower than the copy.
        The views returned are overwritten by the next call.
        """
        _, nb, bs, h, d = self.k.shape
        row = bs * h * d
        need = 2 * len(blocks) * row
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, device=self.k.device, dtype=self.k.dtype)
        k_out = self._scratch[: need // 2].view(len(blocks), row)
        v_out = self._scratch[need // 2 : need].view(len(blocks), row)
        torch.index_select(self.k[layer].view(nb, row), 0, blocks, out=k_out)
        torch.index_select(self.v[layer].view(nb, row), 0, blocks, out=v_out)
        return k_out.view(-1, h, d), v_out.view(-1, h, d)


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
    ``blocks`` holds each one's block table padded to ``width`` blocks, ``mask`` hides the
    slots past each one's length, ``lengths`` holds those lengths (new token included)."""

    start: int
    end: int
    width: int
    blocks: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor


class PagedAttention:
    """One step's view of the pool, handed to ``GPT.forward`` as its ``cache``.

    The step's tokens are laid out flat, as one ``[1, N]`` batch: first the single-token
    chunks (decodes), sorted by length, then the multi-token prefill chunks. Decodes are the
    hot path. A group of decodes of similar length is done in one fused attention call: their
    blocks are gathered into one ``[B, heads, L, head_dim]`` tensor, padded to the longest of
    the group and masked past each one's length. Sorting by length before grouping keeps that
    padding, which costs a copy and a read per slot, small. Prefill chunks, a few per step,
    are done one by one with causal attention over their own prefix.

    ``backend`` names how decodes are attended (:meth:`decode`): ``"torch"`` by the gather just
    described, ``"torch-loop"`` one sequence at a time, ``"triton"`` (chapter 15) by a kernel
    that reads the blocks in place through the block tables, with no gather; with ``"triton"``
    prefills use the FlashAttention kernel too.
    """

    def __init__(
        self,
        pool: PagedKVPool,
        slot_mapping: torch.Tensor,
        decodes: list[DecodeGroup],
        prefills: list[PrefillChunk],
        backend: str = "torch",
    ) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
        self.pool, self.slot_mapping, self.decodes, self.prefills = pool, slot_mapping, decodes, prefills
        self.backend = backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_slots, v_slots = self.pool.slots(layer)
        # [1, heads, N, head_dim] -> [N, heads, head_dim], then into each token's slot
        k_slots.index_copy_(0, self.slot_mapping, k[0].transpose(0, 1))
        v_slots.index_copy_(0, self.slot_mapping, v[0].transpose(0, 1))
        out = torch.empty_like(q)
        for group in self.decodes:
            out[0, :, group.start : group.end] = self.decode(layer, q[0, :, group.start : group.end], group)
        for chunk in self.prefills:
            rows = slice(chunk.offset, chunk.offset + chunk.num_tokens)
            keys = k_slots.index_select(0, chunk.slots).transpose(0, 1)[None]
            values = v_slots.index_select(0, chunk.slots).transpose(0, 1)[None]
            if self.backend == "triton":
                from minillm.speedups.kernels.flash_triton import flash_attention

                out[:, :, rows] = flash_attention(q[:, :, rows], keys, values, causal=True)
            else:
                out[:, :, rows] = fused_attention(q[:, :, rows], keys, values)
        return out

    def decode(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One decode group's attention, by this view's backend: ``q`` is ``[heads, B,
        head_dim]``, one query per sequence of the group; returns the same shape."""
        if self.backend == "triton":
            return self.decode_triton(layer, q, group)
        if self.backend == "torch-loop":
            return self.decode_loop(layer, q, group)
        return self.decode_gather(layer, q, group)

    def decode_gather(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """The whole group at once: its blocks gathered side by side, padded to the longest
        member and masked past each one's length, then one fused attention call."""
        b = group.end - group.start
        keys, values = self.pool.gather(layer, group.blocks)
        h, d = keys.shape[1:]
        keys, values = keys.view(b, -1, h, d).transpose(1, 2), values.view(b, -1, h, d).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[:, :, None], keys, values, attn_mask=group.mask
        )
        return out[:, :, 0].transpose(0, 1)

    def decode_loop(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """The same, one sequence at a time, each through its own block table: exactly its
        slots are read, with no padding, but every sequence pays a handful of operations."""
        k_slots, v_slots = self.pool.slots(layer)
        bs = self.pool.block_size
        tables = group.blocks.view(group.end - group.start, group.width)
        out = torch.empty_like(q)
        for i, n in enumerate(group.lengths.tolist()):
            slots = (tables[i, : -(-n // bs), None] * bs + torch.arange(bs, device=q.device)).flatten()[:n]
            keys = k_slots.index_select(0, slots).transpose(0, 1)  # [heads, n, head_dim]
            values = v_slots.index_select(0, slots).transpose(0, 1)
            out[:, i] = torch.nn.functional.scaled_dot_product_attention(q[:, i : i + 1], keys, values)[:, 0]
        return out

    def decode_triton(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """The same as :meth:`decode_gather`, by the paged Triton kernel: no gather, no padding."""
        from minillm.speedups.kernels.paged_triton import paged_decode_attention

        b = group.end - group.start
        out = paged_decode_attention(
            q.transpose(0, 1), self.pool.k[layer], self.pool.v[layer], group.blocks.view(b, group.width), group.lengths
        )
        return out.transpose(0, 1)
