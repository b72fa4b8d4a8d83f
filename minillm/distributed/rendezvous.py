"""How the ranks of a split model meet: launched by ``torchrun`` on one host or several, or
spawned by rank 0 on this machine.

Every rank but 0 is a *worker*, and however it was started it finds rank 0 the same way. Its
environment says who it is and where the launch's key-value store is (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: what ``torchrun`` sets); rank
0 writes into that store the address it listens at, and each worker connects to it. Two
launchers fill in that environment:

- ``torchrun`` on each host, one process per rank: its agents host the store, and rank 0 may
  be on another machine than the worker;
- rank 0 itself (:func:`spawn_workers`), the one-machine convenience behind
  ``LLM(..., tensor_parallel_size=2)``: it hosts a store and starts ``python -m
  minillm.distributed`` once per other rank, with the environment torchrun would give it.

Why rank 0 talks to each worker over a connection of its own, rather than broadcasting each
step's inputs in a collective: a worker can wait on its connection for as long as a server
sits idle (a collective would time out), it sees the connection end, and exits, when rank 0
goes, and rank 0 knows which rank a broken connection belongs to and reads that rank's own
last words on it. The connections are ``multiprocessing.connection``'s, authenticated with a
key rank 0 puts in the store; like torch.distributed's own store and process groups, they
assume the hosts trust each other's network.
"""

from __future__ import annotations

import datetime
import os
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import IO, Iterator

import torch.distributed as dist

from minillm.cli import UsageError

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # a worker waits this long for rank 0 to load its weights and listen
POLL_S = 0.2  # how often a waiting rank looks for a peer's failure


class PeerFailed(RuntimeError):
    """Another rank of the launch failed, went away, or never came."""


@dataclass(frozen=True)
class Rank:
    """This process's place in a launch: global ``rank`` of ``world_size``, ``local_rank`` on its host."""

    rank: int
    world_size: int
    local_rank: int


def launched() -> Rank | None:
    """This process's place in a launch, from the environment torchrun (or :func:`spawn_workers`)
    set; None when nothing launched it, or launched it alone."""
    env = os.environ
    if not all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank = Rank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
    return rank if rank.world_size > 1 else None


def is_worker_rank() -> bool:
    """True in a launch's worker rank (every rank but 0), which serves rank 0 instead of
    loading weights or taking requests."""
    rank = launched()
    return rank is not None and rank.rank > 0


def launch_store(timeout: datetime.timedelta = STORE_TIMEOUT) -> dist.Store:
    """The launch's store (torchrun's agent's, or the one rank 0 hosts), under a prefix of ours
    (a torchrun store holds the launcher's own keys too)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore("minillm", store)


def post_failure(store: dist.Store, rank: int, error: str) -> None:
    """Leave ``rank``'s error where its peers look while they wait for it to connect."""
    store.set(f"failed/{rank}", error)


def posted_failure(store: dist.Store, rank: int) -> str | None:
    """The error ``rank`` left in the store, if any (without waiting)."""
    key = f"failed/{rank}"
    return store.get(key).decode() if store.check([key]) else None


def describe(err: BaseException) -> str:
    """An error as one line, as a peer reports it (a message meant for users as it is)."""
    if isinstance(err, SystemExit):
        return f"exited with status {err.code} (its own output says why)"
    if isinstance(err, (UsageError, PeerFailed)):
        return str(err)
    return f"{type(err).__name__}: {err}"


@contextmanager
def telling_the_launch() -> Iterator[None]:
    """Under a launch, an exception while this rank starts is posted in the launch's store
    before it propagates, so that the ranks waiting for this one stop and say why (a failure
    to reach the store is left out: the peers then wait out their timeout)."""
    try:
        yield
    except BaseException as err:
        rank = launched()
        if rank is not None and not (isinstance(err, SystemExit) and err.code in (0, None)):
            try:
                post_failure(launch_store(datetime.timedelta(seconds=10)), rank.rank, describe(err))
            except Exception:  # noqa: BLE001 - the store is gone; the original error matters more
                pass
        raise


