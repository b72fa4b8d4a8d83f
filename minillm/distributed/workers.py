"""Rank 0 and its workers: the one bootstrap that tensor and pipeline parallelism share.

Both split a model over processes the same way (vLLM's design in miniature). The process that
runs the engine is rank 0: the scheduler, sampling and detokenizing happen there and only
there. Each other rank is a worker holding its own part of the weights, in a process rank 0
spawned on this machine or one torchrun launched on this host or another
(:mod:`~minillm.distributed.rendezvous`); either way it runs
:func:`~minillm.distributed.follower.follow`. For every forward, rank 0 sends the call over
its connection to each worker: the token ids, the positions and the cache's *layout* (slot
mapping, block tables and masks, never keys or values). The workers rebuild the same cache
view over their own KV pool, which holds only their part, and run their part of the forward;
what passes between the ranks inside it (all-reduces, or hidden states from stage to stage)
goes over the process group, and is the caller's business.

A worker that fails says so on its connection before it exits; rank 0 reads those last words
whenever talking to the workers fails, or finds something to read between steps, and raises
:class:`WorkerLost` naming the rank.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import time
import weakref
from functools import partial
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from minillm.decoding.generate import ContiguousKVCache
from minillm.distributed.follower import Follower, StepPickler, join_group, load_part, receive_message, send_message
from minillm.distributed.rendezvous import (
    POLL_S,
    PeerFailed,
    RankZeroListener,
    SpawnedWorker,
    describe,
    launch_store,
    launched,
    posted_failure,
    reachable_address,
    spawn_workers,
    this_process,
)
from minillm.engine.config import EngineOptionError
from minillm.engine.kv_cache import PagedAttention
from minillm.engine.llm_engine import EngineDead
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT, KVCache

READY_TIMEOUT_S = 120.0  # starting a process and importing torch takes seconds on a busy CPU
LOST_WAIT_S = 5.0  # how long rank 0 waits for a failed worker's last words


# ----------------------------------------------------------------------------- rank 0


class WorkerLost(PeerFailed, EngineDead):
    """A worker rank failed, went away or never came: the split model cannot take another step."""


class Workers:
    """Rank 0's side of its workers: ``builders[r - 1](r, size, group, device)`` builds rank
    ``r``'s :class:`Follower` in that rank's process. Returns once every worker is ready, with
    ``group`` the process group they share with rank 0 (None when there are no workers).

    Launched by torchrun (:func:`~minillm.distributed.rendezvous.launched`), the workers are
    the launch's other ranks, on this host or others, and ``settings`` (this rank's options)
    must equal each one's, or the launch is refused naming the first that differs. Otherwise
    they are processes spawned here: on ``cuda:r`` with NCCL, or on the CPU with gloo and
    ``threads`` threads (by default this process's share). While it waits, rank 0 watches
    for a worker that fails, and says which and why. A finalizer stops the workers on
    :meth:`close`, on garbage collection or at this process's exit. ``role`` names the
    workers ("pipeline stage"), ``option`` the setting that asked for them."""

    def __init__(self, role: str, option: str, device: torch.device, builders: list[Callable[..., Follower]],
                 threads: int | None = None, settings: dict | None = None) -> None:
        size = len(builders) + 1
        self.role = role
        self.conns: list[Connection] = []
        self.peers: list[str] = []  # each worker's host and process id, for messages
        self.spawned: list[SpawnedWorker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.conns, self.spawned)
        self.group: dist.ProcessGroup | None = None
        self.sent: dict[str, tuple[int, int]] = {}  # message kind -> (messages, bytes) sent to each worker
        if size == 1:
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        launch = launched()
        if launch is None and backend == "nccl" and torch.cuda.device_count() < size:
            raise ValueError(f"{option} {size} needs {size} GPUs; this machine has {torch.cuda.device_count()}")
        if launch is not None and launch.rank != 0:
            raise RuntimeError("under torchrun only rank 0 builds a split model; every other rank follows it "
                               "(minillm.distributed.follower.follow: build_engine and LLM call it there)")
        if launch is not None and launch.world_size != size:
            raise ValueError(f"{option} {size} needs {size} ranks; torchrun launched {launch.world_size} "
                             "(--nnodes x --nproc-per-node)")
        try:
            if launch is None:
                store, self.spawned[:] = spawn_workers(size)
                host, threads = "127.0.0.1", threads or max(1, torch.get_num_threads() // size)
            else:
                store, host, threads = launch_store(), reachable_address(os.environ["MASTER_ADDR"]), None
            self._meet(RankZeroListener(store, host), store, size, settings)
            for conn, build in zip(self.conns, builders):
                send_message(conn, ("build", build, backend, threads))
            self._expect("joining")
            self.group = join_group(backend, 0, size, store)
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def _meet(self, listener: RankZeroListener, store: dist.Store, size: int, settings: dict | None) -> None:
        """Accept every worker's connection, in rank order in ``conns``, and check its settings."""
        hellos: dict[int, tuple[Connection, str, dict | None]] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while len(hellos) < size - 1:
                conn = listener.accept(POLL_S)
                if isinstance(conn, Connection) and conn.poll(READY_TIMEOUT_S):
                    try:
                        _, rank, peer, theirs = receive_message(conn)
                        hellos[rank] = (conn, peer, theirs)
                    except (EOFError, OSError):  # it died before its hello: its failure shows below
                        conn.close()
                for rank in set(range(1, size)) - set(hellos):
                    self._fail_if_starting_failed(store, rank)
                if time.monotonic() > deadline:
                    missing = ", ".join(str(r) for r in sorted(set(range(1, size)) - set(hellos)))
                    raise WorkerLost(f"{self.role} rank {missing} did not connect within {READY_TIMEOUT_S:.0f} s")
        finally:
            listener.close()
            for rank in sorted(hellos):
                self.conns.append(hellos[rank][0])
                self.peers.append(f"rank {rank} ({hellos[rank][1]})")
        for rank, (conn, peer, theirs) in sorted(hellos.items()):
            difference = _first_difference(settings, theirs)
            if difference is not None:
                name, ours, its = difference
                message = f"{name} differs between ranks: rank 0 has {ours!r}, rank {rank} has {its!r}"
                for other in self.conns:
                    send_message(other, ("refused", message))
                raise EngineOptionError(name, message)

    def _fail_if_starting_failed(self, store: dist.Store, rank: int) -> None:
        """Raise if ``rank`` posted a failure, or (spawned here) its process has exited."""
        failure = posted_failure(store, rank)
        if failure is not None:
            raise WorkerLost(f"{self.role} rank {rank} failed while starting: {failure}")
        spawned = self.spawned[rank - 1] if self.spawned else None
        if spawned is not None and spawned.process.poll() is not None:
            raise WorkerLost(f"{self.role} rank {rank} stopped while starting: it {spawned.last_words()}")

    def _expect(self, kind: str) -> None:
        """Wait for every worker to send ``kind``; a worker that says anything else or goes
        away instead is a :class:`WorkerLost` naming it."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for index, conn in enumerate(self.conns):
            while not conn.poll(POLL_S):
                if time.monotonic() > deadline or (self.spawned and self.spawned[index].process.poll() is not None):
                    raise self.lost(TimeoutError(f"no {kind!r} within {READY_TIMEOUT_S:.0f} s"))
            try:
                message = receive_message(conn)
            except (EOFError, OSError) as err:
                raise self.lost(err) from None
            if message != (kind,):
                raise self.lost(RuntimeError(f"expected {kind!r}, got {message[0]!r}"), {index: message})

    def send(self, message: tuple) -> None:
        """The same message to every worker, in order (``sent`` counts each kind's messages
        and bytes, as one worker receives them)."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the {self.role}s are closed")
        buffer = io.BytesIO()
        StepPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
        data = buffer.getvalue()
        count, nbytes = self.sent.get(message[0], (0, 0))
        self.sent[message[0]] = (count + 1, nbytes + len(data))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as err:
                raise self.lost(err) from None

    def receive_all(self) -> list:
        """One reply from every worker, in rank order."""
        try:
            return [receive_message(conn) for conn in self.conns]
        except (EOFError, OSError) as err:
            raise self.lost(err) from None

    def check(self) -> None:
        """Raise :class:`WorkerLost` if a worker has gone: between steps, a worker says nothing
        unless asked, so anything to read on its connection is its last word or its end."""
        if any(conn.poll(0) for conn in self.conns) or any(w.process.poll() is not None for w in self.spawned):
            raise self.lost(RuntimeError("a worker spoke between steps"))

    def lost(self, cause: BaseException, heard: dict[int, tuple] | None = None) -> WorkerLost:
        """What to raise when talking to the workers failed (``cause``): which ranks are gone
        and why, in their own words where they left any. Waits up to a few seconds for the
        words to arrive: a worker whose peer vanished needs a moment to notice."""
        words: dict[int, str] = {i: _last_word(m) for i, m in (heard or {}).items()}
        deadline = time.monotonic() + LOST_WAIT_S
        settle = None
        while time.monotonic() < deadline and (settle is None or time.monotonic() < settle):
            for index, conn in enumerate(self.conns):
                if index not in words:
                    try:
                        if conn.poll(0):
                            words[index] = _last_word(receive_message(conn))
                    except (EOFError, OSError):
                        words[index] = self._silent_end(index)
            if words and settle is None:
                settle = time.monotonic() + 0.5  # the others' words may be on their way
            time.sleep(0.02)
        if not words:
            return WorkerLost(f"the {self.role}s stopped answering ({describe(cause)}); none said why")
        return WorkerLost("; ".join(f"{self.role} {self.peers[i]} {words[i]}" for i in sorted(words)))

    def describe(self) -> str:
        """Where every rank runs, for a banner: ``rank 0 (host pid 12) + pipeline stage rank 1 (...)``."""
        here = f"rank 0 ({this_process()})"
        return " + ".join([here] + [f"{self.role} {peer}" for peer in self.peers])

    def _silent_end(self, index: int) -> str:
        if self.spawned:
            return self.spawned[index].last_words()
        return "closed its connection without a word (killed, or its host went down)"

    def close(self) -> None:
        """Stop the workers and wait for the ones spawned here to exit (idempotent)."""
        self._finalizer()


