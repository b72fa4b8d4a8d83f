"""A decode step's matrix products, one shape at a time: ``python -m minillm.bench products``.

For every weight shape of a preset (each block's four matrices and the LM head) and each row
count, the milliseconds of one product on every road :mod:`minillm.speedups.packed` chooses
from: plain ``F.linear``, oneDNN on the packed copy, the slabs (one row), and the small-batch
kernel (:mod:`minillm.speedups.gemv`), in fp32 and bf16. Each is also given in GB/s of weight
read, beside the bandwidth a ``torch`` sum reaches over the same bytes as the model's weights
(the decode benchmark's roof).

A decode step reads each weight once while the rest of the model streams past, so a timed call
never finds its weight in the core's caches from the call before: the calls cycle through
copies of the weight that add up to the model's weight bytes. Rounds interleave the roads, so
each median compares roads measured side by side.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from minillm.bench import add_options, parse_batches, pyplot, save_figure, save_report
from minillm.cli import UsageError
from minillm.machine.hardware import device_name, measure_bandwidth
from minillm.model.config import ModelConfig, get_preset
from minillm.speedups import gemv
from minillm.speedups.packed import multiply, roads_for, slabs_for

ROWS = (1, 2, 4, 8, 16, 32)
MAX_COPIES = 256


def shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], int]]:
    """Each matrix of a step: its ``(out, in)`` shape and how many a step multiplies by."""
    d = cfg.d_model
    return {"qkv": ((3 * d, d), cfg.n_layers), "attention out": ((d, d), cfg.n_layers),
            "MLP up": ((4 * d, d), cfg.n_layers), "MLP down": ((d, 4 * d), cfg.n_layers),
            "LM head": ((cfg.vocab_size, d), 1)}


def model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return sum(math.prod(shape) * count for shape, count in shapes(cfg).values()) * dtype.itemsize


# The names this benchmark prints for packing's roads (minillm.speedups.packed.multiply)
LABELS = {"plain": "F.linear", "packed": "oneDNN packed", "slabs": "slabs", "gemv": "small-batch kernel"}


def roads(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[], object]]:
    """Each road packing can take, as one call that multiplies ``rows`` rows by every copy in
    ``weights`` (oneDNN's only where it has a kernel for their dtype)."""
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    slabs = slabs_for(weights[0].shape[0], torch.get_num_threads())
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        multiply("packed", x, weights[0], packed[0], slabs)
    except RuntimeError:  # no oneDNN kernel for this dtype here
        packed = None
    names = [name for name in roads_for(weights[0], slabs, rows) if packed is not None or name != "packed"]
    return {LABELS[name]: (lambda name=name: [multiply(name, x, w, p, slabs) for w, p in
                                              zip(weights, packed or [None] * len(weights))])
            for name in names}


@torch.inference_mode()
def time_shape(shape: tuple[int, int], dtype: torch.dtype, rows: list[int], rounds: int, cycle_bytes: int,
               max_copies: int = MAX_COPIES) -> dict[int, dict[str, list[float]]]:
    """Milliseconds per product, ``{rows: {road: [one per round]}}``."""
    weight_bytes = math.prod(shape) * dtype.itemsize
    copies = max(1, min(max_copies, math.ceil(cycle_bytes / weight_bytes)))
    weights = [(torch.randn(shape) * 0.02).to(dtype) for _ in range(copies)]
    by_rows = {n: roads(weights, n) for n in rows}
    ms: dict[int, dict[str, list[float]]] = {n: {road: [] for road in found} for n, found in by_rows.items()}
    for found in by_rows.values():
        for run in found.values():
            run()
    for _ in range(rounds):
        for n, found in by_rows.items():
            for road, run in found.items():
                start = time.perf_counter()
                run()
                ms[n][road].append((time.perf_counter() - start) * 1e3 / copies)
    return ms


def run_products_bench(presets: list[str], dtypes: list[torch.dtype], rows: list[int], rounds: int,
                       max_copies: int = MAX_COPIES) -> dict:
    report = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(), "rows": rows,
              "rounds": rounds, "paths": {str(d)[6:]: gemv.paths(d) for d in dtypes}, "runs": {}}
    for preset in presets:
        cfg = get_preset(preset)
        for dtype in dtypes:
            nbytes = model_bytes(cfg, dtype)
            run = {"weight_bytes": nbytes, "bandwidth": measure_bandwidth("cpu", "reduce", nbytes=nbytes), "shapes": {}}
            for name, (shape, count) in shapes(cfg).items():
                ms = time_shape(shape, dtype, rows, rounds, nbytes, max_copies)
                run["shapes"][name] = {"shape": shape, "per_step": count, "ms": ms}
                print(f"{preset} {str(dtype)[6:]} {name} {shape}:", flush=True)
                print("\n".join(table(ms, math.prod(shape) * dtype.itemsize)), flush=True)
            report["runs"][f"{preset} {str(dtype)[6:]}"] = run
            print(f"{preset} {str(dtype)[6:]}: a step's products, ms (bandwidth {run['bandwidth'] / 1e9:.1f} GB/s "
                  f"over {nbytes / 1e6:.0f} MB)")
            print("\n".join(step_table(run)), flush=True)
    return report


