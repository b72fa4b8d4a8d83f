"""Rank 0 and its worker processes: the one bootstrap that tensor and pipeline parallelism share.

Both split a model over processes the same way (vLLM's design in miniature). The process that
runs the engine is rank 0: the scheduler, sampling and detokenizing happen there and only
there. Each other rank is a worker process holding its own part of the weights. For every
forward, rank 0 sends the call down a pipe to each worker: the token ids, the positions and
the cache's *layout* (slot mapping, block tables and masks, never keys or values). The workers
rebuild the same cache view over their own KV pool, which holds only their part, and run
their part of the forward; what passes between the ranks inside it (all-reduces, or hidden
states from stage to stage) is the caller's business.

The step inputs travel over a ``multiprocessing`` pipe rather than a collective: a worker can
then wait for the next step for as long as a server sits idle (a collective would time out),
and it sees the end of the pipe, and exits, the moment rank 0 closes it or dies.
"""

from __future__ import annotations

import datetime
import io
import pickle
import signal
import weakref
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.decoding.generate import ContiguousKVCache
from minillm.engine.kv_cache import PagedAttention, PagedKVPool
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, KVCache

READY_TIMEOUT_S = 120.0  # spawning a process and importing torch takes seconds on a busy CPU
JOIN_TIMEOUT = datetime.timedelta(seconds=300)  # for every rank to reach the process group
_WORKER_DEVICE = torch.device("cpu")  # where unpickled step tensors go: set once per worker, in _worker_main


# ----------------------------------------------------------------------------- messages


def _to_device(array) -> torch.Tensor:
    return torch.from_numpy(array).to(_WORKER_DEVICE)


class _StepPickler(pickle.Pickler):
    """Tensors as NumPy arrays: plain bytes, far cheaper to pickle than ``torch.save``'s
    format, and rebuilt on the worker's own device. Step inputs are integer and bool only."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _to_device, (obj.detach().cpu().numpy(),)
        return NotImplemented


class WorkerCaches:
    """A worker's mirror of rank 0's caches (from :meth:`ParallelModel.layout`): one paged pool
    (made on first use, with the shape rank 0's pool has) and the contiguous cache of the
    latest ``generate`` call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module  # the worker's part: its cfg, device and dtype size the caches
        self.pool: PagedKVPool | None = None
        self.contiguous: tuple[int, ContiguousKVCache] | None = None

    def build(self, layout: tuple) -> KVCache | None:
        kind, *rest = layout
        if kind == "none":
            return None
        if kind == "paged":
            num_blocks, block_size, slots, decodes, prefills = rest
            if self.pool is None or (self.pool.num_blocks, self.pool.block_size) != (num_blocks, block_size):
                self.pool = PagedKVPool(self.module.cfg, num_blocks, block_size, self.module.device, self.module.dtype)
            return PagedAttention(self.pool, slots, decodes, prefills)
        key, batch, max_len, pad = rest
        if self.contiguous is None or self.contiguous[0] != key:
            self.contiguous = (key, ContiguousKVCache(self.module, batch, max_len, pad=pad))
        return self.contiguous[1]


# ----------------------------------------------------------------------------- a worker


def _group(backend: str, rank: int, size: int, store: dist.TCPStore) -> dist.ProcessGroup:
    """A process group of its own (not the process-wide default one ``torchrun`` scripts use),
    so a notebook can open and close several; returns when every rank has joined."""
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, JOIN_TIMEOUT)


def load_part(part: torch.nn.Module, state: dict, impl: str, device: torch.device) -> torch.nn.Module:
    """``part`` of a split model (a shard or a pipeline stage) holding ``state``, on ``device``
    in the weights' dtype, in eval mode, with the attention implementation ``impl``."""
    part.to(device, next(iter(state.values())).dtype).load_state_dict(state)
    return part.set_attention(impl).eval()


class Follower:
    """A worker's part of the model, ``part(rank, size, group)`` holding ``state``, and its
    answers to rank 0: a message ``(kind, payload)`` calls the method named ``kind`` with
    ``payload``, and what it returns, if not None, goes back up the pipe. Every follower
    switches attention (``"attention"``); each kind of split adds ``forward`` and whatever
    else it needs."""

    def __init__(self, part: Callable[..., torch.nn.Module], state: dict, impl: str, rank: int, size: int,
                 group: dist.ProcessGroup, device: torch.device) -> None:
        self.module = load_part(part(rank, size, group), state, impl, device)
        self.caches = WorkerCaches(self.module)

    def attention(self, impl: str) -> None:
        self.module.set_attention(impl)


def _worker_main(rank: int, size: int, port: int, backend: str, device: str, threads: int,
                 build: Callable[..., Follower], conn) -> None:
    """A worker's whole life: join the group, build its part, then answer rank 0 until the
    pipe says stop or closes. An exception ends the process, which closes its sockets, so
    rank 0's next collective or receive fails rather than waits."""
    global _WORKER_DEVICE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: rank 0 decides
    _WORKER_DEVICE = torch.device(device)
    if _WORKER_DEVICE.type == "cuda":
        torch.cuda.set_device(_WORKER_DEVICE)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=JOIN_TIMEOUT)  # a client of rank 0's store
    follower = build(rank, size, _group(backend, rank, size, store), _WORKER_DEVICE)
    conn.send("ready")
    with torch.inference_mode():
        while True:
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 closed the pipe or died
                return
            if kind == "stop":
                return
            reply = getattr(follower, kind)(payload)
            if reply is not None:
                conn.send(reply)


# ----------------------------------------------------------------------------- rank 0


