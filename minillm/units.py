"""Reading sizes and dtypes from text: ``"6GiB"`` and ``"bf16"``, as flags and options spell them.

A small leaf that the engine's options, the server's flags and the benchmarks share, so none
of them imports another just to read a memory size. ``parse_memory`` itself lives in
:mod:`minillm.sizes`, which needs no torch (the router reads sizes too); it is imported here so
that every caller keeps one place to import both from.
"""

from __future__ import annotations

import torch

from minillm.hardware import DTYPES as HW_DTYPES
from minillm.sizes import parse_memory

__all__ = ["DTYPES", "parse_memory", "resolve_dtype"]

# Chapter 1's short names (fp32, bf16, fp16) and PyTorch's own (float32, bfloat16, float16).
DTYPES = {**HW_DTYPES, **{str(dtype).removeprefix("torch."): dtype for dtype in HW_DTYPES.values()}}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` -> ``torch.bfloat16``; ``None`` keeps the model's own."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None
