"""Tensor parallelism with processes: rank 0 drives, workers follow (vLLM's design in miniature).

Rank 0 is the process that runs the engine: the scheduler, sampling and detokenizing happen
there and only there. It holds shard 0 of the model; each other rank is a worker process
holding its own shard. :class:`TensorParallelGPT` looks like a ``GPT`` to the engine. Every
call to its ``hidden_states`` first sends the call (the token ids, the positions, and the
cache's *layout*: slot mapping, block tables and masks, never keys or values) down a pipe to
each worker, then runs shard 0. The workers rebuild the same cache view over their own KV
pool, which holds only their heads, and run the same forward; the two all-reduces per
block inside the forward keep the ranks in step. The logits need no communication: the
output matrix is replicated, so rank 0 computes them alone from its (complete) hidden state.

The step inputs travel over a ``multiprocessing`` pipe rather than a collective: a worker
can then wait for the next step for as long as a server sits idle (a collective would time
out), and it sees the end of the pipe, and exits, the moment rank 0 closes it or dies.

Public: :class:`TensorParallelGPT`. The checks and timings built on it are in
:mod:`minillm.distributed.tensor_measure`.
"""

from __future__ import annotations

import io
import pickle
import signal
import weakref

import torch
import torch.multiprocessing as mp

from minillm.model.config import ModelConfig
from minillm.engine.kv_cache import PagedAttention, PagedKVPool
from minillm.decoding.generate import ContiguousKVCache
from minillm.model.gpt import GPT, KVCache
from minillm.distributed.tensor import (
    ShardedGPT,
    check_splittable,
    check_tensor_parallel_size,
    make_group,
    rendezvous,
    shard_gpt,
    shard_state_dict,
)

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
    """What a worker needs to build the same cache over its own keys and values."""
    if cache is None:
        return ("none",)
    if isinstance(cache, PagedAttention):
        pool = cache.pool
        return ("paged", pool.num_blocks, pool.block_size, cache.slot_mapping, cache.decodes, cache.prefills)
    if isinstance(cache, ContiguousKVCache):
        pad = None if cache.pad is None else cache.pad.tolist()
        return ("contiguous", key, cache.k.shape[1], cache.max_len, pad)
    raise TypeError(f"tensor parallelism supports PagedAttention and ContiguousKVCache, not {type(cache).__name__}")


class WorkerCaches:
    """A worker's mirror of rank 0's caches: one paged pool (made on first use, with the
    shape rank 0's pool has) and the contiguous cache of the latest ``generate`` call."""

    def __init__(self, shard: ShardedGPT) -> None:
        self.shard = shard
        self.pool: PagedKVPool | None = None
        self.contiguous: tuple[int, ContiguousKVCache] | None = None

    def build(self, layout: tuple) -> KVCache | None:
        kind, *rest = layout
        if kind == "none":
            return None
        if kind == "paged":
            num_blocks, block_size, slots, decodes, prefills = rest
            if self.pool is None or (self.pool.num_blocks, self.pool.block_size) != (num_blocks, block_size):
                self.pool = PagedKVPool(self.shard.cfg, num_blocks, block_size, self.shard.device, self.shard.dtype)
            return PagedAttention(self.pool, slots, decodes, prefills)
        key, batch, max_len, pad = rest
        if self.contiguous is None or self.contiguous[0] != key:
            self.contiguous = (key, ContiguousKVCache(self.shard, batch, max_len, pad=pad))
        return self.contiguous[1]


# ----------------------------------------------------------------------------- worker