class WorkerProcesses:
    """Rank 0's side of its workers: ``builders[r - 1](r, size, group, device)`` builds rank
    ``r``'s :class:`Follower` in a new process, on ``device``'s type (``cuda:r`` with NCCL, or
    the CPU with gloo and ``threads`` threads, by default this process's share). Returns once
    every worker is ready, with ``group`` the process group they share with rank 0 (None when
    there are no workers). A finalizer stops the workers on :meth:`close`, on garbage
    collection or at this process's exit. ``role`` names the workers ("pipeline stage"),
    ``option`` the setting that asked for them."""

    def __init__(self, role: str, option: str, device: torch.device, builders: list[Callable[..., Follower]],
                 threads: int | None = None) -> None:
        size = len(builders) + 1
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"{option} {size} needs {size} GPUs; this machine has {torch.cuda.device_count()}")
        self.role = role
        self.conns: list = []
        self.processes: list = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.conns, self.processes)
        self.group: dist.ProcessGroup | None = None
        if size == 1:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        threads = threads or max(1, torch.get_num_threads() // size)
        ctx = mp.get_context("spawn")  # not forked: CUDA and threads survive
        try:
            self._store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
            for rank, build in enumerate(builders, start=1):
                ours, theirs = ctx.Pipe()
                args = (rank, size, self._store.port, backend, f"cuda:{rank}" if backend == "nccl" else "cpu",
                        threads, build, theirs)
                process = ctx.Process(target=_worker_main, args=args, daemon=True,  # daemon: ends with us
                                      name=f"minillm-{role.replace(' ', '-')}-{rank}")
                process.start()
                theirs.close()  # ours is now the only other end: the worker sees EOF if this process dies
                self.conns.append(ours)
                self.processes.append(process)
            self.group = _group(backend, 0, size, self._store)
            for conn, process in zip(self.conns, self.processes):
                if not conn.poll(READY_TIMEOUT_S) or conn.recv() != "ready":
                    raise RuntimeError(f"{role} {process.name} did not start (exit {process.exitcode})")
        except BaseException:
            self.close()
            raise

    def send(self, message: tuple) -> None:
        """The same message to every worker, in order."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.role}s are closed")
        buffer = io.BytesIO()
        _StepPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        data = buffer.getvalue()
        for conn, process in zip(self.conns, self.processes):
            try:
                conn.send_bytes(data)
            except OSError:
                process.join(timeout=1)
                raise RuntimeError(f"{self.role} {process.name} has exited (exit {process.exitcode})") from None

    def close(self) -> None:
        """Stop the workers and wait for them to exit (idempotent)."""
        self._finalizer()


def _stop_workers(conns: list, workers: list) -> None:
    """Ask each worker to stop, then make sure: a worker that has not exited 10 s later (one
    stuck waiting for a peer, say) is terminated."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop", None)))
        except (OSError, ValueError):  # the worker is gone already
            pass
        conn.close()
    for process in workers:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)


class ParallelModel:
    """Rank 0 of a model split over worker processes, used by the engine, the model runner and
    ``generate_kv_cache`` as if it were a ``GPT``: ``cfg`` (rank 0's part, so caches hold only
    what it computes), ``device``, ``dtype``, ``eval``, ``set_attention`` and ``logits`` are
    rank 0's part's (``local``), which also holds the output matrix. A subclass calls
    :meth:`_start` and defines the forward. ``close()`` (or ``with``) stops the workers, as
    does garbage collection or this process's exit."""

    local: torch.nn.Module
    workers: WorkerProcesses
    full_cfg: ModelConfig  # the whole model's shape
    _cache_key, _last_cache = 0, None

    def _start(self, model: GPT, follower: type[Follower], parts: list[Callable[..., torch.nn.Module]],
               states: list[dict], role: str, option: str, threads: int | None) -> None:
        """Rank ``r``'s part is ``parts[r](r, size, group)`` holding ``states[r]``: rank 0's here
        (``local``), each other one in a worker process, answering through ``follower``."""
        impl = model.blocks[0].attn.impl
        builders = [partial(follower, parts[r], states[r], impl) for r in range(1, len(parts))]
        self.workers = WorkerProcesses(role, option, model.device, builders, threads)
        try:
            self.local = load_part(parts[0](0, len(parts), self.workers.group), states[0], impl, model.device)
        except BaseException:
            self.close()
            raise

    @property
    def cfg(self) -> ModelConfig:
        return self.local.cfg

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def eval(self) -> ParallelModel:
        """Every part is always in eval mode; here so the engine can call it as on a ``GPT``."""
        return self

    def set_attention(self, impl: str) -> ParallelModel:
        self.local.set_attention(impl)
        self.workers.send(("attention", impl))
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.logits(hidden)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: KVCache | None = None) -> torch.Tensor:
        if positions is not None:  # here, before any rank is told to run
            self.local.check_positions(positions)
        return self.logits(self.hidden_states(tokens, positions, cache))

    def layout(self, cache: KVCache | None) -> tuple:
        """What a worker needs to build the same cache over its own keys and values; a new
        contiguous cache gets a new key."""
        if cache is None:
            return ("none",)
        if isinstance(cache, PagedAttention):
            pool = cache.pool
            return ("paged", pool.num_blocks, pool.block_size, cache.slot_mapping, cache.decodes, cache.prefills)
        if not isinstance(cache, ContiguousKVCache):
            raise TypeError(f"a split model supports PagedAttention and ContiguousKVCache, not {type(cache).__name__}")
        if cache is not self._last_cache:
            self._cache_key, self._last_cache = self._cache_key + 1, cache
        pad = None if cache.pad is None else cache.pad.tolist()
        return ("contiguous", self._cache_key, cache.k.shape[1], cache.max_len, pad)

    def close(self) -> None:
        """Stop the workers and wait for them to exit (idempotent)."""
        self.workers.close()

    def __enter__(self) -> ParallelModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