def this_process() -> str:
    """This process as rank 0's messages and banner name it: ``host pid 1234``."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def reachable_address(peer: str) -> str:
    """This host's address on the route to ``peer`` (the store's host): the one other hosts can
    reach us at. ``MINILLM_HOST_IP`` overrides it, for hosts with several networks."""
    if os.environ.get("MINILLM_HOST_IP"):
        return os.environ["MINILLM_HOST_IP"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, 9))  # a UDP "connect" sends nothing: it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class RankZeroListener:
    """Rank 0's end of the rendezvous: listens at ``host`` and posts its address and a fresh
    authentication key in ``store``; :meth:`accept` hands over connected workers as they come."""

    def __init__(self, store: dist.Store, host: str) -> None:
        key = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=key)
        self._accepted: queue.Queue[Connection | Exception] = queue.Queue()
        threading.Thread(target=self._accept_forever, name="minillm-rank-0-accept", daemon=True).start()
        store.set("authkey", key)
        store.set("address", f"{host}:{self._listener.address[1]}")

    def _accept_forever(self) -> None:
        while True:
            try:
                self._accepted.put(self._listener.accept())
            except OSError:  # closed
                return
            except Exception as err:  # a peer that failed the authentication: not one of ours
                self._accepted.put(err)

    def accept(self, timeout: float) -> Connection | Exception | None:
        """The next worker's connection (or the error of a peer that failed to authenticate),
        or None if none came within ``timeout`` seconds."""
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._listener.close()


def connect_to_rank_0(store: dist.Store, timeout: datetime.timedelta = STORE_TIMEOUT) -> Connection:
    """A worker's connection to rank 0, once rank 0 has posted where it listens. Raises if rank
    0 posts a failure instead, or nothing within ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(["address"]):
        failure = posted_failure(store, 0)
        if failure is not None:
            raise PeerFailed(f"rank 0 failed while starting: {failure}")
        if time.monotonic() > deadline:
            raise PeerFailed(f"rank 0 did not listen within {timeout.total_seconds():.0f} s")
        time.sleep(POLL_S)
    host, _, port = store.get("address").decode().rpartition(":")
    return Client((host, int(port)), authkey=store.get("authkey"))


@dataclass
class SpawnedWorker:
    """A worker process :func:`spawn_workers` started, and the file its standard error goes to."""

    rank: int
    process: subprocess.Popen
    stderr: IO[bytes]

    def last_words(self, wait: float = 1.0) -> str:
        """How it ended: its exit status and the end of what it wrote to standard error."""
        try:
            code = self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return "stopped answering (it is still running)"
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace").strip().splitlines()[-12:]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return how + ("; its last lines:\n" + "\n".join(tail) if tail else "")


def spawn_workers(world_size: int) -> tuple[dist.Store, list[SpawnedWorker]]:
    """Rank 0's launch on this machine: a store on a free local port, and ``python -m
    minillm.distributed`` for ranks 1 .. ``world_size - 1`` with the environment torchrun
    would give them. Each worker's standard error goes to a file of its own (its ``stderr``),
    which rank 0 quotes if the worker dies before it can say why."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    package_root = str(Path(__file__).resolve().parents[2])  # so the worker imports this very minillm
    base = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, base.get("PYTHONPATH")]))
    workers = []
    try:
        for rank in range(1, world_size):
            env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}
            stderr = tempfile.TemporaryFile()
            process = subprocess.Popen([sys.executable, "-m", "minillm.distributed"], env=env,
                                       stdin=subprocess.DEVNULL, stderr=stderr)
            workers.append(SpawnedWorker(rank, process, stderr))
    except BaseException:
        for worker in workers:
            worker.process.kill()
        raise
    return dist.PrefixStore("minillm", store), workers  # as launch_store names it in the workers
