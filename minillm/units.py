"""Reading sizes and dtypes from text: ``"6GiB"`` and ``"bf16"``, as flags and options spell them.

A small leaf that the engine's options, the server's flags and the benchmarks share, so none
of them imports another just to read a memory size.
"""

from __future__ import annotations

import re

import torch

from minillm.hardware import DTYPES as HW_DTYPES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

# Chapter 1's short names (fp32, bf16, fp16) and PyTorch's own (float32, bfloat16, float16).
DTYPES = {**HW_DTYPES, **{str(dtype).removeprefix("torch."): dtype for dtype in HW_DTYPES.values()}}


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


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16``; ``None`` keeps the model's own."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None