def _last_word(message: tuple) -> str:
    if message and message[0] == "error":
        return f"failed: {message[1]}"
    return f"said {message!r} out of turn"


def _first_difference(ours: dict | None, theirs: dict | None) -> tuple[str, object, object] | None:
    """The first setting two ranks disagree on, or None (also when either has none to show)."""
    if ours is None or theirs is None:
        return None
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            return name, ours.get(name), theirs.get(name)
    return None


def _stop_workers(conns: list[Connection], spawned: list[SpawnedWorker]) -> None:
    """Ask each worker to stop, then make sure of the ones spawned here: a worker that has not
    exited 10 s later (one stuck waiting for a peer, say) is terminated."""
    for conn in conns:
        try:
            send_message(conn, ("stop", None))
        except (OSError, ValueError):  # the worker is gone already
            pass
        conn.close()
    for worker in spawned:
        try:
            worker.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.process.terminate()
            worker.process.wait(timeout=5)
        worker.stderr.close()


class ParallelModel:
    """Rank 0 of a model split over worker processes, used by the engine, the model runner and
    ``generate_kv_cache`` as if it were a ``GPT``: ``cfg`` (rank 0's part, so caches hold only
    what it computes), ``device``, ``dtype``, ``eval``, ``set_attention`` and ``logits`` are
    rank 0's part's (``local``), which also holds the output matrix. A subclass calls
    :meth:`_start` and defines the forward. ``close()`` (or ``with``) stops the workers, as
    does garbage collection or this process's exit."""

    local: torch.nn.Module
    workers: Workers
    full_cfg: ModelConfig  # the whole model's shape
    _cache_key, _last_cache = 0, None

    def _start(self, model: GPT, follower: type[Follower], parts: list[Callable[..., torch.nn.Module]],
               states: list[dict], role: str, option: str, threads: int | None, settings: dict | None) -> None:
        """Rank ``r``'s part is ``parts[r](r, size, group)`` holding ``states[r]``: rank 0's here
        (``local``), each other one in a worker's process, answering through ``follower``."""
        impl = model.blocks[0].attn.impl
        builders = [partial(follower, parts[r], states[r], impl) for r in range(1, len(parts))]
        self.workers = Workers(role, option, model.device, builders, threads, settings)
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

    def check_alive(self) -> None:
        """Raise :class:`WorkerLost` if a worker has failed or gone (the engine asks between steps)."""
        self.workers.check()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.workers.close()

    def __enter__(self) -> ParallelModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