def _worker_main(rank: int, world_size: int, port: int, backend: str, device: str, cfg: ModelConfig,
                 state: dict, impl: str, threads: int, conn) -> None:
    """A worker's whole life: join the group, build the shard, then follow rank 0 until the
    pipe says stop or closes. A ``ValueError`` raised before any communication (a bad
    position, say) was raised on rank 0 too, at the same point: it is skipped. Anything else
    ends the process, which closes its sockets, so rank 0's next all-reduce fails rather than
    waits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: rank 0 decides
    worker_device = set_worker_device(device)
    torch.set_num_threads(threads)
    group, _store = make_group(backend, rank, world_size, port)
    shard = ShardedGPT(cfg, rank, world_size, group).to(worker_device, state["tok_emb.weight"].dtype)
    shard.load_state_dict(state)
    shard.set_attention(impl).eval()
    caches = WorkerCaches(shard)
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
                shard.set_attention(payload)
                continue
            tokens, positions, layout = payload
            calls = shard.allreduce.calls
            try:
                shard.hidden_states(tokens, positions, caches.build(layout))
            except ValueError:
                if shard.allreduce.calls != calls:
                    raise


# ----------------------------------------------------------------------------- rank 0


class WorkerProcesses:
    """Rank 0's side of its worker processes, shared by the tensor- and pipeline-parallel
    models: one duplex pipe per worker, step messages broadcast down them, and a finalizer
    that stops the workers on :meth:`close`, on garbage collection or at this process's exit.
    ``role`` names the workers in errors ("tensor-parallel worker", "pipeline stage")."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.conns: list = []
        self.processes: list = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.conns, self.processes)

    def spawn(self, target, args: tuple, name: str) -> None:
        """Start ``target(*args, conn)`` in a new process (spawned: CUDA and threads survive)."""
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=target, args=(*args, theirs), daemon=True, name=name)  # daemon: ends with us
        process.start()
        theirs.close()  # ours is now the only other end: the worker sees EOF if this process dies
        self.conns.append(ours)
        self.processes.append(process)

    def wait_ready(self) -> None:
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


class TensorParallelGPT:
    """A ``GPT`` split over ``world_size`` processes, used from rank 0 as if it were a ``GPT``.

    ``hidden_states``, ``logits``, ``forward``, ``cfg`` (this rank's slice, so caches hold
    only its heads), ``device``, ``dtype`` and ``set_attention`` are what the engine, the model runner
    and ``generate_kv_cache`` use. The workers run on the model's device type (one GPU each
    on CUDA, with NCCL; gloo on CPU) with ``threads`` CPU threads each. Call :meth:`close`
    (or use ``with``) to stop them; they also stop when this object is garbage collected or
    this process exits or dies.
    """

    def __init__(self, model: GPT, world_size: int, *, threads: int | None = None) -> None:
        check_tensor_parallel_size(model.cfg, world_size)
        check_splittable(model)
        device = model.device
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size (--tensor-parallel-size) {world_size} needs {world_size} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        threads = threads or max(1, torch.get_num_threads() // world_size)
        self._store = rendezvous(world_size) if world_size > 1 else None
        self.workers = WorkerProcesses("tensor-parallel worker")
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        try:
            for rank in range(1, world_size):
                self._spawn(rank, world_size, backend, model, shard_state_dict(state, model.cfg, rank, world_size), threads)
            group = None
            if world_size > 1:
                group, _ = make_group(backend, 0, world_size, self._store)
            self.shard = shard_gpt(model, 0, world_size, group)
            self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        self.world_size, self.full_cfg = world_size, model.cfg
        self._cache_key, self._last_cache = 0, None

    def _spawn(self, rank: int, world_size: int, backend: str, model: GPT, state: dict, threads: int) -> None:
        """Start rank ``rank``'s process, which receives only its own shard's weights."""
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        impl = model.blocks[0].attn.impl
        self.workers.spawn(_worker_main, (rank, world_size, self._store.port, backend, device, model.cfg, state, impl,
                                          threads), name=f"minillm-tp-rank{rank}")

    # -- what the engine sees

    @property
    def cfg(self) -> ModelConfig:
        return self.shard.cfg

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def eval(self) -> TensorParallelGPT:
        """Shards are always in eval mode; here so the engine can call it as on a ``GPT``."""
        return self

    def set_attention(self, impl: str) -> TensorParallelGPT:
        self.shard.set_attention(impl)
        self.workers.send(("attention", impl))
        return self

    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if cache is not None and cache is not self._last_cache:
            self._cache_key, self._last_cache = self._cache_key + 1, cache
        self.workers.send(("forward", (tokens, positions, cache_layout(cache, self._cache_key))))
        return self.shard.hidden_states(tokens, positions, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.logits(hidden)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        if positions is not None:  # here, before any rank is told to run
            self.shard.check_positions(positions)
        return self.logits(self.hidden_states(tokens, positions, cache))

    # -- lifetime

    def close(self) -> None:
        """Stop the workers and wait for them to exit (idempotent)."""
        self.workers.close()

    def __enter__(self) -> TensorParallelGPT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
