"""Attention kernels (chapter 16): the FlashAttention idea, from readable to fast.

- ``tiled``: the online-softmax recurrence in plain PyTorch, block by block, counting bytes;
  plus the naive three-kernel attention it is measured against.
- ``traffic``: the bytes each moves between main memory and the chip, in closed form.
- ``flash_triton``: the same loop as a Triton kernel (fp16/bf16/fp32 in, fp32 accumulation).
- ``paged_triton``: decode attention that reads the engine's paged KV cache in place, through
  its block tables; the engine uses it with ``attention="triton"``.

The Triton modules need the optional extra (``pip install -e '.[triton]'``) and are imported on
demand. Without a GPU they run in Triton's interpreter: importing this package on a machine
where PyTorch sees no CUDA device sets ``TRITON_INTERPRET=1`` unless it is already set
(``minillm.speedups.kernels.runtime`` says why it must happen this early).
"""

from minillm.speedups.kernels.runtime import TritonUnavailable, interpreting, require_triton, triton_installed
from minillm.speedups.kernels.tiled import naive_attention, online_softmax, online_softmax_steps, tiled_attention
from minillm.speedups.kernels.traffic import (
    Traffic,
    TrafficCounter,
    decode_bytes,
    naive_bytes,
    naive_kernels,
    roofline_seconds,
    tiled_bytes,
)

__all__ = [
    "Traffic", "TrafficCounter", "TritonUnavailable", "decode_bytes", "interpreting", "naive_attention",
    "naive_bytes", "naive_kernels", "online_softmax", "online_softmax_steps", "require_triton",
    "roofline_seconds", "tiled_attention", "tiled_bytes", "triton_installed",
]
