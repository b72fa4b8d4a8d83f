"""Tensor parallelism: one GPT split over N ranks, Megatron-LM style (Shoeybi et al., 2019).

A block's two matmul pairs split so that each rank computes without talking to the others
until the very end of the pair:

- attention: the QKV projection is split by **columns**, a whole number of heads per rank, so
  each rank computes queries, keys and values for its own heads and attends over them alone;
  the output projection is split by **rows** (the input features those heads produced), so
  each rank ends with a partial sum of the full ``d_model``-wide output;
- MLP: the first matrix is split by columns (``4d / N`` hidden units per rank; GELU acts on
  each unit alone, so it needs no communication), the second by rows, again a partial sum.

One all-reduce (sum) after each row-split projection turns the partial sums into the true
output on every rank: **two all-reduces per block**, each of ``d_model`` numbers per token.
Embeddings, LayerNorms and the tied output matrix are replicated, so every rank holds the
same residual stream and can compute the logits itself.

Each rank's KV cache holds only its own heads: ``ShardedGPT.cfg`` is the shape of *that
rank's* slice (``n_heads / N`` heads, ``d_model / N`` wide), so every cache sized from
``model.cfg`` (chapter 6's ``ContiguousKVCache``, chapter 8's ``PagedKVPool``) takes 1/N of
the memory per rank. That is half of why servers shard models: a model and a KV cache too
big for one GPU fit on N. The other half is speed on GPUs joined by a fast link: each rank
reads only 1/N of the *block* weights per step (the replicated output matrix it reads
whole: see :func:`weights_per_rank`), and a memory-bound decode step shrinks with them, until
the all-reduces' fixed latency, paid ``2 * n_layers`` times a step, dominates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, MLP, Block, CausalSelfAttention, TokenEmbedding


def check_tensor_parallel_size(cfg: ModelConfig, world_size: int) -> None:
    """Tensor parallelism splits whole heads, so ``world_size`` must divide ``n_heads``
    (then it also divides ``d_model`` and the MLP's ``4 * d_model``)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size (--tensor-parallel-size) must be an integer >= 1, got {world_size!r}")
    if cfg.n_heads % world_size:
        sizes = [n for n in range(1, cfg.n_heads + 1) if cfg.n_heads % n == 0]
        raise ValueError(
            f"tensor_parallel_size (--tensor-parallel-size) {world_size} must divide the model's "
            f"{cfg.n_heads} attention heads; choose one of {sizes}"
        )


def check_splittable(model: GPT, option: str = "tensor_parallel_size (--tensor-parallel-size)") -> None:
    """Splitting a model slices or moves its ``nn.Linear`` and ``nn.Embedding`` weights; a
    model whose layers were replaced (quantized, chapter 14) is refused, naming ``option``."""
    layers = [m for b in model.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)]
    if not all(type(m) is nn.Linear for m in layers) or type(model.tok_emb) is not TokenEmbedding:
        raise ValueError(
            f"{option} > 1 splits a float model's weights; "
            "this model's layers are quantized (--quantize): use one or the other"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape of one rank's slice: ``n_heads / N`` heads of the same ``head_dim``. A KV cache
    sized from it holds only this rank's keys and values."""
    check_tensor_parallel_size(cfg, world_size)
    return replace(cfg, d_model=cfg.d_model // world_size, n_heads=cfg.n_heads // world_size)


# ----------------------------------------------------------------------------- volume


@dataclass(frozen=True)
class AllReduceVolume:
    """What tensor parallelism sends, per generated or prefilled token.

    ``message_bytes`` is one all-reduce's tensor for one token (``d_model`` numbers). A ring
    all-reduce (reduce-scatter then all-gather) has each rank send, and receive,
    ``2 (N - 1) / N`` times the message; a block does two all-reduces.
    """

    world_size: int
    message_bytes: int
    allreduces_per_layer: int
    sent_per_rank_per_layer: int
    sent_per_rank: int  # the whole model, one token
    sent_all_ranks: int  # summed over the N ranks, one token


def allreduce_volume(cfg: ModelConfig, world_size: int, dtype: torch.dtype = torch.float32) -> AllReduceVolume:
    """Bytes on the wire per token for ``cfg`` split over ``world_size`` ranks in ``dtype``,
    counting a ring all-reduce; zero for one rank, which sends nothing."""
    check_tensor_parallel_size(cfg, world_size)
    message = cfg.d_model * dtype.itemsize
    per_layer = 2 * (2 * (world_size - 1) * message // world_size)
    return AllReduceVolume(
        world_size=world_size,
        message_bytes=message,
        allreduces_per_layer=2,
        sent_per_rank_per_layer=per_layer,
        sent_per_rank=cfg.n_layers * per_layer,
        sent_all_ranks=world_size * cfg.n_layers * per_layer,
    )


# ----------------------------------------------------------------------------- weights per rank


@dataclass(frozen=True)
class RankWeights:
    """The bytes of weights one rank holds, and reads in one decode step, against the whole model.

    Only the blocks' matrices (and their column-split biases) are divided among the ranks; the
    token table, which is also the tied output matrix, the position table, the LayerNorms and
    the row-split layers' biases are replicated whole on every rank. A decode step reads every
    weight once, except the position table, of which it looks up one row per sequence (not
    counted as read); the token table is read in full because it is the output matrix.
    """

    world_size: int
    whole_bytes: int  # the unsplit model's weights (the tied matrix once)
    rank_bytes: int  # what one rank holds
    whole_read_bytes: int  # what the unsplit model reads per decode step
    rank_read_bytes: int  # what one rank reads per decode step
    replicated_bytes: int  # of rank_bytes, what every rank holds in full
    embedding_bytes: int  # the tied token table / output matrix, replicated on every rank

    @property
    def read_share(self) -> float:
        """One rank's reads per decode step as a share of the whole model's."""
        return self.rank_read_bytes / self.whole_read_bytes

    @property
    def read_share_vocab_parallel(self) -> float:
        """:attr:`read_share` if the tied matrix were split by vocabulary rows as well
        (Megatron-LM's vocab-parallel embedding and head): ``1/N`` of it per rank."""
        split = self.embedding_bytes // self.world_size
        return (self.rank_read_bytes - self.embedding_bytes + split) / self.whole_read_bytes


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weights_per_rank(
    cfg: ModelConfig, world_size: int, dtype: torch.dtype = torch.float32,
    state: dict[str, torch.Tensor] | None = None,
) -> RankWeights:
    """Count, from :func:`shard_state_dict`'s real slices, the bytes of weights rank 0 of
    ``world_size`` holds and reads per decode step (every rank holds the same amount).

    ``state`` is a ``GPT`` state dict; without one, a ``GPT(cfg)`` in ``dtype`` is built on
    PyTorch's ``meta`` device (shapes only, no memory), so any shape can be counted.
    """
    if state is None:
        with torch.device("meta"):
            state = GPT(cfg).to(dtype).state_dict()
    shard = shard_state_dict(state, cfg, 0, world_size)
    unread = "pos_emb.weight"  # one row per sequence per step
    return RankWeights(
        world_size=world_size,
        whole_bytes=_nbytes(state.values()),
        rank_bytes=_nbytes(shard.values()),
        whole_read_bytes=_nbytes(v for k, v in state.items() if k != unread),
        rank_read_bytes=_nbytes(v for k, v in shard.items() if k != unread),
        replicated_bytes=_nbytes(v for k, v in shard.items() if v.shape == state[k].shape),
        embedding_bytes=_nbytes([state["tok_emb.weight"]]),
    )


# ----------------------------------------------------------------------------- sharding


def _chunk(n: int, rank: int, world_size: int) -> slice:
    size = n // world_size
    return slice(rank * size, (rank + 1) * size)


def shard_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of a ``GPT`` state dict (same keys, smaller tensors).

    ``nn.Linear`` keeps its weight as ``[out, in]``, so a column split of the matmul (split
    outputs) takes *rows* of the weight, and a row split (split inputs) takes its *columns*.
    The QKV weight's rows are ``[q heads | k heads | v heads]``: this rank's heads are taken
    from each third. Row-split layers keep their whole bias: it is added once, after the sum.
    """
    check_tensor_parallel_size(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    d, hd = cfg.d_model, cfg.head_dim
    heads = _chunk(cfg.n_heads, rank, world_size)
    cols = _chunk(d, rank, world_size)
    hidden = _chunk(4 * d, rank, world_size)
    out = {}
    for key, value in state.items():
        if key.endswith("attn.qkv.weight"):
            value = value.view(3, cfg.n_heads, hd, d)[:, heads].reshape(-1, d)
        elif key.endswith("attn.qkv.bias"):
            value = value.view(3, cfg.n_heads, hd)[:, heads].reshape(-1)
        elif key.endswith("attn.proj.weight"):
            value = value[:, cols]
        elif key.endswith("mlp.fc.weight") or key.endswith("mlp.fc.bias"):
            value = value[hidden]
        elif key.endswith("mlp.proj.weight"):
            value = value[:, hidden]
        out[key] = value.clone()  # own storage: a view would carry (and pickle) the whole tensor
    return out


# ----------------------------------------------------------------------------- the model


class AllReduce:
    """Sums a tensor over the ranks of ``group`` in place, keeping count of the calls, the
    bytes of the tensors reduced and the seconds spent waiting for them."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None or self.group.size() == 1:
            return x
        start = time.perf_counter()
        self.group.allreduce([x]).wait()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        return x


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_r @ W_r^T``, then the bias once: a linear layer whose input
    features are split over the ranks. Its all-reduce is the only communication in a block."""

    def __init__(self, in_features: int, out_features: int, allreduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        self.allreduce = allreduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.allreduce(F.linear(x, self.weight).contiguous()) + self.bias


class ParallelAttention(nn.Module):
    """This rank's heads: queries, keys and values for them, attention over them (through
    the cache, which holds only them), and a row-split output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, world_size: int, allreduce: AllReduce) -> None:
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, cfg.n_heads // world_size, cfg.head_dim
        width = self.n_heads * self.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * width)
        self.proj = RowParallelLinear(width, cfg.d_model, allreduce)
        self.dropout = nn.Dropout(cfg.dropout)
        self.impl = "sdpa"

    forward = CausalSelfAttention.forward  # the same computation, on this rank's heads


