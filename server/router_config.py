"""The router's settings: one dataclass, filled from ``python -m server.router``'s flags.

As with the server (:mod:`server.config`), each flag can also come from an environment
variable, here ``MINILLM_ROUTER_<FLAG>`` (``--policy`` is ``MINILLM_ROUTER_POLICY``;
``MINILLM_ROUTER_REPLICA`` takes a comma-separated list of URLs); a flag given on the command
line wins. Anything wrong is one line naming the flag.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from minillm.cli import ArgumentParser, UsageError
from server.flags import LOG_LEVELS, add_env_flags, dataclass_defaults, env_name
from server.routing import POLICIES

ENV_PREFIX = "MINILLM_ROUTER_"
MAX_SPAWN = 16


@dataclass
class RouterConfig:
    """Which replicas, how to pick one, and how hard to try.

    ``max_attempts`` bounds how many replicas one request may try before its first token
    (the first try included). ``health_interval`` is the seconds between active health checks,
    and ``health_timeout`` how long one check may take: less than the interval, so that a
    replica that stops answering is found out within one interval instead of piling up checks.
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
    shutdown_grace: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if bool(self.replicas) == bool(self.spawn):
            raise ValueError("give the replicas with --replica URL (repeatable) or start them with --spawn N, "
                             "one or the other")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica wants a URL like http://127.0.0.1:8001, got {url!r}")
        checks = [("spawn", 0 <= self.spawn <= MAX_SPAWN, f"in 0..{MAX_SPAWN}"),
                  ("port", 0 <= self.port <= 65535, "in 0..65535"),
                  ("health_interval", self.health_interval > 0, "> 0 seconds"),
                  ("health_timeout", self.health_timeout > 0, "> 0 seconds"),
                  ("eject_after", self.eject_after >= 1, ">= 1"), ("readmit_after", self.readmit_after >= 1, ">= 1"),
                  ("max_attempts", self.max_attempts >= 1, ">= 1"),
                  ("connect_timeout", self.connect_timeout > 0, "> 0 seconds"),
                  ("shutdown_grace", self.shutdown_grace >= 0, ">= 0 seconds")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")
        if self.health_timeout >= self.health_interval:
            raise ValueError(f"--health-timeout ({self.health_timeout} s) must be shorter than --health-interval "
                             f"({self.health_interval} s)")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        try:
            shlex.split(self.replica_args)
        except ValueError as err:
            raise ValueError(f"--replica-args cannot be split into flags: {err}") from None

    def replica_flags(self) -> list[str]:
        """The extra ``python -m server`` flags for each spawned replica."""
        return shlex.split(self.replica_args)


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
    ("--max-attempts", int, "replicas one request may try before its first token"),
    ("--connect-timeout", float, "seconds to wait for a replica to accept a connection"),
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
