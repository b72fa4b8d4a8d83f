"""A small-batch linear for the CPU that reads each weight once: ``gemv.cpp``, built on first use.

A decode step multiplies a few rows (one per sequence) by every weight matrix. Its time should
be the time to read the weights, whatever the rows, up to the ridge batch. Library GEMMs are
tuned for many rows: at one to sixteen they re-read or re-pack the weight, or run far below
memory speed. ``gemv.cpp`` streams each weight row once and multiplies it into every row of
``x`` while it sits in registers (fp32 FMA, or bf16 pairs with AVX512-BF16, summed in fp32),
threads splitting the weight's rows. int8 weights with a scale per row (chapter 13's format)
take the same tiles, widened to fp32 in registers: ``torch.ops.minillm.small_linear_int8``.

:func:`load` compiles it with ``torch.utils.cpp_extension`` into the cache (once per source,
PyTorch and Python version) and registers ``torch.ops.minillm.small_linear``, a torch operator
with a fake implementation, so a compiled step can carry it too. Where it cannot be built (no
compiler, no ninja) it says so once, and :func:`load` returns False: callers keep the library's
product. :mod:`minillm.speedups.packed` times it against the other roads per weight shape.

The same build holds the CPU's decode attention (``decode_attention.cpp``,
:func:`decode_attention`): it reads the paged KV cache in place, for the engine's
``attention="cpu"`` in eager and compiled steps alike.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from minillm.settings import cache_dir

log = logging.getLogger(__name__)

# The kernel, and beside it in the same build a decode step's attention over the paged pool
SOURCES = (Path(__file__).with_name("gemv.cpp"), Path(__file__).with_name("decode_attention.cpp"))
DTYPES = (torch.float32, torch.bfloat16)

# The kernel's territory: products of up to FEW_ROWS rows, timed against the library's at each
# bucket (BUCKETS: a product of n rows counts as the smallest bucket >= n, as a compiled step
# pads it); past it the library's GEMMs, tuned for many rows, are the faster.
FEW_ROWS = 16
BUCKETS = tuple(1 << i for i in range(FEW_ROWS.bit_length()))

_loaded: bool | None = None  # None: not tried yet in this process


def build() -> None:
    """Compile :data:`SOURCES` (or find them compiled) and load them; raises if that fails."""
    from torch.utils import cpp_extension

    scripts = sysconfig.get_path("scripts")  # where pip put ninja, if the environment is not activated
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    text = b"".join(source.read_bytes() for source in SOURCES)
    tag = hashlib.sha256(text + f"{torch.__version__} {sys.version} {platform.machine()}".encode()).hexdigest()[:12]
    # -fopenmp: at::parallel_for splits the rows over the threads only where it is compiled with
    # OpenMP; without it the kernel runs on one thread, silently
    cpp_extension.load(name="minillm_gemv", sources=[str(source) for source in SOURCES],
                       extra_cflags=["-O3", "-std=c++17", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(cache_dir("extensions", f"gemv-{tag}")),
                       is_python_module=False)
    torch.library.register_fake("minillm::small_linear")(_fake)
    torch.library.register_fake("minillm::small_linear_int8")(_fake_int8)
    torch.library.register_fake("minillm::decode_attention")(_fake_attention)


def load() -> bool:
    """Whether ``torch.ops.minillm.small_linear`` is here: built and loaded on the first call,
    the answer kept for the process. A failure is logged once, in one line."""
    global _loaded
    if _loaded is None:
        try:
            build()
            _loaded = True
        except Exception as err:  # a compiler's or loader's failure, whatever its type
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            log.warning("the small-batch CPU kernel (minillm/speedups/gemv.cpp) did not build, so products take "
                        "the library's path: %s", reason)
            _loaded = False
    return _loaded


def bucket_of(rows: int) -> int:
    """The bucket a product of ``rows`` rows is timed at: the next power of two."""
    return 1 << (rows - 1).bit_length()


def supports(weight: torch.Tensor) -> bool:
    """Whether :func:`small_linear` can multiply by ``weight`` (loading the kernel if need be)."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.stride(1) == 1 and load())


def supports_int8(qweight: torch.Tensor) -> bool:
    """Whether :func:`small_linear_int8` can multiply by ``qweight`` (loading the kernel if need be)."""
    return (qweight.device.type == "cpu" and qweight.dtype == torch.int8 and qweight.dim() == 2
            and qweight.stride(1) == 1 and load())


def paths(dtype: torch.dtype) -> list[str]:
    """The kernel's paths this CPU runs for ``dtype`` weights (float32, bfloat16 or int8),
    fastest first: ``avx512`` (FMA; for bf16 it needs AVX512-BF16), ``avx2``, ``scalar``."""
    return list(torch.ops.minillm.small_linear_paths(dtype)) if load() else []


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str = "") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel (``path``: one of :func:`paths`, or the
    fastest): ``x`` of any shape ``[..., in]`` and strides, ``weight`` ``[out, in]`` with
    adjacent columns, one dtype (float32 or bfloat16) for all. Call :func:`load` first."""
    return torch.ops.minillm.small_linear(x, weight, bias, path)


def small_linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      path: str = "") -> torch.Tensor:
    """``F.linear(x, qweight * scales[:, None], bias)`` by the kernel, reading the int8 weight
    ``[out, in]`` as stored: ``x`` float32 or bfloat16 (the result's dtype), summed in fp32.
    Call :func:`load` first."""
    return torch.ops.minillm.small_linear_int8(x, qweight, scales, bias, path)


def _fake_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
               path: str = "") -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


def _fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str = "") -> torch.Tensor:
    """The operator's output without running it: what a compiler's tracing needs."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, tables: torch.Tensor,
                     lengths: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a decode step's attention on a CPU, reading the pool in place: ``q``
    ``[B, heads, head_dim]``, each row attending over its first ``lengths`` positions through
    ``tables`` (``[B, W]`` block ids) in layer ``layer`` of the pools (``[layers, blocks,
    block_size, heads, head_dim]``). ``k`` and ``v`` (``q``'s shape), if given, are written at
    ``slots`` first. What :func:`~minillm.engine.kv_cache.gather_decode_attention` computes,
    without the gather. Returns ``[B, heads, head_dim]``. Call :func:`load` first."""
    return torch.ops.minillm.decode_attention(q, k_pool, v_pool, layer, tables, lengths, k, v, slots)


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` over one layer of the pool (``[blocks, block_size, heads,
    head_dim]``), nothing written: the ``decode`` of the CPU's attention kernels."""
    return decode_attention(q, k_pool[None], v_pool[None], 0, tables, lengths)


def _fake_attention(q, k_pool, v_pool, layer, tables, lengths, k=None, v=None, slots=None):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape)
