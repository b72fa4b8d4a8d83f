"""Pipeline parallelism with processes: rank 0 drives and holds stage 0, workers hold the rest.

The bootstrap is tensor parallelism's (:mod:`minillm.distributed.workers`); what differs is
what flows between the ranks: no all-reduce, but one hidden state handed from stage to stage,
point to point, and from the last stage home to rank 0 for the head.

:meth:`PipelineParallelGPT.launch` runs stage 0 and hands its output on, then returns at once
with a :class:`PendingForward`; :meth:`PendingForward.wait` receives the result. Between the
two, rank 0 is free to launch the next micro-batch, which is how :class:`PipelinedEngine`
keeps every stage busy. Each stage works through micro-batches in the order they were
launched, so the layouts on the pipes and the tensors on the links pair up without tags.

A worker exits when its pipe closes (rank 0 stopped or died); a worker that dies closes its
sockets, so its neighbours' next receive fails instead of waiting forever.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import partial

import torch

from minillm.data.tokenizer import Tokenizer
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine, RequestOutput, Speedups
from minillm.engine.model_runner import PreparedStep
from minillm.model.gpt import GPT, KVCache
from minillm.distributed.tensor import check_splittable
from minillm.distributed.follower import Follower
from minillm.distributed.workers import ParallelModel
from minillm.distributed.pipeline import (
    PipelineStage,
    StageStats,
    check_pipeline_parallel_size,
    stage_config,
    stage_layers,
    stage_state_dict,
)


class StageFollower(Follower):
    """A worker stage: for each launched forward, receive the previous stage's output, run its
    blocks and send the result on (the last stage sends it home to rank 0)."""

    sending = None  # the previous forward's send

    def forward(self, payload: tuple) -> None:
        shape, layout = payload
        stage = self.module
        x = stage.link.recv((*shape, stage.full_cfg.d_model), stage.dtype, stage.device, stage.rank - 1)
        out = stage.run(x, None, self.caches.build(layout))
        if self.sending is not None:
            self.sending.wait()  # the previous output has left: its buffer may go
        self.sending = stage.link.send(out, (stage.rank + 1) % stage.size)

    def stats(self, _: None) -> StageStats:
        return self.module.stats()

    def reset(self, _: None) -> None:
        self.module.reset()


@dataclass
class PendingForward:
    """A forward launched down the pipeline: :meth:`wait` returns its final hidden states."""

    owner: PipelineParallelGPT
    shape: tuple[int, ...]
    output: torch.Tensor  # stage 0's output: its buffer must outlive the send
    sending: object | None  # that send (None with a single stage)

    def wait(self) -> torch.Tensor:
        return self.owner.receive(self)


class PipelineParallelGPT(ParallelModel):
    """A ``GPT`` whose blocks are split into ``size`` stages (:func:`stage_layers`), stage 0
    (``local``) in this process and one worker process of ``threads`` threads per other stage;
    used from rank 0 as a ``GPT`` (see :class:`~minillm.distributed.workers.ParallelModel`).

    ``cfg`` is stage 0's shape (its own layers; the engine's pool on rank 0 holds only those),
    ``largest_stage_cfg`` the shape with the most layers, from which every stage's number of
    KV blocks is sized (block tables are shared, so every pool has the same number of
    blocks). :meth:`launch` / :meth:`PendingForward.wait` keep several forwards in flight;
    :meth:`stage_stats` reads every stage's counters.
    """

    def __init__(self, model: GPT, size: int, *, threads: int | None = None, settings: dict | None = None) -> None:
        check_pipeline_parallel_size(model.cfg, size)
        option = "pipeline_parallel_size (--pipeline-parallel-size)"
        check_splittable(model, option)
        self.layers = stage_layers(model.cfg, size)
        self.num_stages, self.full_cfg = size, model.cfg
        self.largest_stage_cfg = stage_config(model.cfg, max(self.layers, key=len))
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        states = [stage_state_dict(state, layers, rank, size) for rank, layers in enumerate(self.layers)]
        parts = [partial(PipelineStage, model.cfg, layers) for layers in self.layers]
        self._start(model, StageFollower, parts, states, "pipeline stage", option, threads, settings)
        self._in_flight: list[PendingForward] = []

    def receive(self, pending: PendingForward) -> torch.Tensor:
        """``pending``'s final hidden states, from the last stage (forwards are received in the
        order they were launched)."""
        if not self._in_flight or self._in_flight[0] is not pending:
            raise RuntimeError("pipelined forwards must be waited for in the order they were launched")
        self._in_flight.pop(0)
        if pending.sending is None:
            return pending.output
        link = self.local.link
        try:
            start = time.perf_counter()
            pending.sending.wait()
            link.wait_seconds += time.perf_counter() - start
            return link.recv((*pending.shape, self.full_cfg.d_model), self.dtype, self.device, self.num_stages - 1)
        except RuntimeError as err:  # a peer's socket closed under us
            raise self.workers.lost(err) from None

    def launch(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               cache: KVCache | None = None) -> PendingForward:
        """Start a forward: run stage 0, then tell every stage the layout and send stage 0's
        output on. Returns before the later stages have finished; forwards complete in launch
        order. Stage 0 runs first so that if it raises, no stage has been told anything and
        the stages stay in step."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
        if positions is None and tokens.shape[1] > self.full_cfg.context_length:
            raise ValueError(f"{tokens.shape[1]} tokens are beyond the model's context of {self.full_cfg.context_length}")
        layout = self.layout(cache)
        out = self.local.run(tokens, positions, cache)
        self.workers.send(("forward", (tuple(tokens.shape), layout)))
        try:
            sending = None if self.num_stages == 1 else self.local.link.send(out, 1)
        except RuntimeError as err:
            raise self.workers.lost(err) from None
        self._in_flight.append(PendingForward(self, tuple(tokens.shape), out, sending))
        return self._in_flight[-1]

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """The final normalised hidden states, one forward through every stage."""
        return self.launch(tokens, positions, cache).wait()

    def stage_stats(self) -> list[StageStats]:
        """Every stage's counters, rank 0 first. Rank 0's wait is its time in :meth:`wait`."""
        self.workers.send(("stats", None))
        return [self.local.stats()] + self.workers.receive_all()

    def reset_stats(self) -> None:
        self.local.reset()
        self.workers.send(("reset", None))


