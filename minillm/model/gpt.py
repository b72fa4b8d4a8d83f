"""The GPT: a GPT-2-architecture decoder, written by hand, in one file.

Tokens and positions become vectors (two embedding tables, added); a stack of pre-LayerNorm
blocks mixes them, each block being causal multi-head self-attention then a 4x GELU MLP, both
with residual connections; a final LayerNorm and the token embedding, reused as the output
matrix ("tied"), turn each position's vector into logits over the vocabulary.

The one idea later chapters rely on: attention does not own its keys and values. Given no
cache, a layer attends causally over the tokens it was given. Given a cache (anything with an
``attend(layer, q, k, v)`` method), the layer hands its new queries, keys and values to the
cache, which stores the keys and values wherever it keeps them (a contiguous tensor, paged
blocks) and returns the attention output. So the naive loop, the KV cache and the paged
engine all run this same ``forward``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from minillm.model.losses import linear_cross_entropy


class KVCache(Protocol):
    """Where a layer's keys and values live between forward passes (chapter 6 onwards)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``, ``v`` ([batch, heads, new, head_dim]) for ``layer``, then return the
        attention of ``q`` over every key and value the sequence has so far, same shape as ``q``."""
        ...


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention spelled out: scores, mask, softmax, weighted sum.

    ``q`` holds the *last* ``Tq`` positions of a sequence whose keys and values ``k``, ``v``
    cover all ``Tk`` positions, so query ``i`` sits at position ``Tk - Tq + i`` and may look at
    keys ``0 .. Tk - Tq + i``. With ``Tq == Tk`` this is ordinary causal attention; with
    ``Tq == 1`` it is one decoding step, which may look at everything.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same as :func:`explicit_attention`, through PyTorch's fused kernel (FlashAttention or
    memory-efficient attention where the device has one), which never stores the scores."""
    tq, tk = q.shape[-2], k.shape[-2]
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if tq == 1:  # one new token sees every key: no mask at all
        return F.scaled_dot_product_attention(q, k, v)
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


ATTENTION = {"explicit": explicit_attention, "sdpa": fused_attention}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with one fused projection for queries, keys and values."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.impl = "sdpa"

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # [b, t, 3d] -> three [b, heads, t, head_dim] tensors
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = ATTENTION[self.impl](q, k, v) if cache is None else cache.attend(self.layer, q, k, v)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)))


class MLP(nn.Module):
    """Position-wise feed-forward: widen 4x, GELU (GPT-2's tanh form), narrow back."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Embedding):
    """The token table, used twice: rows looked up on the way in, and (tied) the output matrix
    on the way out, which is :meth:`project`, and in training :meth:`cross_entropy`, the
    output matrix fused with the loss. A quantized table (``minillm.speedups.quant``) keeps the same
    contract over packed integers."""

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vectors ``[..., d_model]`` to vocabulary scores ``[..., vocab]``."""
        return F.linear(hidden, self.weight)

    def cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of :meth:`project`'s scores against ``targets``, without building them
        (:mod:`minillm.model.losses`)."""
        return linear_cross_entropy(hidden, self.weight, targets)


class GPT(nn.Module):
    """The whole model. ``model(tokens)`` gives logits ``[batch, time, vocab]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.apply(self._init_weights)
        # GPT-2's scaling: each residual branch's output projection starts smaller, so the sum
        # of 2 * n_layers branches keeps the residual stream's variance near 1.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        """Where the model lives. Read from the position table, which stays a float matrix
        even in a quantized model (whose token table holds packed integers)."""
        return self.pos_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, and so the KV cache's."""
        return self.pos_emb.weight.dtype

    def set_attention(self, impl: str) -> "GPT":
        """Choose ``"sdpa"`` (fused, the default) or ``"explicit"`` (readable) attention."""
        if impl not in ATTENTION:
            raise ValueError(f"attention must be one of {list(ATTENTION)}, not {impl!r}")
        for block in self.blocks:
            block.attn.impl = impl
        return self

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """The final normalised vectors ``[batch, time, d_model]``, before the output matrix.

        ``positions`` defaults to ``0 .. time-1``; a cache passes the true positions of the new
        tokens (e.g. ``[[17]]`` for the 18th token of a sequence). Given positions are trusted:
        reading their largest value would make a GPU wait for the queue to drain, at every
        step, so they are checked where they are made (the engine's from sequences that never
        outgrow the context; :meth:`forward` checks its caller's).
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
        if positions is None:
            if tokens.shape[1] > self.cfg.context_length:
                raise ValueError(f"{tokens.shape[1]} tokens are beyond the model's context of {self.cfg.context_length}")
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.dropout(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x, cache)
        return self.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vectors to vocabulary scores through the tied token embedding."""
        return self.tok_emb.project(hidden)

    def check_positions(self, positions: torch.Tensor) -> None:
        """A ``ValueError`` for a position with no row in the position table (one host sync)."""
        if positions.numel() and int(positions.max()) >= self.cfg.context_length:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context of {self.cfg.context_length} tokens"
            )

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, time, vocab]``; given ``targets`` (each position's next token, the
        shape of ``tokens``), the mean cross-entropy instead. Training asks for the loss here,
        as nanoGPT does, so that DistributedDataParallel and ``torch.compile`` see one forward,
        and so the output layer and the loss can be fused (:mod:`minillm.model.losses`): the full
        ``[batch, time, vocab]`` logits are never built."""
        if positions is not None:
            self.check_positions(positions)
        hidden = self.hidden_states(tokens, positions, cache)
        if targets is None:
            return self.logits(hidden)
        return self.tok_emb.cross_entropy(hidden, targets)


# ----------------------------------------------------------------------------- counting


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of :class:`GPT` from its shape alone (the tied embedding counted once).

    Per block: two LayerNorms (2d each), the QKV projection (3d^2 + 3d), the output
    projection (d^2 + d), and the MLP (4d^2 + 4d and 4d^2 + d): 12d^2 + 13d.
    """
    d = cfg.d_model
    return cfg.vocab_size * d + cfg.context_length * d + cfg.n_layers * (12 * d * d + 13 * d) + 2 * d


def matmul_parameters(cfg: ModelConfig) -> int:
    """The weights that take part in a matrix multiply for every token: each block's 12d^2 and
    the output matrix (the tied embedding). This is the ``N`` of "2N FLOPs per token"; the
    position table, biases and LayerNorms add well under 1% more."""
    return cfg.n_layers * 12 * cfg.d_model**2 + cfg.vocab_size * cfg.d_model


def inference_flops_per_token(cfg: ModelConfig, context: int) -> int:
    """Forward FLOPs for one token that attends to ``context`` positions: 2 per matmul weight
    (a multiply and an add), plus attention's ``q @ k`` and ``weights @ v``, 2 * context * d each
    per layer."""
    return 2 * matmul_parameters(cfg) + 4 * cfg.n_layers * context * cfg.d_model


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward plus backward FLOPs per trained token: the backward pass costs two forwards
    (gradients with respect to inputs and to weights), hence 6N, plus attention at every
    position of a ``seq_len`` sequence, counted in full as the kernels compute it."""
    return 3 * inference_flops_per_token(cfg, seq_len)
