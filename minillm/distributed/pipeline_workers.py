"""Pipeline parallelism with processes: rank 0 drives and holds stage 0, workers hold the rest.

As with tensor parallelism (:mod:`minillm.distributed.tensor_workers`, whose messages and worker caches
this reuses), the scheduler, sampling and detokenizing stay on rank 0, and each worker
learns a step's *layout* (slot mapping, block tables, masks) from a pipe. What differs is
what flows between the ranks: no all-reduce, but one hidden state handed from stage to
stage, point to point, and from the last stage home to rank 0 for the head.

:meth:`PipelineParallelGPT.launch` runs stage 0 and hands its output on, then returns at once
with a :class:`PendingForward`; :meth:`PendingForward.wait` receives the result. Between the
two, rank 0 is free to launch the next micro-batch, which is how the engine keeps every
stage busy (``LLMEngine`` with ``pipeline_parallel_size > 1``). Each stage works through
micro-batches in the order they were launched, so the layouts on the pipes and the tensors
on the links pair up without tags. ``hidden_states`` is the two together, for callers that
want one forward at a time.

A worker exits when its pipe closes (rank 0 stopped or died); a worker that dies closes its
sockets, so its neighbours' next receive fails instead of waiting forever.
"""

from __future__ import annotations

import pickle
import signal
import time
from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, KVCache
from minillm.distributed.tensor import check_splittable, make_group, rendezvous
from minillm.distributed.tensor_workers import WorkerCaches, WorkerProcesses, cache_layout, set_worker_device
from minillm.distributed.pipeline import (
    PipelineStage,
    PointToPoint,
    build_stage,
    check_pipeline_parallel_size,
    stage_config,
    stage_layers,
    stage_state_dict,
)


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


