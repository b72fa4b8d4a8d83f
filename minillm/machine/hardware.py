"""The machine we run on: where tensors go, and the two numbers that bound every kernel.

A kernel is limited either by how fast the device computes (FLOP/s) or by how fast memory
feeds it (bytes/s). Their ratio, the *ridge point* in FLOP per byte, says which limit applies:
work that does fewer FLOPs per byte moved than the ridge waits on memory (Williams, Waterman
and Patterson, "Roofline", CACM 2009). This module holds datasheet figures for well-known
devices and measures the same figures on this machine; ``minillm.machine.roofline`` applies them to
the GPT's decode step.

``python -m minillm.machine.hardware`` prints the measurements as a table (``--json`` for machines).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Callable, Sequence

import torch

from minillm.settings import quick

# The dtypes the book measures, by the short names tables use.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``: the short name tables and presets use."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"no short name for {dtype}; the book uses {', '.join(DTYPES)}")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by short name (``"bf16"`` -> 2)."""
    return DTYPES[name].itemsize


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A flag's or option's dtype: ``"bf16"`` or ``"bfloat16"`` -> ``torch.bfloat16``; ``None``
    keeps the model's own."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    spelled = {**DTYPES, **{str(t).removeprefix("torch."): t for t in DTYPES.values()}}
    try:
        return spelled[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(spelled)}, got {dtype!r}") from None


# ----------------------------------------------------------------------------- the device


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
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (mps)"
    threads = torch.get_num_threads()
    return f"{_cpu_model()} ({threads} thread{'s' if threads != 1 else ''})"


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


# ----------------------------------------------------------------------------- datasheets


@dataclass(frozen=True)
class DeviceSpec:
    """A device's memory bandwidth (bytes/s) and dense peak FLOP/s per dtype, with the source."""

    name: str
    bandwidth: float
    flops: dict[str, float]
    source: str = ""
    note: str = ""

    def ridge(self, dtype: str) -> float:
        """FLOP per byte at which compute and memory take equally long: ``flops / bandwidth``."""
        if dtype not in self.flops:
            raise ValueError(f"{self.name} has no {dtype} figure; it has {', '.join(self.flops)}")
        return self.flops[dtype] / self.bandwidth


