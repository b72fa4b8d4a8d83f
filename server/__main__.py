"""``python -m server``: load a model, start the engine loop, serve until SIGINT or SIGTERM.

Under ``torchrun`` (a split model across hosts) every rank runs the same command: rank 0
serves as below; every other rank serves rank 0 its part of the model, and exits when rank 0
stops (see :mod:`minillm.distributed.rendezvous`).

Shutdown is graceful, in this order: the signal sets an event; the server stops listening
and answers 503 to new requests on open connections, and at once to requests still queued
in the engine (they would only wait out the grace for a slot); requests already running get
``--shutdown-grace`` seconds to finish their streams; whatever is still running just before
that ends with an error event and ``[DONE]`` (a 503 if nothing was sent yet); the engine
thread stops; the process exits 0. A second Ctrl+C skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from aiohttp import web
from torch import nn

from minillm.cli import UsageError, run
from minillm.distributed.rendezvous import PeerFailed, is_worker_rank, telling_the_launch
from minillm.engine.build import build_engine, check_device
from minillm.engine.config import EngineOptionError
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.memory import describe_cache
from minillm.machine.hardware import default_device
from minillm.speedups.packed import PackedLinear
from minillm.data.tokenizer import get_tokenizer
from minillm.train.trainer import load_or_train
from server.app import STATE, create_app
from server.config import ServerConfig, flag_error, parse_args
from server.connections import serve, stop_on_signals

log = logging.getLogger("server")


def build(config: ServerConfig) -> LLMEngine:
    """The engine to serve: ``--checkpoint``, or the newest ``cpu`` preset (trained on first
    use), on ``--device``, cast, quantized, split and drafting as the flags say. A problem
    is a ``UsageError`` naming the flag."""
    try:
        device = check_device(config.device) if config.device else default_device()
        # A worker rank of a torchrun launch takes its part of the weights from rank 0, serves
        # it inside build_engine and ends there: it loads (or trains) nothing.
        model = None if is_worker_rank() else config.checkpoint or load_or_train("cpu", device)
        return build_engine(model, config.engine_config(), device=device, dtype=config.dtype,
                            quantize=config.quantize, speculative_draft=config.speculative_draft,
                            num_speculative_tokens=config.num_speculative_tokens,
                            speculative_disable_by_batch_size=config.speculative_disable_by_batch_size,
                            tokenizer=get_tokenizer())
    except EngineOptionError as err:
        raise flag_error(err) from None
    except (ValueError, PeerFailed) as err:  # PeerFailed: another rank of a torchrun launch says why
        raise UsageError(str(err)) from None


def prepare_decode(engine: LLMEngine) -> str:
    """Compile or record every decode bucket now, before the first request would wait for
    one; returns the banner's line about it (how long it took says whether a cache served)."""
    graphs = engine.graphs
    if graphs is None:
        return f"decode steps run eagerly ({engine.eager_reason})"
    seconds = graphs.prepare()
    what = "CUDA graphs recorded" if graphs.mode == "cuda-graph" else "compiled with torch.compile"
    return f"decode steps {what} for batches of {graphs.buckets[0]}..{graphs.max_batch} in {seconds:.1f} s"


def model_line(engine: LLMEngine, config: ServerConfig) -> str:
    """The banner's line about what computes: device, precision (or quantized weights), whether
    the weights were packed for the CPU's kernels, the attention kernels, and the speed-ups that
    depend on the launch (a draft model, overlap scheduling), so a log says what ran."""
    model = engine.model
    dtype = str(model.dtype).removeprefix("torch.")
    parts = [f"model on {model.device} in {f'{config.quantize} weights, {dtype} activations' if config.quantize else dtype}"]
    if isinstance(model, nn.Module) and any(isinstance(m, PackedLinear) for m in model.modules()):  # a split model is not one
        parts.append("weights packed for the CPU's kernels")
    parts.append(f"attention: {engine.attention_name}")
    if config.speculative_draft:
        parts.append(f"speculating with {config.speculative_draft}")
    if engine.overlap:
        parts.append("overlap scheduling")
    return "; ".join(parts)


def memory_line(engine: LLMEngine) -> str:
    """The banner's line about memory: ``--memory-budget``'s split when one was given, else
    the KV cache's size and what it holds."""
    if engine.memory is not None:
        return engine.memory.describe()
    pool = engine.pool
    return describe_cache(pool.nbytes, pool.num_blocks, pool.block_size, engine.model.cfg.context_length)


def ranks_line(engine: LLMEngine) -> str:
    """The banner's line about a split model's ranks: where each one runs (empty for a model in
    this one process)."""
    workers = getattr(engine.model, "workers", None)
    return "" if workers is None else f"split over {len(workers.conns) + 1} processes: {workers.describe()}"


def banner(config: ServerConfig, port: int, *notes: str) -> str:
    """What to paste to try the server: its URL, a curl command and an ``openai`` snippet,
    after ``notes`` (the model, decode and memory lines), one a line.
    A key is never printed (stdout often ends up in logs): with one, both snippets read it
    from ``OPENAI_API_KEY``, where the ``openai`` client looks by default."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    url, name = f"http://{host}:{port}", config.served_model_name
    curl_auth, client_key, key_note = "", ', api_key="none"', ""
    if config.api_key:
        curl_auth, client_key = ' -H "Authorization: Bearer $OPENAI_API_KEY"', ""
        key_note = ("  (an API key is required: export OPENAI_API_KEY=<the key> where the client runs; "
                    "the dashboard asks for it as a password)\n")
    return f"""
minillm is serving {name!r} at {url}   (Ctrl+C to stop)
{key_note}{"".join(f"  {note}{chr(10)}" for note in notes)}
  curl {url}/v1/completions -H "Content-Type: application/json"{curl_auth} \\
    -d '{{"model": "{name}", "prompt": "Once upon a time", "max_tokens": 40, "stream": true}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1"{client_key})
  print(client.completions.create(model="{name}", prompt="Once upon a time", max_tokens=40).choices[0].text)

  dashboard {url}/   health {url}/health   metrics {url}/metrics
""".rstrip() + "\n"


async def _serve_until_signalled(app: web.Application, config: ServerConfig, notes: list[str]) -> bool:
    """Serve until the first SIGINT or SIGTERM, or until the engine loop crashes; True in the
    last case. A second Ctrl+C stops at once (:func:`server.connections.stop_on_signals`)."""
    stop = stop_on_signals()
    crashed = False

    def on_crash() -> None:
        nonlocal crashed
        crashed = True
        stop.set()

    app[STATE].engine.on_crash = on_crash
    await serve(app, config, stop, lambda url: print(banner(config, int(url.rpartition(":")[2]), *notes), flush=True))
    return crashed


def main(argv: Sequence[str] | None = None) -> int:
    with telling_the_launch():  # under torchrun, the other ranks learn why this one could not start
        config = parse_args(argv)
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        engine = build(config)
    try:
        notes = [note for note in (model_line(engine, config), prepare_decode(engine), memory_line(engine),
                                   ranks_line(engine)) if note]
        for note in notes:
            log.info(note)
        crashed = asyncio.run(_serve_until_signalled(create_app(engine, config), config, notes))
    finally:
        engine.close()  # a tensor-parallel model's workers
    if crashed:  # a live process answering 500 for ever helps nobody: exit, and let a supervisor restart it
        log.error("the engine loop stopped (see above); exiting")
        return 1
    return 0


if __name__ == "__main__":
    run(main, prog="python -m server")
