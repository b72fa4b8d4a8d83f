"""llama.cpp as the yardstick: its own benchmarks and its greedy tokens, on our exported GGUF.

``make llamacpp`` builds ``llama-bench``, ``llama-batched-bench`` and ``llama-server`` into
``.cache/llama.cpp/bin`` (or point ``MINILLM_LLAMACPP_BIN`` at a folder that holds them).
Each helper raises :class:`LlamaCppError` with a message that says what failed (a missing
binary, the program's own last lines of output), never a bare subprocess traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from minillm.bench import LOCAL, free_port, local_server, tail
from minillm.export.gguf import gguf_context_length
from minillm.settings import home

BIN_ENV = "MINILLM_LLAMACPP_BIN"
BINARIES = ("llama-bench", "llama-batched-bench", "llama-server")
BATCH_SIZES = (1, 8, 32, 64)


class LlamaCppError(RuntimeError):
    """A llama.cpp program is missing, failed, or answered something we cannot read."""


def bin_dir() -> Path:
    """Where the llama.cpp programs are: ``$MINILLM_LLAMACPP_BIN``, else ``make llamacpp``'s output."""
    return Path(os.environ.get(BIN_ENV) or home() / ".cache" / "llama.cpp" / "bin")


def binary(name: str) -> Path:
    """The path of one llama.cpp program, or an error that says how to get it."""
    path = bin_dir() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaCppError(f"{name} not found in {bin_dir()}: build it with `make llamacpp`, or set {BIN_ENV}")
    return path


def available() -> bool:
    """True when every program these helpers run is there."""
    return all((bin_dir() / name).is_file() and os.access(bin_dir() / name, os.X_OK) for name in BINARIES)


def _model(gguf_path: str | Path, positions: int | None = None) -> Path:
    """The GGUF file, checked to exist and, given ``positions``, to have that many: a GPT-2
    model has a learned table of positions, and llama.cpp cannot run past its end."""
    path = Path(gguf_path)
    if not path.is_file():
        raise LlamaCppError(f"no GGUF file at {path} (write one with minillm.export.gguf.export_gguf)")
    if positions is not None and positions > (context := gguf_context_length(path)):
        raise LlamaCppError(f"{positions} positions are beyond the model's context of {context}")
    return path


def _run(args: list[str], timeout: float) -> str:
    """Run a llama.cpp program and return its standard output, or raise with its last words."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{Path(args[0]).name} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise LlamaCppError(
            f"{Path(args[0]).name} exited with status {done.returncode}:\n{tail(done.stderr + done.stdout)}"
        )
    return done.stdout


def llama_bench_tg(
    gguf_path: str | Path, n_gen: int = 128, *, threads: int = 2, repetitions: int = 5, timeout: float = 1800
) -> float:
    """Batch-1 decode rate in tokens/s: ``llama-bench``'s ``tg{n_gen}`` row (``n_gen`` generated
    tokens after an empty prompt, the mean over ``repetitions`` runs)."""
    model = _model(gguf_path, n_gen)
    out = _run([str(binary("llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_gen), "-t", str(threads),
                "-r", str(repetitions), "-o", "json"], timeout)
    try:
        rows = json.loads(out)
        return next(float(r["avg_ts"]) for r in rows if r["n_prompt"] == 0 and r["n_gen"] == n_gen)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise LlamaCppError(f"llama-bench printed no tg{n_gen} row:\n{tail(out)}") from None


def batched_bench_tg(
    gguf_path: str | Path,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    *,
    n_prompt: int = 16,
    n_gen: int = 128,
    threads: int = 2,
    timeout: float = 3600,
    repack: bool = True,
) -> dict[int, float]:
    """Decode rate in tokens/s (all sequences together) for each batch size: ``llama-batched-bench``
    runs ``B`` sequences of ``n_prompt`` prompt tokens, then ``n_gen`` steps that each decode one
    token for every sequence; its ``S_TG`` is ``B * n_gen`` over those steps' time.

    The KV cache is sized for the largest batch (``-c``): llama-batched-bench silently skips any
    batch that does not fit, so a missing row is an error here. ``repack=False`` keeps the
    weights as stored rather than laid out for this CPU's instructions (``--no-repack``)."""
    model = _model(gguf_path, n_prompt + n_gen)
    kv_cells = max(batch_sizes) * (n_prompt + n_gen)
    out = _run([str(binary("llama-batched-bench")), "-m", str(model), "-c", str(kv_cells),
                "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join(map(str, batch_sizes)),
                "-t", str(threads), "--output-format", "jsonl", *([] if repack else ["--no-repack"])], timeout)
    rates: dict[int, float] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    missing = [b for b in batch_sizes if b not in rates]
    if missing:
        raise LlamaCppError(f"llama-batched-bench reported no row for batch sizes {missing}:\n{tail(out)}")
    return {b: rates[b] for b in batch_sizes}


@contextmanager
def llama_server(gguf_path: str | Path, *, threads: int = 2, slots: int = 1,
                 startup_timeout: float = 120) -> Iterator[str]:
    """``llama-server`` on a free local port for the ``with`` block; yields its base URL.

    ``slots`` requests at once (llama.cpp's continuous batching: its ``--max-num-seqs``), each
    with the model's whole context, and an ``f32`` KV cache: llama.cpp's default ``f16`` cache
    rounds every key and value, which is a difference in the cache, not in the model."""
    port = free_port()
    model = _model(gguf_path)
    args = [str(binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * gguf_context_length(model)), "-t", str(threads),
            "-ctk", "f32", "-ctv", "f32", "--no-webui"]
    with tempfile.TemporaryFile("w+") as log, local_server(args, port, log, name="llama-server",
                                                            timeout=startup_timeout, error=LlamaCppError) as url:
        yield url


def server_greedy_tokens(url: str, prompt_ids: Sequence[int], n: int, timeout: float = 300) -> list[int]:
    """The running server's greedy continuation of ``prompt_ids``: up to ``n`` token ids, ending
    early after ``<|endoftext|>`` (included, as our ``stop_token`` includes it)."""
    body = {"prompt": list(prompt_ids), "n_predict": n, "temperature": 0.0, "top_k": 1,
            "return_tokens": True, "cache_prompt": False, "stream": False}
    request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with LOCAL.open(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise LlamaCppError(f"llama-server refused the request ({err.code}): {err.read().decode()[:500]}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        raise LlamaCppError(f"llama-server did not answer: {err}") from None
    if not isinstance(answer.get("tokens"), list):
        raise LlamaCppError(f"llama-server's answer has no token ids: {str(answer)[:500]}")
    return [int(t) for t in answer["tokens"]]

