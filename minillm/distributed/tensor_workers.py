"""Tensor parallelism with processes: rank 0 drives, workers follow.

Rank 0 holds shard 0 of the model; each other rank is a worker process holding its own shard
(the shared bootstrap, step messages and worker caches are :mod:`minillm.distributed.workers`).
:class:`TensorParallelGPT` looks like a ``GPT`` to the engine. Every call to its
``hidden_states`` first sends the call (tokens, positions, the cache's layout) to each
worker, then runs shard 0; the workers run the same forward over their own heads, and the two
all-reduces per block inside it keep the ranks in step. The logits need no communication:
the output matrix is replicated, so rank 0 computes them alone from its (complete) hidden
state.

Public: :class:`TensorParallelGPT`. The checks and timings built on it are in
:mod:`minillm.distributed.tensor_measure`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, KVCache
from minillm.distributed.tensor import (
    ShardedGPT,
    check_splittable,
    check_tensor_parallel_size,
    shard_gpt,
    shard_state_dict,
)
from minillm.distributed.workers import Follower, ParallelModel, WorkerProcesses


class ShardFollower(Follower):
    """A worker's shard. A ``ValueError`` raised before any communication (a bad position,
    say) was raised on rank 0 too, at the same point: it is skipped, and the ranks stay in
    step. Anything else ends the worker."""

    def __init__(self, cfg: ModelConfig, state: dict, impl: str, rank: int, size: int, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        shard = ShardedGPT(cfg, rank, size, group).to(device, state["tok_emb.weight"].dtype)
        shard.load_state_dict(state)
        super().__init__(shard.set_attention(impl).eval())

    def forward(self, payload: tuple) -> None:
        tokens, positions, layout = payload
        calls = self.module.allreduce.calls
        try:
            self.module.hidden_states(tokens, positions, self.caches.build(layout))
        except ValueError:
            if self.module.allreduce.calls != calls:
                raise


class TensorParallelGPT(ParallelModel):
    """A ``GPT`` split over ``world_size`` processes, used from rank 0 as if it were a ``GPT``
    (see :class:`~minillm.distributed.workers.ParallelModel`); ``local`` is rank 0's
    :class:`~minillm.distributed.tensor.ShardedGPT`, whose ``cfg`` holds only its heads. The
    workers run with ``threads`` CPU threads each (by default this process's share)."""

    def __init__(self, model: GPT, world_size: int, *, threads: int | None = None) -> None:
        check_tensor_parallel_size(model.cfg, world_size)
        check_splittable(model)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        impl = model.blocks[0].attn.impl
        builders = [partial(ShardFollower, model.cfg, shard_state_dict(state, model.cfg, rank, world_size), impl)
                    for rank in range(1, world_size)]
        self.workers = WorkerProcesses("tensor-parallel worker", "tensor_parallel_size (--tensor-parallel-size)",
                                       "minillm-tp-rank", model.device, builders, threads)
        try:
            self.local = shard_gpt(model, 0, world_size, self.workers.group)
        except BaseException:
            self.close()
            raise
        self.world_size, self.full_cfg = world_size, model.cfg

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        self.workers.send(("forward", (tokens, positions, self.layout(cache))))
        return self.local.hidden_states(tokens, positions, cache)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if positions is not None:  # here, before any rank is told to run
            self.local.check_positions(positions)
        return self.logits(self.hidden_states(tokens, positions, cache))
