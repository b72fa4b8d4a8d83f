"""Attention one tile at a time, in plain PyTorch: the FlashAttention algorithm, readable.

Softmax needs the maximum and the sum of a whole row before it can normalise any entry, which
seems to force the full row of scores to exist at once. It does not. Keep a *running* maximum
``m`` and a running sum ``l`` of ``exp(s - m)``; when a new block of scores raises the maximum
to ``m'``, every term already summed was exponentiated against the old ``m``, so multiplying
the sum by ``exp(m - m')`` puts it on the new footing (Milakov and Gimelshein, "Online
normalizer calculation for softmax", 2018). The same factor rescales a running weighted sum
of value rows, so attention can stream keys and values past a block of queries and never hold
more than one block of scores (Rabe and Staats, 2021; Dao et al., FlashAttention, 2022).

:func:`tiled_attention` is that loop with Python ``for`` statements where a GPU kernel has
thread blocks: slow, and meant to be read beside the Triton kernel (``flash_triton``).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from minillm.speedups.kernels.traffic import TrafficCounter


def online_softmax_steps(x: torch.Tensor, block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stream ``x`` (any shape; softmax over the last dimension) in chunks of ``block``,
    yielding the running ``(max, sum of exp(x - max))`` after each chunk."""
    if block < 1 or x.shape[-1] == 0:
        raise ValueError(f"need block >= 1 and a non-empty last dimension, got block={block}, shape {tuple(x.shape)}")
    m = torch.full(x.shape[:-1], -math.inf, dtype=torch.float32, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block):
        chunk = x[..., start : start + block].float()
        m_new = torch.maximum(m, chunk.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(chunk - m_new[..., None]).sum(-1)
        m = m_new
        yield m, l


def online_softmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Softmax over the last dimension from one streaming pass for the statistics and one to
    normalise: the same numbers as ``torch.softmax``, without ever holding a whole row's max."""
    for m, l in online_softmax_steps(x, block):
        pass
    return (torch.exp(x.float() - m[..., None]) / l[..., None]).to(x.dtype)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, counter: TrafficCounter | None = None
) -> torch.Tensor:
    """Attention as three kernels with the scores in memory between them (the baseline the
    traffic model calls *naive*). ``q`` is ``[..., T_q, d]``, ``k`` and ``v`` ``[..., T_k, d]``."""
    _check_shapes(q, k, v, causal)
    counter = counter or TrafficCounter()
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    counter.load(q, k)
    counter.store(scores)
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    counter.load(scores)
    counter.store(probs)
    out = probs @ v
    counter.load(probs, v)
    counter.store(out)
    return out


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    block_q: int = 32,
    block_k: int = 32,
    counter: TrafficCounter | None = None,
) -> torch.Tensor:
    """Attention with the online-softmax recurrence, ``block_q`` queries at a time against
    ``block_k`` keys at a time; statistics and accumulator in fp32.

    ``causal`` lines the mask up at the bottom right, as the engine needs for a chunk of new
    tokens after a cached prefix: query ``i`` of ``T_q`` sees keys ``0 .. i + T_k - T_q``.
    Key blocks wholly above the diagonal are never loaded.
    """
    _check_shapes(q, k, v, causal)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    counter = counter or TrafficCounter()
    t_q, t_k = q.shape[-2], k.shape[-2]
    offset = t_k - t_q
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for qs in range(0, t_q, block_q):
        q_blk = q[..., qs : qs + block_q, :]
        counter.load(q_blk)
        rows = q_blk.shape[-2]
        m = torch.full((*q_blk.shape[:-1],), -math.inf, dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        key_end = min(qs + rows + offset, t_k) if causal else t_k
        for ks in range(0, key_end, block_k):
            k_blk, v_blk = k[..., ks : ks + block_k, :], v[..., ks : ks + block_k, :]
            counter.load(k_blk, v_blk)
            s = (q_blk.float() @ k_blk.float().transpose(-1, -2)) * scale
            if causal:
                query_pos = torch.arange(qs, qs + rows, device=q.device)[:, None] + offset
                key_pos = torch.arange(ks, ks + k_blk.shape[-2], device=q.device)[None, :]
                s = s.masked_fill(key_pos > query_pos, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)  # how far the old statistics must shrink
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v_blk.float()
            m = m_new
        o_blk = (acc / l[..., None]).to(q.dtype)
        out[..., qs : qs + rows, :] = o_blk
        counter.store(o_blk)
    return out


def _causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """True where query ``i`` may see key ``j``: ``j <= i + t_k - t_q``."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() < 2 or q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [..., T_q, d], k and v [..., T_k, d]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(f"causal attention needs at least as many keys as queries, got "
                         f"{k.shape[-2]} keys for {q.shape[-2]} queries")
