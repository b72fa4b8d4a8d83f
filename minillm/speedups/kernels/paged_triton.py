"""Paged decode attention in Triton: one new token per sequence, keys and values read in place.

Where the engine's PyTorch path gathers each sequence's blocks before attending (the cache
crosses memory three times), program ``(b, h)`` follows sequence ``b``'s block table, as vLLM's
PagedAttention does, folding each block into ``tiled_attention``'s online softmax: the cache is
read once. One query row needs no tensor core: scores are a multiply and a row sum in fp32.
"""

from __future__ import annotations

import math

import torch

from minillm.speedups.kernels.runtime import load_triton

triton, tl = load_triton()


@triton.jit
def paged_decode_kernel(
    Q, K_POOL, V_POOL, TABLES, LENGTHS, O,
    sqb, sqh, skn, sks, skh, svn, svs, svh, stb, sob, soh,
    head_dim, scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(LENGTHS + b)
    slots = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + dims, mask=dims < head_dim, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(TABLES + b * stb + j).to(tl.int64)
        visible = (slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < length)
        mask = visible[:, None] & (dims[None, :] < head_dim)
        k = tl.load(K_POOL + block * skn + slots[:, None] * sks + h * skh + dims[None, :], mask=mask, other=0.0)
        v = tl.load(V_POOL + block * svn + slots[:, None] * svs + h * svh + dims[None, :], mask=mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    tl.store(O + b * sob + h * soh + dims, (acc / l_i).to(O.dtype.element_ty), mask=dims < head_dim)


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Attention of one query per sequence over its cached keys and values, with
    :func:`~minillm.engine.kv_cache.gather_decode_attention`'s arguments. ``lengths`` are not
    checked: reading them back from a GPU would stall every call."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[2:] != q.shape[1:]:
        raise ValueError(f"expected q [B, H, d] and pools [blocks, block_size, H, d]; got "
                         f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise ValueError(f"expected block_tables [B, W] and lengths [B] for B={q.shape[0]}; got "
                         f"{tuple(block_tables.shape)}, {tuple(lengths.shape)}")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("the pools' last dimension must be contiguous")
    block_size = k_pool.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    # the kernel steps through a table's row and through the lengths one entry at a time (the
    # engine hands in columns of its staged rows, which are strided)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lengths = lengths.contiguous()
    batch, heads, d = q.shape
    out = torch.empty_like(q)
    paged_decode_kernel[(batch, heads)](
        q, k_pool, v_pool, block_tables, lengths, out,
        q.stride(0), q.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        d, 1.0 / math.sqrt(d),
        BLOCK_SIZE=block_size, BLOCK_N=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(d),
    )
    return out
