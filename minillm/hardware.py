"""The machine we run on: which device to use, and what it is called.

Chapter 1 grows this module into a roofline model (bandwidth, FLOP/s, ridge point); for now
it answers the question every chapter asks first: where do tensors go?
"""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """CUDA if PyTorch sees a GPU, else Apple's MPS if available, else the CPU.

    ``MINILLM_DEVICE`` overrides the choice (e.g. ``cpu`` on a machine with a busy GPU).
    """
    if os.environ.get("MINILLM_DEVICE"):
        return torch.device(os.environ["MINILLM_DEVICE"])
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_name(device: torch.device | str | None = None) -> str:
    """A person-readable name: the GPU's model, or the CPU's with its thread count."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (mps)"
    return f"{_cpu_model()} ({torch.get_num_threads()} threads)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def measure_matmul_flops(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5
) -> float:
    """Dense matmul throughput in FLOP/s: the median of ``repeats`` timed ``n x n`` products,
    after a warm-up, with the device synchronised around each timing."""
    import statistics
    import time

    device = torch.device(device) if device is not None else default_device()
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()

    a @ b  # warm-up: kernel selection, caches
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)
