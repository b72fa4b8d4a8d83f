"""A FlashAttention forward kernel in Triton: ``tiled_attention``'s loop, one program per tile.

One program per ``BLOCK_M`` queries of each (batch, head) keeps ``m_i``, ``l_i`` and the fp32
``acc`` on chip while keys and values stream past ``BLOCK_N`` rows at a time (Dao et al., 2022;
FlashAttention-2's loop order). Triton's interpreter computes ``tl.dot`` wrongly on bf16
(triton 3.9), so when interpreting the tiles go to fp32 first (``UPCAST``).
"""

from __future__ import annotations

import math

import torch

from minillm.speedups.kernels.runtime import interpreting, load_triton

triton, tl = load_triton()


@triton.jit
def flash_forward_kernel(
    Q, K, V, O,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    n_heads, t_q, t_k, head_dim, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    block_m = tl.program_id(0)
    b = tl.program_id(1) // n_heads
    h = tl.program_id(1) % n_heads
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims[None, :] < head_dim

    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqt + dims[None, :],
                mask=(rows[:, None] < t_q) & dim_ok, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    offset = t_k - t_q  # causal: query row r sees keys 0 .. r + offset
    end = t_k
    if CAUSAL:
        end = tl.minimum((block_m + 1) * BLOCK_M + offset, t_k)
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        kv_mask = (keys[:, None] < t_k) & dim_ok
        k = tl.load(K + b * skb + h * skh + keys[:, None] * skt + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + h * svh + keys[:, None] * svt + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # scores in log2 units: exp(x) = exp2(x * log2(e)), and exp2 is the cheaper instruction
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = keys[None, :] < t_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * sot + dims[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < t_q) & dim_ok)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, block_m: int = 64, block_n: int = 64
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, T_q, d]`` over ``k``, ``v`` ``[B, H, T_k, d]`` by the Triton
    kernel. ``causal`` is bottom-right aligned, as in ``tiled_attention``. Block sizes must be
    powers of two, at least 16 (``tl.dot``'s smallest tile)."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"expected q [B, H, T_q, d] and k, v [B, H, T_k, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs at least as many keys as queries, got {k.shape[2]} for {q.shape[2]}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch, heads, t_q, d = q.shape
    out = torch.empty_like(q)
    grid = (triton.cdiv(t_q, block_m), batch * heads)
    flash_forward_kernel[grid](
        q, k, v, out,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, t_q, k.shape[2], d, math.log2(math.e) / math.sqrt(d),
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=interpreting(), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
