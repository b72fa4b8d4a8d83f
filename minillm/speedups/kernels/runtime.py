"""Where the Triton kernels can run, decided once, before any kernel is defined.

Without a GPU Triton can *interpret* its kernels (``TRITON_INTERPRET=1``): in Python, on CPU
tensors, thousands of times slower and exact enough for CI and the book's CPU runs. Triton's
own ``tl.*`` functions are decorated when ``triton`` is first imported, so the variable must be
set before *that*: importing this module (as ``import minillm.speedups.kernels`` does) sets it
when PyTorch sees no CUDA device and it is unset. Import ``minillm.speedups.kernels`` before
``triton``.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

INSTALL_HINT = "install the optional extra: pip install -e '.[triton]'"


class TritonUnavailable(RuntimeError):
    """The Triton kernels cannot run here; the message says why and what to do."""


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (explicitly, or because there is no GPU)."""
    explicit = os.environ.get("TRITON_INTERPRET")
    if explicit is not None:
        return explicit.strip().lower() in {"1", "true", "on", "yes"}
    return not torch.cuda.is_available()


if interpreting():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def load_triton():
    """Import ``triton`` and ``triton.language``, or say how to install them."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        raise TritonUnavailable(f"Triton is not installed; {INSTALL_HINT}") from None
    return triton, tl


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def require_triton(device: torch.device | str) -> None:
    """Raise :class:`TritonUnavailable` unless the Triton kernels can run on ``device``:
    compiled on a CUDA GPU, or interpreted on the CPU (correct, but only fit for tests)."""
    device = torch.device(device)
    if not triton_installed():
        raise TritonUnavailable(f"Triton is not installed; {INSTALL_HINT}")
    if device.type == "cuda" and interpreting():
        raise TritonUnavailable("TRITON_INTERPRET=1 runs kernels on CPU tensors only; unset it to use the GPU")
    if device.type == "cpu" and not interpreting():
        raise TritonUnavailable("Triton kernels on the CPU need its interpreter: set TRITON_INTERPRET=1 "
                                "(slow; meant for tests), or use a CUDA device")
    if device.type not in ("cuda", "cpu"):
        raise TritonUnavailable(f"the Triton kernels run on CUDA GPUs (or the CPU interpreter), not {device.type}")
    if device.type == "cpu":
        log.warning("Triton attention on the CPU runs in Triton's interpreter: exact, but very slow")
