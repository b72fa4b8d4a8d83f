"""Benchmarks: speed measured side by side in one run, saved as JSON and a plot.

``python -m minillm.bench engine`` compares every generation method of chapters 5-8 (and
Hugging Face ``generate``) on one workload. Results go to ``benchmarks/results/``.

What the benchmarks share lives here, importing nothing beyond the standard library up front:
:mod:`minillm.bench.gpu_check` must start where torch does not.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable

from minillm.cli import UsageError
from minillm.settings import project_root

OPTIONS = {  # flag -> add_argument options, for the flags several benchmarks take
    "--preset": dict(default="tinystories-50m"),
    "--dtypes": dict(default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16"),
    "--repeats": dict(type=int, default=3, help="interleaved rounds of every method (median and spread)"),
    "--no-hf": dict(action="store_true", help="skip the transformers baseline"),
    "--device": dict(default=None),
    "--out": dict(default=None, help="results directory (default: benchmarks/results)"),
    "--smoke": dict(action="store_true", help="a tiny run that checks the benchmark works (CI)"),
}


def add_options(p, *flags: str, **defaults) -> None:
    """Add the shared ``flags`` to parser ``p``; ``defaults`` (by destination name) replace theirs."""
    from minillm.model.config import PRESETS

    for flag in flags:
        options = dict(OPTIONS[flag], **({"choices": sorted(PRESETS)} if flag == "--preset" else {}))
        dest = flag[2:].replace("-", "_")
        p.add_argument(flag, **(options | {"default": defaults[dest]} if dest in defaults else options))


def results_dir(out: str | None) -> Path:
    """``--out``, else the checkout's ``benchmarks/results``."""
    return Path(out) if out else (project_root() or Path.cwd()) / "benchmarks" / "results"


def command_line(argv: list[str] | None = None) -> str | None:
    """The command that is running, as one would type it again (``python -m minillm.bench decode
    --batches 1,8``), when it is one of this project's modules run as a script; None otherwise
    (a notebook's kernel, a test runner)."""
    argv = sys.argv if argv is None else argv
    root, script = project_root(), Path(argv[0]).resolve() if argv else None
    if root is None or script is None or script.suffix != ".py" or not script.is_relative_to(root):
        return None
    parts = list(script.relative_to(root).with_suffix("").parts)
    if not (root / parts[0] / "__init__.py").is_file():  # a tool under the checkout (.venv's pytest), not ours
        return None
    if parts[-1] == "__main__":
        parts.pop()
    return " ".join(["python", "-m", ".".join(parts), *argv[1:]])


def save_report(report: dict, path: Path, plot: Callable[[dict, Path], object] | None = None, **dumps) -> Path:
    """``report`` as JSON at ``path`` and, given ``plot(report, png)``, its figure beside it. A
    report saved from a terminal records the command that made it, so it can be made again."""
    command = command_line()
    if command is not None:
        report = {**report, "command": command}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, **dumps) + "\n")
    if plot is not None:
        plot(report, path.with_suffix(".png"))
    return path


def interleaved_times(variants: dict[str, Callable[[], object]], device, rounds: int) -> dict[str, list[float]]:
    """Each variant's seconds in each of ``rounds`` rounds, every variant timed once a round
    (after one untimed warm-up each), so a machine whose speed drifts moves them all alike."""
    from minillm.machine.hardware import median_seconds

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(median_seconds(fn, device, repeats=1, warmup=0 if times[name] else 1))
    return times


def pyplot():
    """matplotlib's pyplot for figures written to files. From a terminal it switches to the Agg
    backend, so a benchmark never opens a window; inside a notebook's kernel it leaves the
    inline backend alone, since switching would silently stop the notebook's own figures showing."""
    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """``fig`` laid out, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Straight to 127.0.0.1: an http_proxy in the environment must not carry local requests away.
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@contextmanager
def local_server(command: list[str], port: int, log: IO[str], *, name: str, timeout: float,
                 error: type[Exception] = RuntimeError, env: dict | None = None) -> Iterator[str]:
    """``command``, a server listening on ``port``, running for the ``with`` block once it
    answers ``/health``; yields its URL. Its output goes to ``log``, a file, not a pipe: a full
    pipe would stall it. Raises ``error`` if it exits or is not ready within ``timeout`` s."""
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise error(f"{name} exited with status {server.returncode}:\n{tail(log.read())}")
            try:
                with LOCAL.open(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # still loading (503) or not listening yet
            if time.monotonic() > deadline:
                raise error(f"{name} was not ready within {timeout:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()  # SIGTERM: the server finishes what it holds and exits
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        raise UsageError(f"batch sizes look like 1,8,32, not {text!r}") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"batch sizes must be at least 1, got {text!r}")
    return batches