# Dense (no 2:4 sparsity) peaks; bf16/fp16 on data-centre GPUs are tensor-core figures.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    # "fp16" and "fp32" are the CUDA cores' rate (the book's worked example, ridge 46.8);
    # "fp16-tensor" is the tensor cores' dense rate beside it, for fp16 weights.
    "rtx4050-laptop": DeviceSpec(
        "NVIDIA GeForce RTX 4050 Laptop GPU", 192e9,
        {"fp16": 8.986e12, "fp32": 8.986e12, "fp16-tensor": 20 * 512 * 1.755e9},
        "TechPowerUp GPU Database, GeForce RTX 4050 Mobile, "
        "https://www.techpowerup.com/gpu-specs/geforce-rtx-4050-mobile.c3953; tensor rate: NVIDIA Ada GPU "
        "Architecture whitepaper (v2.01), RTX 4090 peak FP16 Tensor TFLOPS with FP32 accumulate, "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        "6 GB GDDR6, 96-bit at 16 Gbps. fp16 = fp32 = the 2,560 CUDA cores at the 1,755 MHz reference "
        "boost (2 FLOP per core per clock), no tensor cores. fp16-tensor: dense fp16 matmul on the tensor "
        "cores with fp32 accumulate (what PyTorch's cuBLAS calls use): the whitepaper's RTX 4090 figure, "
        "165.2 TFLOP/s over 128 SMs at 2,520 MHz, is 512 FLOP per SM per clock; the 4050 Laptop's 20 SMs "
        "at 1,755 MHz give 17.97 TFLOP/s (GeForce parts run fp16 accumulate at twice that, 35.9)",
    ),
    "a100-sxm-80gb": DeviceSpec(
        "NVIDIA A100 SXM 80GB", 2039e9, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/",
        "HBM2e",
    ),
    "h100-sxm": DeviceSpec(
        "NVIDIA H100 SXM", 3.35e12, {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
        "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/",
        "HBM3; the datasheet's 1,979 TFLOP/s bf16 is with sparsity, half that dense",
    ),
    "h200-sxm": DeviceSpec(
        "NVIDIA H200 SXM", 4.8e12, {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
        "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/",
        "the H100's compute with 141 GB of faster HBM3e: same FLOP/s, ridge moves left",
    ),
    "apple-m2": DeviceSpec(
        "Apple M2 (10-core GPU)", 100e9, {"fp32": 3.6e12},
        "Apple Newsroom, 'Apple unveils M2', June 2022, "
        "https://www.apple.com/newsroom/2022/06/apple-unveils-m2-with-breakthrough-performance-and-capabilities/",
        "unified LPDDR5 memory shared by CPU and GPU",
    ),
}


def get_spec(name: str) -> DeviceSpec:
    """A datasheet entry by key, or an error that lists the keys there are."""
    try:
        return DEVICE_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of: {', '.join(DEVICE_SPECS)}") from None


# ----------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    """Wait for queued work: GPU kernels run asynchronously, so a clock read without this
    times the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds over repeated runs: the median, and the first and third quartiles as the spread
    a timing figure carries (inclusive quartiles, so they stay within the fastest and slowest run)."""

    median: float
    q1: float
    q3: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        if len(seconds) < 2:
            return cls(seconds[0], seconds[0], seconds[0])
        q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
        return cls(median, q1, q3)

    @property
    def quartiles(self) -> tuple[float, float]:
        return self.q1, self.q3


def time_repeats(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1, *,
                 clock: Callable[[], float] = time.perf_counter) -> Timing:
    """The wall time of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed ones (which pay
    for kernel selection, page faults and cold caches). Its median ignores the odd run that
    another process interrupted. (``clock`` lets a test time ``fn`` on a fake clock.)"""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize(device)
        times.append(clock() - start)
    return Timing.of(times)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1, *,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """The median of :func:`time_repeats`, where only the median is wanted."""
    return time_repeats(fn, device, repeats, warmup, clock=clock).median


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``; None means the best one this machine has."""
    return torch.device(device) if device is not None else default_device()


BANDWIDTH_METHODS = ("copy", "reduce")
MAIN_MEMORY_BYTES = 2**30  # the buffer that measures main memory: larger than any cache


def measure_bandwidth(
    device: torch.device | str | None = None, method: str = "reduce", nbytes: int = 2**30, repeats: int = 5
) -> float:
    """Memory bandwidth in bytes/s, moving an ``nbytes`` fp32 buffer.

    ``"copy"`` writes one buffer into another and counts the bytes read plus the bytes written
    (2 x ``nbytes``); ``"reduce"`` sums one buffer and counts the bytes read. A CPU may also read
    the destination lines before writing them (write-allocate); we do not count those bytes, so
    a copy can report less than memory really moved. Buffers much larger than the caches measure
    main memory; smaller ones measure whichever cache holds them, which is why the size is asked.
    """
    if method not in BANDWIDTH_METHODS:
        raise ValueError(f"method must be one of {BANDWIDTH_METHODS}, not {method!r}")
    device = resolve_device(device)
    x = torch.ones(nbytes // 4, device=device)
    if method == "copy":
        y = torch.empty_like(x)
        seconds = median_seconds(lambda: y.copy_(x), device, repeats)
        return 2 * x.nbytes / seconds
    return x.nbytes / median_seconds(x.sum, device, repeats)


def measure_matmul_flops(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5
) -> float:
    """Dense matmul throughput in FLOP/s: the median of ``repeats`` timed ``n x n`` products
    (``2 n^3`` FLOPs each: a multiply and an add per term), after a warm-up.

    The second matrix is used transposed, as ``nn.Linear`` uses its weight, because that is the
    product every layer of the model runs: on a CPU without bf16/fp16 instructions PyTorch sends
    that layout to oneDNN and a plain ``a @ b`` to a reference loop about eight times slower, so
    the plain product would set a roof the model's own steps pass through."""
    device = resolve_device(device)
    a = torch.randn(n, n, device=device).to(dtype)
    weight = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / median_seconds(lambda: a @ weight.T, device, repeats)


def runs_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` multiplies matrices of ``dtype`` at all (some builds lack a dtype)."""
    try:
        torch.ones(2, 2, device=device, dtype=dtype) @ torch.ones(2, 2, device=device, dtype=dtype)
    except (RuntimeError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class MachineProfile:
    """What this machine measured: bandwidth per method, FLOP/s per dtype, and how."""

    device: str
    name: str
    bandwidths: dict[str, float]
    flops: dict[str, float]
    bandwidth_bytes: int
    matmul_sizes: tuple[int, ...]
    repeats: int
    measured_at: str = ""
    # bytes -> bytes/s of reading a buffer that size again and again (a working set a cache may
    # hold), filled in by ``minillm.machine.roofline.decode_roof`` as it measures each size
    resident: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        """The profile :meth:`to_dict` wrote (JSON turns tuples into lists and int keys into text)."""
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        known["matmul_sizes"] = tuple(known["matmul_sizes"])
        known["resident"] = {int(n): float(v) for n, v in known.get("resident", {}).items()}
        return cls(**known)

    @property
    def bandwidth(self) -> float:
        """The roof's slope: the best bandwidth any method showed, since no kernel beats it."""
        return max(self.bandwidths.values())

    def ridge(self, dtype: str) -> float:
        """FLOP per byte at which this machine's measured compute and memory balance."""
        return self.flops[dtype] / self.bandwidth

    def as_spec(self) -> DeviceSpec:
        """The measurements in datasheet form, so one roofline code path serves both."""
        detail = ", ".join(f"{m} {format_rate(v, 'B/s')}" for m, v in self.bandwidths.items())
        return DeviceSpec(f"{self.name}, measured", self.bandwidth, dict(self.flops),
                          "measured by minillm.machine.hardware", f"main memory: {detail}")

    def to_dict(self) -> dict:
        return {**asdict(self), "bandwidth": self.bandwidth, "ridge": {d: self.ridge(d) for d in self.flops}}

    def table(self) -> str:
        """The profile as lines a person reads."""
        sizes = " and ".join(f"{n}x{n}" for n in self.matmul_sizes)
        lines = [f"{self.device}: {self.name}",
                 f"memory bandwidth ({self.bandwidth_bytes / 2**20:,.0f} MiB buffers, median of {self.repeats}):"]
        lines += [f"  {m:<7} {format_rate(v, 'B/s'):>12}" for m, v in self.bandwidths.items()]
        lines += [f"matmul (best of {sizes}) and ridge point (FLOP/s / {format_rate(self.bandwidth, 'B/s')}):",
                  f"  {'dtype':<7} {'FLOP/s':>14} {'ridge FLOP/byte':>16} {'~ batch':>8}"]
        for dtype, rate in self.flops.items():
            ridge, batch = self.ridge(dtype), first_order_batch(self.ridge(dtype), dtype)
            lines.append(f"  {dtype:<7} {format_rate(rate, 'FLOP/s'):>14} {ridge:>16.1f} {batch:>8.0f}")
        return "\n".join(lines)


def first_order_batch(ridge: float, dtype: str) -> float:
    """The decode batch at which a model with ``dtype`` weights reaches ``ridge``, to first
    order: each sequence does 2 FLOPs per weight and the step reads each weight once, so the
    intensity is ``2 * batch / bytes_per_weight`` (``minillm.machine.roofline`` adds the KV cache)."""
    return ridge * dtype_bytes(dtype) / 2


def measure_machine(
    device: torch.device | str | None = None, dtypes: Sequence[str] = tuple(DTYPES), small: bool | None = None
) -> MachineProfile:
    """Measure bandwidth (copy and reduce) and the matmul peak of each dtype the device runs.

    Buffers of 1 GiB leave every cache, so they measure main memory. ``small`` (default:
    ``MINILLM_QUICK=1``) shrinks everything so it takes a second.
    """
    device = resolve_device(device)
    small = quick() if small is None else small
    nbytes = 2**26 if small else MAIN_MEMORY_BYTES
    sizes = matmul_sizes(device, small)
    repeats = 3 if small else 5
    bandwidths = {m: measure_bandwidth(device, m, nbytes, repeats) for m in BANDWIDTH_METHODS}
    flops = {d: matmul_peak(device, DTYPES[d], sizes, repeats) for d in dtypes if runs_matmul(device, DTYPES[d])}
    measured_at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return MachineProfile(str(device), device_name(device), bandwidths, flops, nbytes, sizes, repeats, measured_at)


def matmul_sizes(device: torch.device, small: bool = False) -> tuple[int, int]:
    """The two square sizes a matmul peak is measured at: large enough to keep the device's
    arithmetic busy, small enough to take seconds."""
    return (512, 1024) if small else ((4096, 8192) if device.type == "cuda" else (1024, 2048))


def matmul_peak(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                sizes: Sequence[int] | None = None, repeats: int = 5, max_product_seconds: float = 1.0) -> float:
    """This device's matmul peak in ``dtype``: what chapter 1's roof and training's MFU divide by.

    The best FLOP/s over ``sizes`` (ascending; default ``matmul_sizes``), because libraries tile
    sizes differently and either can be faster, and because a best-of is robust to another
    program briefly sharing the cores where one median is not. A larger size is skipped when one
    product of it would take over ``max_product_seconds`` at the rate measured so far.

    A dtype the CPU has no instructions for (bf16 or fp16 without AVX-512 BF16/FP16 or AMX) is
    converted on the fly at a few GFLOP/s or less: its larger product would take many seconds
    and cannot show a higher peak than the smaller one did, so it is not worth the wait."""
    device = resolve_device(device)
    best, done = 0.0, None
    for n in sizes or matmul_sizes(device):
        if done is not None and 2 * n**3 / best > max_product_seconds:
            break
        best, done = max(best, measure_matmul_flops(device, dtype, n, repeats)), n
    return best


def format_rate(value: float, unit: str) -> str:
    """``8.986e12, "FLOP/s"`` -> ``"8.99 TFLOP/s"``: three significant figures, SI prefix."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def specs_table() -> str:
    """The datasheet entries as lines: bandwidth, FLOP/s and ridge per dtype."""
    lines = [f"  {'key':<15} {'bandwidth':>11}  dtype: FLOP/s (ridge FLOP/byte)"]
    for key, spec in DEVICE_SPECS.items():
        peaks = ", ".join(f"{d}: {format_rate(f, 'FLOP/s')} ({spec.ridge(d):.1f})" for d, f in spec.flops.items())
        lines.append(f"  {key:<15} {format_rate(spec.bandwidth, 'B/s'):>11}  {peaks}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def device_from_flag(value: str | None) -> torch.device:
    """The device a ``--device`` flag names, checked by placing a tensor on it; a device this
    machine lacks is a one-line usage error naming the flag, not a traceback."""
    from minillm.cli import UsageError

    try:
        device = resolve_device(value)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        raise UsageError(f"--device {value}: {str(err).splitlines()[0]}") from None
    return device


def main(argv: Sequence[str] | None = None) -> int:
    import json

    from minillm.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m minillm.machine.hardware",
                            description="Measure this machine's memory bandwidth, matmul FLOP/s and ridge points.")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:1 | mps (default: the best available)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes: a rough answer in a second")
    args = parser.parse_args(argv)
    profile = measure_machine(device_from_flag(args.device), small=args.quick or None)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
    else:
        print(profile.table(), "\n\ndatasheets, for comparison:", specs_table(), sep="\n")
    return 0


if __name__ == "__main__":
    from minillm.cli import run

    run(main, prog="python -m minillm.machine.hardware")
