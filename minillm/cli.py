"""Command-line plumbing shared by every ``python -m minillm.*`` entry point.

A user who mistypes a flag should read one line that names the problem, not a usage dump
or a traceback; the commands raise ``UsageError`` for problems argparse cannot see (a missing
file, an impossible combination) and ``run`` turns it into that one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Sequence


class UsageError(Exception):
    """A problem with what the user asked for: reported as one line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but errors are one line: ``prog: error: argument --x: invalid int value: 'y'``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None, prog: str = "") -> NoReturn:
    """Call ``main(argv)`` and exit with its status, turning ``UsageError`` into one line."""
    try:
        status = main(argv)
    except UsageError as err:
        print(f"{prog or sys.argv[0]}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog or sys.argv[0]}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)