class ParallelMLP(nn.Module):
    """``4d / N`` of the MLP's hidden units: a column-split first matrix, a row-split second."""

    def __init__(self, cfg: ModelConfig, world_size: int, allreduce: AllReduce) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model // world_size)
        self.proj = RowParallelLinear(4 * cfg.d_model // world_size, cfg.d_model, allreduce)
        self.dropout = nn.Dropout(cfg.dropout)

    forward = MLP.forward  # the same computation, on this rank's hidden units


class ParallelBlock(nn.Module):
    """A pre-LayerNorm block with the attention and MLP above; LayerNorms replicated."""

    def __init__(self, cfg: ModelConfig, layer: int, world_size: int, allreduce: AllReduce) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = ParallelAttention(cfg, layer, world_size, allreduce)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = ParallelMLP(cfg, world_size, allreduce)

    forward = Block.forward


class ShardedGPT(nn.Module):
    """Rank ``rank`` of ``world_size``'s part of a :class:`~minillm.model.gpt.GPT`.

    Its forward is ``GPT``'s own (the methods are shared, not copied); only the blocks
    differ. Every rank of a group must call it with the same tokens, positions and cache
    layout, in the same order, since their all-reduces pair up. ``cfg`` is this rank's
    slice (see :func:`shard_config`), ``full_cfg`` the whole model's.
    """

    def __init__(self, cfg: ModelConfig, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.full_cfg, self.cfg = cfg, shard_config(cfg, world_size)
        self.rank, self.world_size = rank, world_size
        self.allreduce = AllReduce(group)
        self.tok_emb = TokenEmbedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(ParallelBlock(cfg, i, world_size, self.allreduce) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    device = GPT.device
    dtype = GPT.dtype
    set_attention = GPT.set_attention
    check_positions = GPT.check_positions
    hidden_states = GPT.hidden_states
    logits = GPT.logits
    forward = GPT.forward

