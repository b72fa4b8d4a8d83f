"""How much of a decode step is the host's: ``python -m minillm.bench host``.

The roofline prices a decode step at the weights' bytes over the memory bandwidth. Around a
model whose arithmetic is negligible (one layer sixteen wide, a 512-token vocabulary) nothing
of that is left, and what a step still costs is the host's work: choosing the batch, building
its tensors, launching the forward, reading the sampled tokens back, appending, detokenizing
and checking stops, retiring the finished. This benchmark runs that probe through the engine
at batch 1 to 256, decode steps only, times each phase from outside the engine's methods (as
the profile does), and fits the step's wall time to a fixed cost per step plus a cost per
sequence: the two numbers the host must shrink, or hide behind the device's work, before a
small model's step is the roofline's.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from minillm.bench import add_options, parse_batches, pyplot, save_figure, save_report
from minillm.bench.decode import prompts
from minillm.bench.engine import prefilled
from minillm.bench.profile import _instrument
from minillm.cli import UsageError
from minillm.decoding.sampling import SamplingParams
from minillm.engine.build import build_engine
from minillm.engine.config import EngineConfig
from minillm.machine.hardware import Timing, default_device, device_name
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT

PROBE = ModelConfig(vocab_size=512, context_length=1024, d_model=16, n_layers=1, n_heads=1)
BATCHES = (1, 8, 32, 64, 128, 256)
METHODS = {"eager": dict(enforce_eager=True), "captured": dict(enforce_eager=False)}


def probe_model(device: torch.device) -> GPT:
    """The probe: a GPT whose forward costs next to nothing, so a step's time is the host's."""
    torch.manual_seed(0)
    return GPT(PROBE).to(device).eval()


@torch.inference_mode()
def host_step(model: GPT, batch: int, method: str, steps: int = 60) -> dict:
    """``steps`` decode steps of ``batch`` sequences, run the way ``method`` (a :data:`METHODS`
    name) says: the step's wall time (median and quartiles, microseconds) and the microseconds
    per step of each phase, over as many further steps."""
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, 16 * batch),
                          kv_cache_memory="64MiB", **METHODS[method])
    engine = build_engine(model, config)
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True)
    prefilled(engine, prompts(batch, model.cfg.vocab_size), params)
    if engine.graphs is not None:
        engine.graphs.prepare([engine.graphs.bucket(batch)])
    for _ in range(5):  # warm-up
        engine.step()
    walls = []
    for _ in range(steps):  # each step reads its tokens back, so its wall time includes the device's
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    seconds: dict[str, float] = defaultdict(float)
    restore = _instrument(engine, seconds)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        timed = time.perf_counter() - start
    finally:
        restore()
    phases = dict(seconds) | {"other Python": max(timed - sum(seconds.values()), 0.0)}
    wall = Timing.of(walls)
    return {"method": method, "batch": batch, "step_us": wall.median * 1e6,
            "step_us_quartiles": [wall.q1 * 1e6, wall.q3 * 1e6],
            "phases_us": {k: v / steps * 1e6 for k, v in phases.items()}}


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per method, the least-squares line through its step times: fixed µs per step plus µs
    per sequence in the batch."""
    fits = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        if len(mine) < 2:
            continue
        per_seq, fixed = statistics.linear_regression([r["batch"] for r in mine], [r["step_us"] for r in mine])
        fits[method] = {"fixed_us": fixed, "per_sequence_us": per_seq}
    return fits


def run_host_bench(batches: list[int], methods: list[str], steps: int, threads: int,
                   device: torch.device) -> dict:
    """Every (method, batch) of the probe, printed as it goes, and the fits."""
    torch.set_num_threads(threads)
    model = probe_model(device)
    rows = []
    for method in methods:
        for batch in batches:
            row = host_step(model, batch, method, steps)
            rows.append(row)
            print(f"  {method:<9} batch {batch:>3}: {row['step_us']:7.0f} µs/step  "
                  + ", ".join(f"{k} {v:.0f}" for k, v in row["phases_us"].items()), flush=True)
    report = {"device": device_name(device), "device_type": device.type, "threads": threads,
              "probe": PROBE.to_dict(), "steps": steps, "rows": rows, "fits": fit(rows)}
    for method, f in report["fits"].items():
        print(f"  fit, {method}: {f['fixed_us']:.0f} µs per step + {f['per_sequence_us']:.1f} µs per sequence")
    return report


def figure(report: dict):
    """One panel per method: each phase's microseconds per step, stacked, against the batch,
    with the fitted line over the measured step time."""
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(methods), figsize=(5.5 * len(methods), 4), squeeze=False, sharey=True)
    for ax, method in zip(axes[0], methods):
        rows = [r for r in report["rows"] if r["method"] == method]
        batches = [r["batch"] for r in rows]
        phases = list(rows[0]["phases_us"])
        ax.stackplot(batches, *[[r["phases_us"][p] for r in rows] for p in phases], labels=phases, alpha=0.8)
        ax.plot(batches, [r["step_us"] for r in rows], "ko", label="step (median)")
        f = report["fits"].get(method)
        if f:
            ax.plot(batches, [f["fixed_us"] + f["per_sequence_us"] * b for b in batches], "k--",
                    label=f"{f['fixed_us']:.0f} µs + {f['per_sequence_us']:.1f} µs x batch")
        ax.set(title=f"{method}: the probe's decode step", xlabel="batch (sequences)", ylabel="µs per step")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Host work per decode step, {report['device']}", fontsize=10)
    return fig


def add_arguments(p) -> None:
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=60, help="decode steps timed per point (and as many per phase)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the probe's forward needs one)")
    add_options(p, "--device", "--out")


def run_from_args(args, out: Path) -> Path:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"--methods takes {', '.join(METHODS)}, not {args.methods!r}")
    if args.steps < 2 or args.threads < 1:
        raise UsageError("--steps must be at least 2 and --threads at least 1")
    device = torch.device(args.device) if args.device else default_device()
    report = run_host_bench(parse_batches(args.batches), methods, args.steps, args.threads, device)
    return save_report(report, out / f"host-{device.type}.json", lambda r, png: save_figure(figure(r), png))
