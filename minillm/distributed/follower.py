"""A worker rank's side of a split model: what rank 0 sends it, and :func:`follow`, its whole
life.

However it was started (spawned by rank 0 on this machine, or launched by torchrun on this
host or another: :mod:`~minillm.distributed.rendezvous`), a worker connects to rank 0, shows
the options it was given, receives the part of the model to build, joins the process group
and then answers rank 0's messages until told to stop. A message ``(kind, payload)`` calls
its :class:`Follower`'s method ``kind``: a forward (the step's token ids, positions and cache
layout, rebuilt here over the worker's own KV pool), an attention switch, a pipeline stage's
counters. A worker that fails says so on its connection, its last words to rank 0, before it
exits.
"""

from __future__ import annotations

import datetime
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from minillm.decoding.generate import ContiguousKVCache
from minillm.distributed.rendezvous import (
    connect_to_rank_0,
    describe,
    launch_store,
    launched,
    post_failure,
    this_process,
)
from minillm.engine.kv_cache import PagedAttention, PagedKVPool
from minillm.model.gpt import KVCache

JOIN_TIMEOUT = datetime.timedelta(seconds=300)  # for every rank to reach the process group, and each collective
_WORKER_DEVICE = torch.device("cpu")  # where unpickled step tensors go: set once per worker, in follow


# ----------------------------------------------------------------------------- messages


def _to_device(array) -> torch.Tensor:
    return torch.from_numpy(array).to(_WORKER_DEVICE)


class StepPickler(pickle.Pickler):
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


def join_group(backend: str, rank: int, size: int, store: dist.Store) -> dist.ProcessGroup:
    """A process group of its own over the launch's ``store`` (not the process-wide default one
    ``torchrun`` scripts use), so a notebook can open and close several; returns when every
    rank has joined."""
    store = dist.PrefixStore("group", store)
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
    ``payload``, and what it returns, if not None, goes back to rank 0. Every follower
    switches attention (``"attention"``); each kind of split adds ``forward`` and whatever
    else it needs."""

    def __init__(self, part: Callable[..., torch.nn.Module], state: dict, impl: str, rank: int, size: int,
                 group: dist.ProcessGroup, device: torch.device) -> None:
        self.module = load_part(part(rank, size, group), state, impl, device)
        self.caches = WorkerCaches(self.module)

    def attention(self, impl: str) -> None:
        self.module.set_attention(impl)


def send_message(conn: Connection, message: object) -> None:
    """Plain pickle: ``Connection.send`` would use torch's shared-memory reductions, which do
    not cross hosts."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


def follow(settings: Callable[[], dict | None] = lambda: None) -> int:
    """A worker rank's whole life, in a process a launch started (see
    :mod:`~minillm.distributed.rendezvous`): connect to rank 0, show it ``settings()`` (the
    options this rank was given, which must be rank 0's), receive the part of the model to
    build, join the process group, then answer rank 0 until it says stop (returns 0) or goes
    away (returns 1). An error on the way is this rank's last word to rank 0 (or, before it
    connected, a note in the store) and is raised."""
    global _WORKER_DEVICE
    rank = launched()
    if rank is None or rank.rank == 0:
        raise RuntimeError("follow() runs in a worker rank of a launch (RANK > 0 under torchrun)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches every process of a terminal: rank 0 decides
    store = launch_store()
    try:
        mine = settings()
        conn = connect_to_rank_0(store)
    except BaseException as err:
        post_failure(store, rank.rank, describe(err))
        raise
    with conn:
        try:
            send_message(conn, ("hello", rank.rank, this_process(), mine))
            kind, *rest = receive_message(conn)
            if kind == "stop":  # rank 0 gave up before building anything (another rank failed)
                return 1
            if kind == "refused":
                print(f"rank 0 refused rank {rank.rank}: {rest[0]}", file=sys.stderr)
                return 2
            build, backend, threads = rest
            _WORKER_DEVICE = torch.device(f"cuda:{rank.local_rank}" if backend == "nccl" else "cpu")
            if _WORKER_DEVICE.type == "cuda":
                torch.cuda.set_device(_WORKER_DEVICE)
            if threads:
                torch.set_num_threads(threads)
            send_message(conn, ("joining",))
            group = join_group(backend, rank.rank, rank.world_size, store)
            follower = build(rank.rank, rank.world_size, group, _WORKER_DEVICE)
            send_message(conn, ("ready",))
            return _answer(conn, follower)
        except BaseException as err:
            try:
                send_message(conn, ("error", describe(err)))
            except OSError:  # rank 0 is gone already
                pass
            raise


def _answer(conn: Connection, follower: Follower) -> int:
    """Answer rank 0's messages until it says stop (0) or its end of the connection closes (1)."""
    with torch.inference_mode():
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                print("rank 0 went away without saying stop; this worker exits", file=sys.stderr)
                return 1
            kind, payload = pickle.loads(data)
            if kind == "stop":
                return 0
            reply = getattr(follower, kind)(payload)
            if reply is not None:
                send_message(conn, reply)
