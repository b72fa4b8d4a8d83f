"""The server's settings: one dataclass, filled from flags or environment variables.

Every flag ``--some-flag`` can also be set as ``MINILLM_SOME_FLAG``, the way containers and
process managers like to configure a service; a flag on the command line wins. The engine's
options are checked by the engine alone (:func:`~minillm.engine.build.check_options`, as
``LLM`` checks them), before any weights load, and reported here as their flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Mapping, Sequence

from minillm.cli import ArgumentParser, UsageError
from minillm.engine.build import check_options
from minillm.engine.config import EngineConfig, EngineOptionError
from server.connections import CLIENT_FLAGS, CLIENT_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_CONNECTIONS
from server.flags import LOG_LEVELS, add_env_flags, byte_size, check, dataclass_defaults, env_name, listener_rules
from server.wire import MAX_BODY_BYTES


@dataclass
class ServerConfig:
    """What to serve, where, and how much work to take on (each field is a flag; ``FLAGS``
    says what it does). A request arriving when ``max_queue`` are already waiting beyond the
    batch's free seats (``max_num_seqs``) is answered 429 at once, because queueing it would
    only make every client wait longer.
    """

    checkpoint: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None
    dtype: str | None = None
    kv_cache_memory: str | None = None
    memory_budget: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_queue: int = 1024
    api_key: str | None = None
    served_model_name: str = "minillm"
    log_level: str = "info"
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_grace: float = 30.0
    stall_timeout: float = 60.0
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S
    client_timeout: float = CLIENT_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    attention: str | None = None
    speculative_draft: str | None = None
    num_speculative_tokens: int = 4
    speculative_disable_by_batch_size: int | None = None
    quantize: str | None = None
    enforce_eager: bool | None = None
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        check(self, [*listener_rules(self), ("stall_timeout", self.stall_timeout > 0, "> 0 seconds"),
                     ("max_queue", self.max_queue >= 1, ">= 1")])
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        # the engine's own checks, now rather than after loading the model
        check_options(self.engine_config(), dtype=self.dtype, quantize=self.quantize,
                      speculative_draft=self.speculative_draft, num_speculative_tokens=self.num_speculative_tokens,
                      speculative_disable_by_batch_size=self.speculative_disable_by_batch_size)

    def engine_config(self) -> EngineConfig:
        """The engine's share of the settings: each ``EngineConfig`` field the server has a flag for."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig) if hasattr(self, f.name)})