def table(ms: dict[int, dict[str, list[float]]], weight_bytes: int) -> list[str]:
    """One line per road: median ms [range] (GB/s) at each row count."""
    lines = []
    for road in dict.fromkeys(road for found in ms.values() for road in found):
        cells = []
        for n, found in ms.items():
            if road in found:
                m = statistics.median(found[road])
                cells.append(f"{n:>3}: {m:7.3f} [{min(found[road]):.3f}-{max(found[road]):.3f}] "
                             f"({weight_bytes / m / 1e6:5.1f} GB/s)")
        lines.append(f"  {road:<20}" + "  ".join(cells))
    return lines


def step_ms(run: dict) -> dict[str, dict[int, float]]:
    """Each road's whole-step product time (median ms per shape x matrices per step) by rows,
    and ``best``: each shape on its fastest road."""
    total: dict[str, dict[int, float]] = {}
    for entry in run["shapes"].values():
        for n, found in entry["ms"].items():
            medians = {road: statistics.median(v) for road, v in found.items()}
            medians["best"] = min(medians.values())
            for road, m in medians.items():
                total.setdefault(road, {}).setdefault(n, 0.0)
                total[road][n] += m * entry["per_step"]
    return total


def step_table(run: dict) -> list[str]:
    return [f"  {road:<20}" + "".join(f"{n:>4}: {m:8.3f}" for n, m in by_rows.items())
            for road, by_rows in step_ms(run).items() if road != "slabs"]


def plot(report: dict, path: Path) -> None:
    """A step's product time against rows, one panel per preset and dtype, a line per road."""
    plt = pyplot()
    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        for road, by_rows in step_ms(run).items():
            if road in ("slabs", "best"):
                continue
            xs = sorted(int(n) for n in by_rows)
            ax.plot(xs, [by_rows[n] if n in by_rows else by_rows[str(n)] for n in xs], "o-", label=road)
        read = run["weight_bytes"] / run["bandwidth"] * 1e3
        ax.axhline(read, color="k", ls="--", lw=1, label="weights / bandwidth")
        ax.set(xscale="log", xlabel="rows (sequences decoding together)", ylabel="ms per step's products",
               title=name, ylim=(0, None))
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['device']}, {report['threads']} threads", fontsize=9)
    save_figure(fig, path)


def add_arguments(p) -> None:
    p.add_argument("--presets", default="tinystories-50m,cpu")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    p.add_argument("--max-copies", type=int, default=MAX_COPIES, help="copies of a weight the calls cycle through")
    add_options(p, "--dtypes", "--repeats", "--out", repeats=7)


def run_from_args(args, out: Path) -> Path:
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    for preset in presets:
        try:
            get_preset(preset)
        except ValueError as err:  # an unknown name fails now, with the names there are
            raise UsageError(str(err)) from None
    dtypes = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip(), None)
        if dtype not in gemv.DTYPES:
            raise UsageError(f"--dtypes takes float32 and bfloat16, not {name!r}")
        dtypes.append(dtype)
    if args.repeats < 1 or args.max_copies < 1:
        raise UsageError("--repeats and --max-copies must be at least 1")
    report = run_products_bench(presets, dtypes, parse_batches(args.rows), args.repeats, args.max_copies)
    return save_report(report, out / "products-cpu.json", plot)
