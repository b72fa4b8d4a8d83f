"""Run ``python -m server`` as a child process, for notebooks, scripts and tests: on a free
port, returned once it answers ``GET /health``, and stopped with SIGTERM (at exit too), which
lets in-flight requests finish before the server exits 0.
"""

from __future__ import annotations

import atexit
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

_BANNER = re.compile(r"serving .* at (http://\S+)")
_RANKS = re.compile(r"split over \d+ processes: (.*)")


class ServerProcess:
    """A running ``python -m server`` child; ``log`` collects every line it prints."""

    def __init__(self, proc: subprocess.Popen, url: str, log: list[str]) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.terminating = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.log)

    def rank_pids(self) -> list[int]:
        """The process id of each rank of a split model, rank 0 first, from the banner's line
        about them (empty for a model in one process)."""
        match = _RANKS.search(self.output())
        return [] if match is None else [int(pid) for pid in re.findall(r"pid (\d+)", match.group(1))]

    def terminate(self) -> None:
        """Ask for a graceful shutdown (SIGTERM) without waiting for it. Sent once only: the
        server takes a second SIGTERM as "stop now", as it does a second Ctrl+C."""
        if self.proc.poll() is None and not self.terminating:
            self.terminating = True
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> int:
        """Stop now, in-flight requests or not (SIGKILL), and reap the process."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def stop(self, grace: float = 30) -> int:
        """SIGTERM, then wait for the graceful exit; kill after ``grace`` + 10 s. Returns the
        exit status (0 after a clean shutdown). Safe to call twice."""
        self.terminate()
        try:
            return self.proc.wait(timeout=grace + 10)
        except subprocess.TimeoutExpired:
            return self.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(servers: Sequence[ServerProcess], grace: float = 30) -> list[int]:
    """Stop every server in ``servers``: SIGTERM to all of them first, then wait for each, so
    they drain side by side and the whole takes one ``grace`` (+ 10 s), not one per server.
    Returns their exit statuses."""
    for server in servers:
        server.terminate()
    return [server.stop(grace) for server in servers]


def torchrun(node_rank: int, nnodes: int, endpoint: str) -> list[str]:
    """The command that launches one process on host ``node_rank`` of ``nnodes``, all meeting
    at ``endpoint`` (``HOST:PORT`` of host 0): ``torchrun``, as ``python -m
    torch.distributed.run`` so that it is this Python's. Put ``-m server ...`` after it."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint]


def server_command(checkpoint: str | Path, *flags: str, launcher: Sequence[str] = (sys.executable,)) -> list[str]:
    """``python -m server`` on ``checkpoint`` on a free port with ``flags``, run by ``launcher``
    (this Python, or a :func:`torchrun` prefix)."""
    return [*launcher, "-m", "server", "--checkpoint", str(checkpoint), "--port", "0", *flags]


def start_server(checkpoint: str | Path, *flags: str, timeout: float = 300, env: dict | None = None,
                 launcher: Sequence[str] = (sys.executable,)) -> ServerProcess:
    """Start the server on ``checkpoint`` with extra ``flags`` on a free port; return once it
    answers ``/health``. Raises ``RuntimeError`` with the server's output if it exits or does
    not come up within ``timeout`` seconds. ``launcher`` runs ``-m server ...``: this Python,
    or host 0's :func:`torchrun` for a model split across hosts (the other hosts run the
    same command with their own ``node_rank``)."""
    proc = subprocess.Popen(server_command(checkpoint, *flags, launcher=launcher), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, log, lines), daemon=True).start()
    server = ServerProcess(proc, "", log)
    atexit.register(server.stop)  # however the caller ends, the server ends with it
    deadline = time.monotonic() + timeout
    try:
        server.url = _wait_for_banner(lines, deadline)
        _wait_for_health(server.url, deadline)
    except (RuntimeError, queue.Empty):
        server.stop()
        raise RuntimeError(f"the server did not come up; it printed:\n{server.output()}") from None
    return server


def _pump(proc: subprocess.Popen, log: list[str], lines: queue.Queue) -> None:
    for line in proc.stdout:
        log.append(line)
        lines.put(line)
    lines.put(None)  # the process closed its output: it has exited


def _wait_for_banner(lines: queue.Queue, deadline: float) -> str:
    while True:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        if line is None:
            raise RuntimeError("the server exited")
        if match := _BANNER.search(line):
            return match.group(1)


def _wait_for_health(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the server never reported healthy")