def _worker_main(rank: int, size: int, port: int, backend: str, device: str, cfg: ModelConfig, layers: range,
                 state: dict, impl: str, threads: int, conn) -> None:
    """A worker stage's whole life: join the group, build the stage, then for each launched
    forward receive the previous stage's output, run its blocks and send the result on (the
    last stage sends it home to rank 0), until the pipe says stop or closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: rank 0 decides
    worker_device = set_worker_device(device)
    torch.set_num_threads(threads)
    group, _store = make_group(backend, rank, size, port)
    link = PointToPoint(group)
    stage = PipelineStage(cfg, layers, rank, size).to(worker_device, state["blocks.0.ln1.weight"].dtype)
    stage.load_state_dict(state)
    stage.set_attention(impl).eval()
    caches = WorkerCaches(stage)
    busy, forwards, sending = 0.0, 0, None
    conn.send("ready")
    with torch.inference_mode():
        while True:
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 closed the pipe or died
                return
            if kind == "stop":
                return
            if kind == "attention":
                stage.set_attention(payload)
            elif kind == "stats":
                conn.send(StageStats(rank, layers, busy, link.wait_seconds, link.sends, link.bytes_sent, forwards))
            elif kind == "reset":
                busy, forwards = 0.0, 0
                link.reset()
            else:
                shape, layout = payload
                x = link.recv((*shape, cfg.d_model), stage.dtype, worker_device, rank - 1)
                start = time.perf_counter()
                out = stage.run(x, None, caches.build(layout)).contiguous()
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                busy += time.perf_counter() - start
                forwards += 1
                if sending is not None:
                    sending.wait()  # the previous output has left: its buffer may go
                sending = link.send(out, (rank + 1) % size)


@dataclass
class PendingForward:
    """A forward launched down the pipeline: :meth:`wait` returns its final hidden states."""

    owner: PipelineParallelGPT
    shape: tuple[int, ...]
    output: torch.Tensor  # stage 0's output: its buffer must outlive the send
    sending: object | None  # that send (None with a single stage)

    def wait(self) -> torch.Tensor:
        return self.owner._receive(self)


class PipelineParallelGPT:
    """A ``GPT`` whose blocks are split into ``size`` stages (:func:`stage_layers`), stage 0
    in this process and one worker process per other stage; used from rank 0 as a ``GPT``.

    ``cfg`` is stage 0's shape (its own layers; the engine's pool on rank 0 holds only those),
    ``largest_stage_cfg`` the shape with the most layers, from which every stage's number of
    KV blocks is sized (block tables are shared, so every pool has the same number of
    blocks). :meth:`launch` / :meth:`PendingForward.wait` keep several forwards in flight;
    :meth:`stage_stats` reads every stage's counters. ``close()`` (or ``with``) stops the
    workers, as does garbage collection or this process's exit.
    """

    def __init__(self, model: GPT, size: int, *, threads: int | None = None) -> None:
        check_pipeline_parallel_size(model.cfg, size)
        check_splittable(model, "pipeline_parallel_size (--pipeline-parallel-size)")
        device = model.device
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"pipeline_parallel_size (--pipeline-parallel-size) {size} needs {size} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        threads = threads or max(1, torch.get_num_threads() // size)
        self.layers = stage_layers(model.cfg, size)
        self.size, self.full_cfg = size, model.cfg
        self.largest_stage_cfg = stage_config(model.cfg, max(self.layers, key=len))
        self._store = rendezvous(size) if size > 1 else None
        self.workers = WorkerProcesses("pipeline stage")
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        impl = model.blocks[0].attn.impl
        try:
            for rank in range(1, size):
                stage_state = stage_state_dict(state, self.layers[rank], rank, size)
                self._spawn(rank, backend, model.cfg, stage_state, impl, threads)
            self.link = None
            if size > 1:
                group, _ = make_group(backend, 0, size, self._store)
                self.link = PointToPoint(group)
            self.stage = build_stage(model, self.layers, 0)
            self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        self._cache_key, self._last_cache = 0, None
        self._in_flight: list[PendingForward] = []
        self.busy_seconds, self.forwards = 0.0, 0

    def _spawn(self, rank: int, backend: str, cfg: ModelConfig, state: dict, impl: str, threads: int) -> None:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        self.workers.spawn(_worker_main, (rank, self.size, self._store.port, backend, device, cfg, self.layers[rank],
                                          state, impl, threads), name=f"minillm-pp-stage{rank}")

    # -- what the engine sees

    @property
    def num_stages(self) -> int:
        return self.size

    @property
    def cfg(self) -> ModelConfig:
        return self.stage.cfg

    @property
    def device(self) -> torch.device:
        return self.stage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stage.dtype

    def eval(self) -> PipelineParallelGPT:
        """Stages are always in eval mode; here so the engine can call it as on a ``GPT``."""
        return self

    def set_attention(self, impl: str) -> PipelineParallelGPT:
        self.stage.set_attention(impl)
        self.workers.send(("attention", impl))
        return self

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
        if cache is not None and cache is not self._last_cache:
            self._cache_key, self._last_cache = self._cache_key + 1, cache
        shape = tuple(tokens.shape)
        start = time.perf_counter()
        out = self.stage.run(tokens, positions, cache).contiguous()
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        self.busy_seconds += time.perf_counter() - start
        self.forwards += 1
        self.workers.send(("forward", (shape, cache_layout(cache, self._cache_key))))
        pending = PendingForward(self, shape, out, None if self.size == 1 else self.link.send(out, 1))
        self._in_flight.append(pending)
        return pending

    def _receive(self, pending: PendingForward) -> torch.Tensor:
        if not self._in_flight or self._in_flight[0] is not pending:
            raise RuntimeError("pipelined forwards must be waited for in the order they were launched")
        self._in_flight.pop(0)
        if self.size == 1:
            return pending.output
        try:
            start = time.perf_counter()
            pending.sending.wait()
            self.link.wait_seconds += time.perf_counter() - start
            return self.link.recv((*pending.shape, self.full_cfg.d_model), self.dtype, self.device, self.size - 1)
        except RuntimeError as err:  # a peer's socket closed under us
            raise RuntimeError(f"a pipeline stage has exited: {self.workers.exit_codes()} ({err})") from None

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """The final normalised hidden states, one forward through every stage."""
        return self.launch(tokens, positions, cache).wait()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stage.logits(hidden)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: KVCache | None = None) -> torch.Tensor:
        if positions is not None and positions.numel() and int(positions.max()) >= self.full_cfg.context_length:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context of "
                             f"{self.full_cfg.context_length} tokens")
        return self.logits(self.hidden_states(tokens, positions, cache))

    # -- counters

    def stage_stats(self) -> list[StageStats]:
        """Every stage's counters, rank 0 first. Rank 0's wait is its time in :meth:`wait`."""
        link = self.link
        ours = StageStats(0, self.layers[0], self.busy_seconds, link.wait_seconds if link else 0.0,
                          link.sends if link else 0, link.bytes_sent if link else 0, self.forwards)
        self.workers.send(("stats", None))
        return [ours] + [conn.recv() for conn in self.workers.conns]

    def reset_stats(self) -> None:
        self.busy_seconds, self.forwards = 0.0, 0
        if self.link is not None:
            self.link.reset()
        self.workers.send(("reset", None))

    # -- lifetime

    def close(self) -> None:
        """Stop the workers and wait for them to exit (idempotent)."""
        self.workers.close()

    def __enter__(self) -> PipelineParallelGPT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
