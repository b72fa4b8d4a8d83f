"""Flags that environment variables can set too (``--max-queue`` or ``MINILLM_MAX_QUEUE``), and
the checks of the settings they fill: shared by the server and the router, which must start
without torch, so this module imports only the standard library and :mod:`minillm.sizes`.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any, Callable, Mapping, Sequence

from minillm.sizes import parse_memory

ENV_PREFIX = "MINILLM_"
LOG_LEVELS = ("debug", "info", "warning", "error")


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    """``--max-queue`` -> ``MINILLM_MAX_QUEUE``."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def switch_value(variable: str, text: str) -> bool:
    """An environment variable's on/off value, or a ``ValueError`` naming it."""
    try:
        return SWITCH_VALUES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{variable} must be one of 1, true, yes, on, 0, false, no, off; got {text!r}") from None


def byte_size(text: str) -> int:
    """A size in bytes (``1MiB``, ``1048576``) for argparse: a bad one is argparse's one-line error."""
    try:
        return parse_memory(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check(settings: object, rules: Sequence[tuple[str, bool, str]], as_flags: bool = False) -> None:
    """Raise a ``ValueError`` for the first ``(field, holds, rule)`` that does not hold, e.g.
    ``port must be in 0..65535, got 70000`` (``--port must be ...`` with ``as_flags``)."""
    for name, ok, rule in rules:
        if not ok:
            shown = "--" + name.replace("_", "-") if as_flags else name
            raise ValueError(f"{shown} must be {rule}, got {getattr(settings, name)}")


def listener_rules(s: Any) -> list[tuple[str, bool, str]]:
    """The rules the server's and the router's settings share: where they listen, how long
    they drain, and what their own clients may cost them."""
    return [("port", 0 <= s.port <= 65535, "in 0..65535"), ("shutdown_grace", s.shutdown_grace >= 0, ">= 0 seconds"),
            ("keep_alive_timeout", s.keep_alive_timeout > 0, "> 0 seconds"),
            ("client_timeout", s.client_timeout > 0, "> 0 seconds"),
            ("max_connections", s.max_connections >= 1, ">= 1"), ("max_body_bytes", s.max_body_bytes > 0, "> 0 bytes")]


def dataclass_defaults(cls: type) -> dict[str, object]:
    """A settings dataclass's field defaults, without building one (its checks may need input)."""
    return {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}


def add_env_flags(parser: argparse.ArgumentParser, flags: list[tuple[str, Callable[[str], object], str]],
                  defaults: dict[str, object], environ: Mapping[str, str], prefix: str = ENV_PREFIX,
                  choices: Mapping[str, Sequence[str]] | None = None) -> None:
    """Add ``(flag, type, help)`` flags whose defaults come from ``defaults``, or from the
    environment variable ``env_name(flag, prefix)`` when it is set. The variable's value becomes
    the default as a string, so argparse converts and checks it exactly as it would the flag.
    A ``bool`` flag is a switch (``--enforce-eager``, ``--no-enforce-eager``) whose variable
    reads ``1``/``true``/``yes`` or ``0``/``false``/``no``."""
    for flag, kind, text in flags:
        dest = flag.lstrip("-").replace("-", "_")
        variable = env_name(flag, prefix)
        shown = "" if defaults[dest] is None else "; default: %(default)s"  # never echo a key
        if kind is bool:
            default = switch_value(variable, environ[variable]) if variable in environ else defaults[dest]
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{text} [env {variable}{shown}]")
            continue
        parser.add_argument(flag, type=kind, default=environ.get(variable, defaults[dest]),
                            choices=(choices or {}).get(flag), help=f"{text} [env {variable}{shown}]")
