"""Reading a memory size from text: ``"6GiB"``, as flags and options spell it.

A torch-free leaf: the engine's options, the server's flags and the router (which reads
``--max-body-bytes`` with it and must start without torch) all read sizes here.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str | int) -> int:
    """``"6GiB"`` -> 6442450944 bytes; ``"512MB"``, ``"1.5GiB"`` and plain integers also work."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 512MiB, 6GiB or 2GB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value
