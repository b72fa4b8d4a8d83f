"""The router's settings: one dataclass, filled from ``python -m server.router``'s flags or,
as with the server, environment variables (``MINILLM_ROUTER_POLICY``; ``MINILLM_ROUTER_REPLICA``
takes a comma-separated list of URLs). Anything wrong is one line naming the flag.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from minillm.cli import ArgumentParser, UsageError
from minillm.sizes import parse_memory
from server.connections import CLIENT_FLAGS, CLIENT_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_CONNECTIONS
from server.flags import LOG_LEVELS, add_env_flags, byte_size, check, dataclass_defaults, env_name, listener_rules
from server.router.policy import POLICIES
from server.wire import MAX_BODY_BYTES

ENV_PREFIX = "MINILLM_ROUTER_"
MAX_SPAWN = 16


@dataclass
class RouterConfig:
    """Which replicas, how to pick one, and how hard to try (each field is a flag; ``FLAGS``
    says what it does). Towards its own clients the router keeps the server's rules.

    Spawned replicas get the router's ``max_body_bytes``, and a ``--max-body-bytes`` in
    ``replica_args`` must be the same: a body the router accepts and every replica refuses would
    only be a slower 413, and one the router refuses would never reach a replica that accepts
    it. Refusing the mismatch, rather than quietly taking one of the two, keeps the user from
    believing the one that lost. (A ``--replica`` URL's limit is its own; the router cannot see it.)
    """

    replicas: list[str] = field(default_factory=list)
    spawn: int = 0
    checkpoint: str | None = None
    replica_args: str = ""
    policy: str = "least-outstanding"
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval: float = 1.0
    health_timeout: float = 0.5
    eject_after: int = 2
    readmit_after: int = 2
    max_attempts: int = 3
    connect_timeout: float = 2.0
    first_byte_timeout: float = 60.0
    max_body_bytes: int = MAX_BODY_BYTES
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S
    client_timeout: float = CLIENT_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    shutdown_grace: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if bool(self.replicas) == bool(self.spawn):
            raise ValueError("give the replicas with --replica URL (repeatable) or start them with --spawn N, "
                             "one or the other")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica wants a URL like http://127.0.0.1:8001, got {url!r}")
        check(self, [*listener_rules(self), ("spawn", 0 <= self.spawn <= MAX_SPAWN, f"in 0..{MAX_SPAWN}"),
                     ("health_interval", self.health_interval > 0, "> 0 seconds"),
                     ("health_timeout", self.health_timeout > 0, "> 0 seconds"),
                     ("eject_after", self.eject_after >= 1, ">= 1"), ("readmit_after", self.readmit_after >= 1, ">= 1"),
                     ("max_attempts", self.max_attempts >= 1, ">= 1"),
                     ("connect_timeout", self.connect_timeout > 0, "> 0 seconds"),
                     ("first_byte_timeout", self.first_byte_timeout > 0, "> 0 seconds")], as_flags=True)
        if self.health_timeout >= self.health_interval:
            raise ValueError(f"--health-timeout ({self.health_timeout} s) must be shorter than --health-interval "
                             f"({self.health_interval} s)")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self._check_replica_args()

    def _check_replica_args(self) -> None:
        try:
            flags = shlex.split(self.replica_args)
        except ValueError as err:
            raise ValueError(f"--replica-args cannot be split into flags: {err}") from None
        given = flag_value(flags, "--max-body-bytes")
        if given is None:
            return
        try:
            limit = parse_memory(given)
        except ValueError as err:
            raise ValueError(f"--replica-args: --max-body-bytes: {err}") from None
        if limit != self.max_body_bytes:
            raise ValueError(f"--replica-args gives the replicas --max-body-bytes {given} ({limit} bytes), the router's "
                             f"--max-body-bytes is {self.max_body_bytes} bytes: give the router the same limit "
                             "(it passes its own on to the replicas it spawns)")

    def replica_flags(self) -> list[str]:
        """The extra ``python -m server`` flags for each spawned replica: ``replica_args``, and
        the router's ``--max-body-bytes`` unless they name it already (the same: see above)."""
        flags = shlex.split(self.replica_args)
        if flag_value(flags, "--max-body-bytes") is None:
            flags += ["--max-body-bytes", str(self.max_body_bytes)]
        return flags


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value ``flags`` give ``name`` (``--name V`` or ``--name=V``; the last, as argparse
    reads it), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag[len(name) + 1:]
    return value


# (flag, type, help); the default comes from RouterConfig.
FLAGS = [
    ("--spawn", int, "start N local replicas (python -m server) and route to them"),
    ("--checkpoint", str, "the checkpoint spawned replicas serve (default: the cpu preset's)"),
    ("--replica-args", str, "extra flags for each spawned replica, e.g. '--kv-cache-memory 256MiB'"),
    ("--policy", str, "round-robin | least-outstanding | load-aware | prefix"),
    ("--host", str, "address to listen on"),
    ("--port", int, "port to listen on (0: any free port)"),
    ("--health-interval", float, "seconds between health checks of each replica"),
    ("--health-timeout", float, "seconds one health check may take (less than --health-interval)"),
    ("--eject-after", int, "failed health checks in a row that take a replica out"),
    ("--readmit-after", int, "passed health checks in a row that bring it back"),
    ("--max-attempts", int, "replicas one request may try while they refuse it (connection refused, 429, 503)"),
    ("--connect-timeout", float, "seconds to wait for a replica to accept a connection"),
    ("--first-byte-timeout", float, "seconds a replica has to send its status line and a stream's first event "
                                    "(504 past it, not retried)"),
    *CLIENT_FLAGS,
    ("--max-body-bytes", byte_size, "largest request body accepted (413 beyond), e.g. 1MiB; passed on to "
                                    "spawned replicas"),
    ("--shutdown-grace", float, "seconds in-flight requests may finish after SIGTERM"),
    ("--log-level", str.lower, "debug | info | warning | error"),
]


def build_parser(environ: Mapping[str, str] | None = None) -> ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = ArgumentParser(prog="python -m server.router",
                            description="An OpenAI-compatible router in front of several minillm servers: "
                                        "load balancing, health checks, failover, streaming passthrough.")
    replica_variable = env_name("--replica", ENV_PREFIX)
    parser.add_argument("--replica", dest="replicas", action="append", default=None, metavar="URL",
                        help=f"a replica's base URL; repeat for each [env {replica_variable}, comma-separated]")
    parser.set_defaults(env_replicas=[u for u in environ.get(replica_variable, "").split(",") if u.strip()])
    add_env_flags(parser, FLAGS, dataclass_defaults(RouterConfig), environ, ENV_PREFIX,
                  choices={"--log-level": LOG_LEVELS, "--policy": tuple(POLICIES)})
    return parser


def parse_router_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Flags and environment to a checked ``RouterConfig``; any problem is a ``UsageError``."""
    args = vars(build_parser(environ).parse_args(argv))
    env_replicas = args.pop("env_replicas")
    args["replicas"] = [u.strip() for u in args["replicas"] or env_replicas]
    try:
        return RouterConfig(**args)
    except ValueError as err:
        raise UsageError(str(err)) from None
