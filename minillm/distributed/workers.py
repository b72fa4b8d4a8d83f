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

This module is everything the two share: :class:`WorkerProcesses` starts the workers (spawned,
one GPU each with NCCL, or gloo processes on the CPU with ``threads`` threads each), joins the
process group with them and stops them; :func:`_worker_main` is a worker's life, answering
rank 0's messages through a :class:`Follower`; :class:`ParallelModel` is what rank 0's split
model shows the engine (a ``GPT``'s surface); :func:`dumps_step`, :func:`cache_layout` and
:class:`WorkerCaches` carry a step's inputs and caches across.
"""

from __future__ import annotations

import io
import pickle
import signal
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.decoding.generate import ContiguousKVCache
from minillm.distributed.tensor import make_group, rendezvous
from minillm.engine.kv_cache import PagedAttention, PagedKVPool
from minillm.model.config import ModelConfig
from minillm.model.gpt import KVCache

READY_TIMEOUT_S = 120.0  # spawning a process and importing torch takes seconds on a busy CPU
_WORKER_DEVICE = torch.device("cpu")  # where unpickled step tensors go: set_worker_device, once per worker


# ----------------------------------------------------------------------------- messages


def _to_device(array) -> torch.Tensor:
    return torch.from_numpy(array).to(_WORKER_DEVICE)


def set_worker_device(device: str) -> torch.device:
    """Where this worker process's unpickled step tensors go, and its CUDA device."""
    global _WORKER_DEVICE
    _WORKER_DEVICE = torch.device(device)
    if _WORKER_DEVICE.type == "cuda":
        torch.cuda.set_device(_WORKER_DEVICE)
    return _WORKER_DEVICE


class _StepPickler(pickle.Pickler):
    """Tensors as NumPy arrays: plain bytes, far cheaper to pickle than ``torch.save``'s
    format, and rebuilt on the worker's own device. Step inputs are integer and bool only."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _to_device, (obj.detach().cpu().numpy(),)
        return NotImplemented


def dumps_step(message: tuple) -> bytes:
    buffer = io.BytesIO()
    _StepPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def cache_layout(cache: KVCache | None, key: int) -> tuple:
    """What a worker needs to build the same cache over its own keys and values; ``key``
    changes when rank 0 starts a new contiguous cache."""
    if cache is None:
        return ("none",)
    if isinstance(cache, PagedAttention):
        pool = cache.pool
        return ("paged", pool.num_blocks, pool.block_size, cache.slot_mapping, cache.decodes, cache.prefills)
    if isinstance(cache, ContiguousKVCache):
        pad = None if cache.pad is None else cache.pad.tolist()
        return ("contiguous", key, cache.k.shape[1], cache.max_len, pad)
    raise TypeError(f"a split model supports PagedAttention and ContiguousKVCache, not {type(cache).__name__}")


class WorkerCaches:
    """A worker's mirror of rank 0's caches: one paged pool (made on first use, with the
    shape rank 0's pool has) and the contiguous cache of the latest ``generate`` call."""

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


class Follower:
    """A worker's part of the model and its answers to rank 0: a message ``(kind, payload)``
    calls the method named ``kind`` with ``payload``, and what it returns, if not None, goes
    back up the pipe. Every follower switches attention (``"attention"``); each kind of split
    adds ``forward`` and whatever else it needs."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.caches = module, WorkerCaches(module)

    def attention(self, impl: str) -> None:
        self.module.set_attention(impl)


# builds rank r's Follower in its own process, from (rank, size, group, device); picklable
FollowerFactory = Callable[[int, int, dist.ProcessGroup, torch.device], Follower]


def _worker_main(rank: int, size: int, port: int, backend: str, device: str, threads: int,
                 build: FollowerFactory, conn) -> None:
    """A worker's whole life: join the group, build its part, then answer rank 0 until the
    pipe says stop or closes. An exception ends the process, which closes its sockets, so
    rank 0's next collective or receive fails rather than waits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: rank 0 decides
    worker_device = set_worker_device(device)
    torch.set_num_threads(threads)
    group, _store = make_group(backend, rank, size, port)
    follower = build(rank, size, group, worker_device)
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
    """Rank 0's side of its workers: ``builders[r - 1]`` builds rank ``r``'s part in a new
    process, on ``device``'s type (``cuda:r`` with NCCL, or the CPU with gloo and ``threads``
    threads, by default this process's share of its threads). Returns once every worker is
    ready, with ``group`` the process group they share with rank 0 (None when there are no
    workers). Step messages go down one duplex pipe per worker (:meth:`send`); a finalizer
    stops the workers on :meth:`close`, on garbage collection or at this process's exit.
    ``role`` names the workers in errors ("pipeline stage"), ``option`` the setting that
    asked for them, ``name`` prefixes their process names."""

    def __init__(self, role: str, option: str, name: str, device: torch.device, builders: list[FollowerFactory],
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
        try:
            self._store = rendezvous(size)
            for rank, build in enumerate(builders, start=1):
                worker_device = f"cuda:{rank}" if backend == "nccl" else "cpu"
                self._spawn((rank, size, self._store.port, backend, worker_device, threads, build), f"{name}{rank}")
            self.group, _ = make_group(backend, 0, size, self._store)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _spawn(self, args: tuple, name: str) -> None:
        """Start ``_worker_main(*args, conn)`` in a new process (spawned: CUDA and threads survive)."""
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(*args, theirs), daemon=True, name=name)  # daemon: ends with us
        process.start()
        theirs.close()  # ours is now the only other end: the worker sees EOF if this process dies
        self.conns.append(ours)
        self.processes.append(process)

    def _wait_ready(self) -> None:
        for conn, process in zip(self.conns, self.processes):
            if not conn.poll(READY_TIMEOUT_S) or conn.recv() != "ready":
                raise RuntimeError(f"{self.role} {process.name} did not start (exit {process.exitcode})")

    def send(self, message: tuple) -> None:
        """The same message to every worker, in order."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.role}s are closed")
        data = dumps_step(message)
        for conn, process in zip(self.conns, self.processes):
            try:
                conn.send_bytes(data)
            except OSError:
                process.join(timeout=1)
                raise RuntimeError(f"{self.role} {process.name} has exited (exit {process.exitcode})") from None

    def exit_codes(self) -> str:
        return ", ".join(f"{p.name} exit {p.exitcode}" for p in self.processes)

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
    rank 0's part's (``local``), which also holds the output matrix. A subclass sets ``local``
    and ``workers`` and defines the forward. ``close()`` (or ``with``) stops the workers, as
    does garbage collection or this process's exit."""

    local: torch.nn.Module
    workers: WorkerProcesses
    full_cfg: ModelConfig  # the whole model's shape
    _cache_key, _last_cache = 0, None

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

    def layout(self, cache: KVCache | None) -> tuple:
        """``cache``'s :func:`cache_layout` for the workers, with a new key for a new cache."""
        if cache is not None and cache is not self._last_cache:
            self._cache_key, self._last_cache = self._cache_key + 1, cache
        return cache_layout(cache, self._cache_key)

    def close(self) -> None:
        """Stop the workers and wait for them to exit (idempotent)."""
        self.workers.close()

    def __enter__(self) -> ParallelModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
