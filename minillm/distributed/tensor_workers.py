"""Tensor parallelism with processes: rank 0 holds shard 0, a worker process each other shard.

Every forward is sent to the workers (:mod:`minillm.distributed.workers`), then run on shard 0;
the two all-reduces per block inside it keep the ranks in step. The logits need no
communication: the output matrix is replicated, so rank 0 computes them from its (complete)
hidden state.
"""

from __future__ import annotations

from functools import partial

import torch

from minillm.model.gpt import GPT, KVCache
from minillm.distributed.tensor import ShardedGPT, check_splittable, check_tensor_parallel_size, shard_state_dict
from minillm.distributed.follower import Follower
from minillm.distributed.workers import ParallelModel


class ShardFollower(Follower):
    """A worker's shard. A ``ValueError`` raised before any communication (a bad position,
    say) was raised on rank 0 too, at the same point: it is skipped, and the ranks stay in
    step. Anything else ends the worker."""

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
    workers run with ``threads`` CPU threads each (by default this process's share); under
    torchrun they are the launch's other ranks, whose ``settings`` must equal these."""

    def __init__(self, model: GPT, world_size: int, *, threads: int | None = None,
                 settings: dict | None = None) -> None:
        check_tensor_parallel_size(model.cfg, world_size)
        check_splittable(model)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        states = [shard_state_dict(state, model.cfg, rank, world_size) for rank in range(world_size)]
        self._start(model, ShardFollower, [partial(ShardedGPT, model.cfg)] * world_size, states,
                    "tensor-parallel worker", "tensor_parallel_size (--tensor-parallel-size)", threads, settings)
        self.world_size, self.full_cfg = world_size, model.cfg

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        self.workers.send(("forward", (tokens, positions, self.layout(cache))))
        try:
            return self.local.hidden_states(tokens, positions, cache)
        except ValueError:  # refused before any all-reduce, on every rank alike (see ShardFollower)
            raise
        except RuntimeError as err:  # an all-reduce failed: a peer is gone, or the ranks are out of step
            raise self.workers.lost(err) from None
