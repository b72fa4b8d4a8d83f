"""A model's weights in 2 MB pages, so that a decode step streams them with fewer page walks.

A decode step reads every weight once. Linux backs a process's memory with 4 KB pages unless
the process asks otherwise, so the 51M preset's 204 MB of fp32 weights span 50,000 pages, and
the core's TLB, which remembers where a few thousand of them lie, forgets each one before the
next step comes back to it: every 4 KB of weights read costs a page walk. Backed by 2 MB pages
the same weights are about a hundred pages. Many distributions leave transparent huge pages in
``madvise`` mode, where a process gets them only for memory it marks with
``madvise(MADV_HUGEPAGE)``; PyTorch's allocator marks its own blocks only when the
``THP_MEM_ALLOC_ENABLE=1`` environment variable is set before it starts, and then only blocks of
2 MB or more, which leaves out the 1 MB matrices of this preset.

:func:`into_huge_pages` copies a model's parameters into one mapping aligned to 2 MB and marked
that way, and points each parameter at its place there (the same ``Parameter`` objects, the
same numbers). On a 2-core Xeon with AMX (51M shape, fp32, eager steps with packed weights)
a decode step took 10.9 ms at batch 1 against 11.4 ms, and 15.1 ms at batch 8 against 15.6-17.2.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch
import torch.nn as nn

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # from <sys/mman.h> on Linux
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Set on a parameter moved here, so that a second engine over the same model leaves it where it
# is (the first engine's packed copies know it by its address).
MOVED = "_minillm_huge_pages"


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages: Linux with them on ``always``
    or ``madvise`` (``never``, or another OS: no)."""
    if not sys.platform.startswith("linux") or not THP_SETTING.is_file():
        return False
    setting = THP_SETTING.read_text()
    return "[always]" in setting or "[madvise]" in setting


def into_huge_pages(model: nn.Module) -> bool:
    """Move the data of ``model``'s CPU parameters into one anonymous mapping backed by 2 MB
    pages; False (and nothing moved) where this process cannot ask for them. Call it before
    anything keeps a parameter's address (packing, compiling): the addresses change, the
    numbers do not. Each parameter gets a storage of its own over its place in the mapping
    (``torch.frombuffer``), not a view into one large tensor: with views, a compiled step that
    froze the weights decoded wrong tokens."""
    params = [p for p in model.parameters() if p.device.type == "cpu" and not getattr(p, MOVED, False)]
    inference = {p.is_inference() for p in params}  # a model made under inference_mode has only such
    if not params or len(inference) > 1 or not huge_pages_available():
        return False
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]  # each on a 64-byte line
    mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared memory has its own rules
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE
    # before the first write: a page's size is settled when it is first touched
    mapping.madvise(mmap.MADV_HUGEPAGE, start, sum(sizes))
    with torch.inference_mode(inference.pop()), torch.no_grad():  # tensors of the parameters' kind
        for param, size in zip(params, sizes):
            place = torch.frombuffer(mapping, dtype=param.dtype, count=param.numel(), offset=start).view(param.shape)
            place.copy_(param)
            param.data = place
            setattr(param, MOVED, True)
            start += size
    return True