# (flag, type, help) in the order --help shows them; the default comes from ServerConfig.
FLAGS: list[tuple[str, Callable[[str], object], str]] = [
    ("--checkpoint", str, "a checkpoint file, or the directory `python -m minillm.train --out` wrote "
                          "(default: the newest cpu-preset model, trained on first use)"),
    ("--host", str, "address to listen on"),
    ("--port", int, "port to listen on (0: any free port)"),
    ("--device", str, "cpu | cuda | cuda:1 | mps (default: the best available)"),
    ("--dtype", str, "float32 | bfloat16 | float16 (default: the checkpoint's)"),
    ("--kv-cache-memory", str, "KV cache size alone, e.g. 6GiB (default: 1GiB on a CPU, 90%% of free GPU memory; "
                                   "or see --memory-budget)"),
    ("--memory-budget", str, "the whole server's memory, e.g. 6GiB: on a GPU its device memory, on a CPU the "
                                 "process's resident memory (torch included). At start the engine measures the "
                                 "weights, the runtime and the activations of its largest step (--max-num-seqs, "
                                 "--max-num-batched-tokens), and the KV cache gets the rest; per rank with "
                                 "--tensor-parallel-size. Not with --kv-cache-memory"),
    ("--block-size", int, "tokens per KV block"),
    ("--max-num-seqs", int, "most requests running at once"),
    ("--max-num-batched-tokens", int, "most tokens computed in one engine step"),
    ("--max-queue", int, "requests that may wait for a seat in the batch; beyond, new ones get 429"),
    ("--api-key", str, "require the key on every route but /health: `Authorization: Bearer KEY`, or from a "
                       "browser (the dashboard) HTTP Basic auth with the key as the password"),
    ("--served-model-name", str, "the model name clients send and /v1/models lists"),
    ("--log-level", str.lower, "debug | info | warning | error"),
    ("--max-body-bytes", byte_size, "largest request body accepted (413 beyond), e.g. 1MiB"),
    ("--shutdown-grace", float, "seconds in-flight requests may finish after SIGTERM"),
    ("--stall-timeout", float, "seconds one engine step may run before /health answers 503"),
    *CLIENT_FLAGS,
    ("--tensor-parallel-size", int, "split the model over N processes (N must divide its attention heads; "
                                    "one GPU each on CUDA)"),
    ("--pipeline-parallel-size", int, "split the model's blocks into N stages, one process each (N from 1 to its "
                                      "layers; one GPU each on CUDA); N batches are kept in flight so the stages "
                                      "overlap"),
    ("--attention", str.lower, "torch | torch-loop (chapter 8's one-sequence-at-a-time decode) | triton "
                               "(chapter 16's kernels: a CUDA GPU and `pip install -e .[triton]`; on a CPU "
                               "Triton's interpreter, exact but very slow) | cpu (a C++ decode attention that "
                               "reads the KV cache in place, built on first use); default, in one process: "
                               "triton on a CUDA GPU where Triton is installed, cpu on a CPU where a C++ "
                               "compiler is, torch elsewhere"),
    ("--speculative-draft", str, "speculative decoding (chapter 15): a draft model's checkpoint, or `ngram` for "
                                 "prompt lookup; every decoding request of a step drafts, up to the batch size "
                                 "where speculation stops paying. A draft guesses only among the tokens of its "
                                 "own training text, when its checkpoint counted them"),
    ("--num-speculative-tokens", int, "most draft tokens per request and step (with --speculative-draft); each "
                                      "request's own number follows how many of its drafts are accepted"),
    ("--speculative-disable-by-batch-size", int, "speculate only in steps of at most N requests (with "
                                                 "--speculative-draft; default: the largest batch where the engine "
                                                 "measures that speculation still pays)"),
    ("--enforce-eager", bool, "run every step eagerly (the reference path); --no-enforce-eager runs decode-only "
                              "steps as captured programs: CUDA graphs, or on a CPU torch.compile (about half a "
                              "minute per batch bucket the first time, cached in .cache/inductor). Default: CUDA "
                              "graphs on a GPU, eager on a CPU"),
    ("--async-scheduling", bool, "overlap scheduling: prepare each step, and stream the previous step's tokens, "
                                 "while the model computes (a request that ends is seen one step late, its extra "
                                 "token dropped); --no-async-scheduling runs one step after another (the reference). "
                                 "Default: on a GPU; off on a CPU, whose cores the forward already keeps busy; never "
                                 "with a split model. With --speculative-draft, steps that speculate run serially "
                                 "and the others overlap"),
    ("--quantize", str.lower, "int8 | int4: weight-only quantization of the model's matrices (chapter 14); "
                            "activations are then bf16 unless --dtype says otherwise"),
]


def build_parser(environ: Mapping[str, str] | None = None) -> ArgumentParser:
    """The ``python -m server`` parser."""
    parser = ArgumentParser(
        prog="python -m server",
        description="An OpenAI-compatible streaming server for a minillm model. "
        f"Every flag can also be set as an environment variable, e.g. {env_name('--port')}.",
    )
    add_env_flags(parser, FLAGS, dataclass_defaults(ServerConfig), os.environ if environ is None else environ,
                  choices={"--log-level": LOG_LEVELS})
    return parser


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags and environment to a checked ``ServerConfig``; any problem is a ``UsageError``."""
    try:
        return ServerConfig(**vars(build_parser(environ).parse_args(argv)))
    except EngineOptionError as err:
        raise flag_error(err) from None
    except ValueError as err:  # a setting's check, or an environment variable argparse never saw
        raise UsageError(str(err)) from None


def flag_error(err: EngineOptionError) -> UsageError:
    """An engine option's error in the server's terms: ``--its-flag: the engine's message``."""
    return UsageError(f"--{err.option.replace('_', '-')}: {err.message}")
