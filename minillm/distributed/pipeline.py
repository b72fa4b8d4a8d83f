"""Pipeline parallelism: one GPT's blocks split into contiguous stages, one process each.

Tensor parallelism (:mod:`minillm.distributed.tensor`) cuts every block across the ranks, so the ranks
must all-reduce twice per block. Pipeline parallelism (GPipe, Huang et al., 2019; the
schedule Megatron-LM interleaves) instead gives each rank whole blocks: rank 0 runs the
first few, hands the hidden state (``d_model`` numbers per token) to rank 1, which runs the
next few, and so on. Nothing else crosses a boundary, so it asks far less of the link; in
exchange one token's trip visits the stages one after another, so a lone batch keeps only
one stage busy at a time (the *bubble*), and only several micro-batches in flight fill it.

Where the ends go. The first stage holds the token and position tables, the last the final
LayerNorm. The output matrix is the token table itself (tied), and the engine samples on
rank 0, where each request's state lives (its penalties, grammar and seed); so
the last stage sends its normalised hidden states home to rank 0, which applies the head:
a ring of ``N`` hops per token, ``d_model`` numbers each. Sending logits instead would move
``vocab_size`` numbers per token (262 times as many on the ``cpu`` preset), and a copy of the
table on the last stage, as vLLM keeps, would hold the largest matrix twice.

So rank 0 pays for the head, a ``vocab x d_model`` matmul: on the small presets it outweighs
all the blocks. :func:`stage_layers` therefore splits by weight, not by layer count: rank 0
counts the head, and takes as few blocks as keeps the heaviest stage light (at least one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, Block, KVCache, TokenEmbedding


def check_pipeline_parallel_size(cfg: ModelConfig, size: int) -> None:
    """Every stage holds at least one block, so ``size`` runs from 1 to ``n_layers``."""
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= cfg.n_layers:
        raise ValueError(
            f"pipeline_parallel_size (--pipeline-parallel-size) must be an integer from 1 to the model's "
            f"{cfg.n_layers} layers (each stage holds at least one), got {size!r}"
        )


def stage_weights(cfg: ModelConfig, layers: list[range]) -> list[int]:
    """The matmul weights each stage reads for every token: its blocks' ``12 d^2`` each, and
    on rank 0 the output matrix (``vocab x d``) as well."""
    head = cfg.vocab_size * cfg.d_model
    return [len(r) * 12 * cfg.d_model**2 + (head if i == 0 else 0) for i, r in enumerate(layers)]


def stage_layers(cfg: ModelConfig, size: int) -> list[range]:
    """Contiguous blocks per stage, chosen so that the heaviest stage (by
    :func:`stage_weights`) is as light as it can be, each stage holding at least one block.
    With the head on rank 0 that gives rank 0 the fewest blocks; ties go to the earliest
    split (later stages a little heavier). A small exhaustive search: ``size * n_layers^2``."""
    check_pipeline_parallel_size(cfg, size)
    n, head, block = cfg.n_layers, cfg.vocab_size * cfg.d_model, 12 * cfg.d_model**2
    # best[s][j]: the lightest heaviest-stage for blocks j.. over stages s.., with the cut
    best = [[(float("inf"), -1)] * (n + 1) for _ in range(size + 1)]
    best[size][n] = (0, n)
    for s in range(size - 1, -1, -1):
        for j in range(n):
            for k in range(j + 1, n - (size - s - 1) + 1):
                cost = (k - j) * block + (head if s == 0 else 0)
                worst = max(cost, best[s + 1][k][0])
                if worst < best[s][j][0]:
                    best[s][j] = (worst, k)
    layers, j = [], 0
    for s in range(size):
        k = best[s][j][1]
        layers.append(range(j, k))
        j = k
    return layers


def stage_config(cfg: ModelConfig, layers: range) -> ModelConfig:
    """A stage's shape: the model's, with only its own layers (what its KV pool holds)."""
    return replace(cfg, n_layers=len(layers))


@dataclass(frozen=True)
class PipelineVolume:
    """What pipeline parallelism sends per token: one hidden state per hop, ``N`` hops in the
    ring (``N - 1`` boundaries, and the last stage's output home to rank 0 for the head)."""

    stages: int
    message_bytes: int  # one token's hidden state
    hops: int
    sent_per_token: int  # summed over the stages


def pipeline_volume(cfg: ModelConfig, size: int, dtype: torch.dtype = torch.float32) -> PipelineVolume:
    """Bytes on the wire per token for ``cfg`` in ``size`` stages; zero for one stage."""
    check_pipeline_parallel_size(cfg, size)
    message = cfg.d_model * dtype.itemsize
    hops = size if size > 1 else 0
    return PipelineVolume(stages=size, message_bytes=message, hops=hops, sent_per_token=hops * message)


def stage_state_dict(state: dict[str, torch.Tensor], layers: range, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Stage ``rank``'s weights from a ``GPT`` state dict: its blocks, renumbered from 0 (its KV
    pool holds only them), the tables on rank 0 and the final LayerNorm on the last stage."""
    out = {}
    for key, value in state.items():
        if key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            if int(index) in layers:
                out[f"blocks.{int(index) - layers.start}.{rest}"] = value.clone()
        elif key.startswith(("tok_emb.", "pos_emb.")) and rank == 0:
            out[key] = value.clone()
        elif key.startswith("ln_f.") and rank == size - 1:
            out[key] = value.clone()
    return out


class PointToPoint:
    """Sends and receives whole tensors to and from one stage's neighbours in ``group``,
    keeping count of the bytes sent and the seconds spent waiting to receive."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        self.sends, self.bytes_sent, self.wait_seconds = 0, 0, 0.0

    def send(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Start sending ``x`` (which must stay alive until the returned work is waited for)."""
        self.sends += 1
        self.bytes_sent += x.numel() * x.element_size()
        return self.group.send([x], dst, 0)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        self.group.recv([out], src, 0).wait()
        self.wait_seconds += time.perf_counter() - start
        return out


@dataclass
class StageStats:
    """One stage's counters since the last reset: seconds computing its blocks, seconds
    waiting to receive its input, hidden states sent and their bytes, forwards run."""

    rank: int
    layers: range
    busy_seconds: float
    wait_seconds: float
    sends: int
    bytes_sent: int
    forwards: int


class PipelineStage(nn.Module):
    """Stage ``rank`` of ``size``: its blocks, plus the tables (rank 0) and the final
    LayerNorm (the last stage). :meth:`run` takes token ids on rank 0 and a hidden state
    elsewhere; the last stage returns normalised hidden states, which rank 0's :meth:`logits`
    turns into scores. ``cfg`` is the stage's shape (:func:`stage_config`), ``full_cfg`` the
    whole model's; ``link`` talks to its neighbours in ``group``."""

    def __init__(self, cfg: ModelConfig, layers: range, rank: int, size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.full_cfg, self.cfg = cfg, stage_config(cfg, layers)
        self.layers, self.rank, self.size = layers, rank, size
        self.is_first, self.is_last = rank == 0, rank == size - 1
        if self.is_first:
            self.tok_emb = TokenEmbedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(len(layers)))
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.link = PointToPoint(group)
        self.busy_seconds, self.forwards = 0.0, 0

    @property
    def device(self) -> torch.device:
        return self.blocks[0].ln1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].ln1.weight.dtype

    set_attention = GPT.set_attention
    check_positions = GPT.check_positions

    def run(self, x: torch.Tensor, positions: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """This stage's part of ``GPT.hidden_states``: on rank 0 ``x`` is ``[batch, time]``
        token ids (embedded at ``positions``, ``0..time-1`` by default), elsewhere the
        previous stage's ``[batch, time, d_model]`` output. Counted in :meth:`stats`."""
        start = time.perf_counter()
        if self.is_first:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x, cache)
        x = (self.ln_f(x) if self.is_last else x).contiguous()
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        self.busy_seconds += time.perf_counter() - start
        self.forwards += 1
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rank 0 only: the tied output matrix over the last stage's normalised states."""
        return self.tok_emb.project(hidden)

    def stats(self) -> StageStats:
        link = self.link
        return StageStats(self.rank, self.layers, self.busy_seconds, link.wait_seconds, link.sends,
                          link.bytes_sent, self.forwards)

    def reset(self) -> None:
        self.busy_seconds, self.forwards = 0.0, 0
        self.link.reset()