class PipelinedEngine(LLMEngine):
    """The engine over a :class:`PipelineParallelGPT` with ``config.micro_batches`` batches in
    flight, so that while stage 1 works on one micro-batch, rank 0 computes stage 0 of the
    next. ``build_engine`` makes it when ``pipeline_parallel_size > 1`` asks for more than one
    micro-batch; the step loop, scheduler and runner are the plain engine's, only driven
    several steps deep.

    Each :meth:`step` tops the pipeline up, then finishes the oldest micro-batch. A new
    micro-batch is scheduled from the sequences not already in flight, with an even share of
    the unfinished requests, so the micro-batches come out of similar size. Sequences in
    flight are never preempted (their keys are still being written): the scheduler takes its
    victims from the others, or waits."""

    def __init__(self, model: PipelineParallelGPT, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 speedups: Speedups | None = None) -> None:
        super().__init__(model, config, tokenizer, speedups)
        self._in_flight: deque[PreparedStep] = deque()  # oldest first

    def step(self) -> list[RequestOutput]:
        depth = self.config.micro_batches
        while len(self._in_flight) < depth:
            busy = frozenset(c.seq for launched in self._in_flight for c in launched.output.chunks)
            share = -(-(len(self.scheduler.running) + self.scheduler.num_waiting) // depth)
            output = self.scheduler.schedule(time.monotonic(), busy=busy, max_seqs=max(1, share))
            if output.is_empty:
                break
            self.last_step = output
            self._in_flight.append(self.runner.launch(output))
        if not self._in_flight:
            return []
        launched = self._in_flight.popleft()
        return self._finish_step(launched.output, self.runner.collect(launched))

    @property
    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a micro-batch still in flight (even an aborted one's)."""
        return super().has_unfinished or bool(self._in_flight)
