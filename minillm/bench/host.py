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

With ``--server`` it also serves the probe (``python -m server``, a process of its own, one torch
thread) and streams ``batch`` requests at once through the OpenAI API: what a client sees per
output token (TPOT), against the engine's bare step at that batch. The difference is the
server's share: the engine loop's hand-off, the event loop, JSON and server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from minillm.bench import add_options, free_port, local_server, parse_batches, pyplot, save_figure, save_report
from minillm.bench.decode import ENGINES
from minillm.bench.profile import decoding_engine, phase_times
from minillm.cli import UsageError
from minillm.machine.hardware import Timing, default_device, device_name, synchronize
from minillm.model.checkpoint import save_checkpoint
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT

PROBE = ModelConfig(vocab_size=512, context_length=1024, d_model=16, n_layers=1, n_heads=1)
BATCHES = (1, 8, 32, 64, 128, 256)
# Short names for ENGINES entries, each run serial (its phases timed) and overlapped
METHODS = {f"{name}{'-overlap' if overlap else ''}": ENGINES[method] | {"async_scheduling": overlap}
           for overlap in (False, True) for name, method in (("eager", "ours, plain eager"), ("captured", "ours, captured"))}


def probe_model(device: torch.device) -> GPT:
    """The probe: a GPT whose forward costs next to nothing, so a step's time is the host's."""
    torch.manual_seed(0)
    return GPT(PROBE).to(device).eval()


@torch.inference_mode()
def host_step(model: GPT, batch: int, method: str, steps: int = 60) -> dict:
    """``steps`` decode steps of ``batch`` sequences, run the way ``method`` (a :data:`METHODS`
    name) says: the step's wall time (median and quartiles, microseconds) and, for a serial
    engine, the microseconds per step of each phase, over as many further steps (an overlapped
    engine's phases run on two threads at once, so they do not add up to its step)."""
    options = dict(METHODS[method], max_num_batched_tokens=max(2048, 16 * batch))
    engine = decoding_engine(model, batch, options, 2 * steps + 16, kv_cache_memory="64MiB")
    try:
        if engine.overlap:
            wall, phases = _overlapped_timing(engine, steps), {}
        else:
            wall, phases = phase_times(engine, steps)
    finally:
        engine.close()
    return {"method": method, "batch": batch, "step_us": wall.median * 1e6,
            "step_us_quartiles": [wall.q1 * 1e6, wall.q3 * 1e6],
            "phases_us": {k: v * 1e6 for k, v in phases.items()}}


def _overlapped_timing(engine, steps: int, block: int = 10) -> Timing:
    """Seconds per step of an overlapped engine, timed over blocks of ``block`` steps: waiting
    for the device after each step, as a per-step timing must, would stop the overlap."""
    for _ in range(3):
        engine.step()
    synchronize(engine.model.device)
    per_step = []
    for _ in range(max(2, steps // block)):
        start = time.perf_counter()
        for _ in range(block):
            engine.step()
        synchronize(engine.model.device)
        per_step.append((time.perf_counter() - start) / block)
    return Timing.of(per_step)


# What the timeline records, by lane: the scheduling thread's phases, and the step's computation
# (forward, sampling and reading the tokens back) wherever it runs
TIMELINE_PHASES = {"schedule": "host", "prepare": "host", "append": "host", "compute": "device"}


def step_timeline(engine, steps: int) -> list[dict]:
    """Run ``steps`` steps of ``engine`` and record when each phase ran: a list of spans
    ``{"lane", "phase", "start", "end"}`` (seconds since the first step began). The host lane
    holds scheduling, preparing and appending; the device lane the computation, on the device
    thread of an overlapped engine on a CPU, on the same thread as the rest for a serial one."""
    spans: list[dict] = []
    origin = time.perf_counter()

    def recorded(phase: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append({"lane": TIMELINE_PHASES[phase], "phase": phase,
                              "start": start - origin, "end": time.perf_counter() - origin})
        return run

    patches = [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
               (engine, "_finish_step", "append"), (engine.runner, "execute_prepared", "compute")]
    with contextlib.ExitStack() as stack:
        for obj, name, phase in patches:
            stack.enter_context(mock.patch.object(obj, name, recorded(phase, getattr(obj, name))))
        for _ in range(steps):
            engine.step()
        synchronize(engine.model.device)
    return sorted(spans, key=lambda s: s["start"])


def timeline_figure(timelines: dict[str, list[dict]]):
    """One panel per engine (``{title: step_timeline(...)}``), a host lane above a device
    lane, each phase a bar where it ran: serial steps take turns, overlapped ones do not."""
    import matplotlib.pyplot as plt

    colors = {"schedule": "tab:orange", "prepare": "tab:green", "append": "tab:purple", "compute": "tab:blue"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.6 * len(timelines) + 0.6), sharex=True, squeeze=False)
    for ax, (title, spans) in zip(axes[:, 0], timelines.items()):
        for phase, color in colors.items():
            mine = [s for s in spans if s["phase"] == phase]
            y = 1 if TIMELINE_PHASES[phase] == "host" else 0
            ax.broken_barh([(s["start"] * 1e3, (s["end"] - s["start"]) * 1e3) for s in mine], (y + 0.1, 0.8),
                           color=color, label=phase)
        ax.set(yticks=[0.5, 1.5], yticklabels=["device", "host"], title=title)
        ax.title.set_fontsize(9)
    axes[0, 0].legend(ncol=4, fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("ms since the first step began")
    fig.tight_layout()
    return fig


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


def server_tpot(batches: list[int], tokens: int, threads: int, overlap: bool, rounds: int = 3) -> list[dict]:
    """Serve the probe eagerly (``overlap``: with overlap scheduling) and, per batch, stream
    ``batch`` greedy requests of ``tokens`` tokens at once, ``rounds`` times: the median over
    requests and rounds of the time per output token after the first, in µs."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log:
        model = probe_model(torch.device("cpu"))
        checkpoint = save_checkpoint(Path(tmp) / "probe.pt", {"model_config": PROBE.to_dict(),
                                                              "model": model.state_dict()})
        port = free_port()
        command = [sys.executable, "-m", "server", "--checkpoint", str(checkpoint), "--port", str(port),
                   "--enforce-eager", "--max-num-seqs", str(max(batches)),
                   "--async-scheduling" if overlap else "--no-async-scheduling"]
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        with local_server(command, port, log, name="the server", timeout=120, env=env) as url:
            rows = []
            for batch in batches:
                asyncio.run(_stream_batch(url, batch, 4))  # warm-up
                gaps = [g for _ in range(rounds) for g in asyncio.run(_stream_batch(url, batch, tokens))]
                rows.append({"batch": batch, "overlap": overlap, "tpot_us": statistics.median(gaps) * 1e6})
                print(f"  server{'-overlap' if overlap else '':<9} batch {batch:>3}: {rows[-1]['tpot_us']:7.0f} µs "
                      "per output token", flush=True)
            return rows


async def _stream_batch(url: str, batch: int, tokens: int) -> list[float]:
    """``batch`` streamed completions at once; each one's seconds per token after its first."""
    import aiohttp

    body = {"model": "minillm", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(session: aiohttp.ClientSession, i: int) -> float:
        prompt = [(7 * i + j) % (PROBE.vocab_size - 1) + 1 for j in range(16)]
        first = last = None
        received = 0
        async with session.post(f"{url}/v1/completions", json=body | {"prompt": prompt}) as response:
            if response.status != 200:
                raise RuntimeError(f"the server answered {response.status}: {await response.text()}")
            async for line in response.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:  # a token's text (the last chunk holds the usage alone)
                        last = time.perf_counter()
                        first = first or last
                    received = (chunk.get("usage") or {}).get("completion_tokens", received)
        if received != tokens:
            raise RuntimeError(f"asked for {tokens} tokens, streamed {received}")
        return (last - first) / (tokens - 1)

    # no connection limit: aiohttp would hold all but 100 at once, and measure a smaller batch
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(batch))))


def run_host_bench(batches: list[int], methods: list[str], steps: int, threads: int,
                   device: torch.device, server_batches: list[int] = (), tokens: int = 64) -> dict:
    """Every (method, batch) of the probe, printed as it goes, and the fits; then, given
    ``server_batches``, the probe served and streamed at those batches."""
    model, rows, before = probe_model(device), [], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for method in methods:
            for batch in batches:
                row = host_step(model, batch, method, steps)
                rows.append(row)
                print(f"  {method:<9} batch {batch:>3}: {row['step_us']:7.0f} µs/step  "
                      + ", ".join(f"{k} {v:.0f}" for k, v in row["phases_us"].items()), flush=True)
        device_label = device_name(device)
    finally:  # the caller's thread count, whatever happened (a test suite runs on in this process)
        torch.set_num_threads(before)
    report = {"device": device_label, "device_type": device.type, "threads": threads,
              "probe": PROBE.to_dict(), "steps": steps, "rows": rows, "fits": fit(rows)}
    for method, f in report["fits"].items():
        print(f"  fit, {method}: {f['fixed_us']:.0f} µs per step + {f['per_sequence_us']:.1f} µs per sequence")
    if server_batches:
        report["server"] = [row for overlap in (False, True)
                            for row in server_tpot(list(server_batches), tokens, threads, overlap)]
        report["server_tokens"] = tokens
    return report


def figure(report: dict):
    """One panel per way of running the step (eager, captured): the serial engine's phases in
    microseconds per step, stacked, against the batch, its measured step time, the overlapped
    engine's beside it, and each one's fitted line."""
    import matplotlib.pyplot as plt  # the caller's backend: a notebook shows it inline
    kinds = list(dict.fromkeys(r["method"].split("-")[0] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        for method, marker in ((kind, "ko"), (f"{kind}-overlap", "bs")):
            rows = [r for r in report["rows"] if r["method"] == method]
            if not rows:
                continue
            batches = [r["batch"] for r in rows]
            phases = list(rows[0]["phases_us"])
            if phases:
                ax.stackplot(batches, *[[r["phases_us"][p] for r in rows] for p in phases], labels=phases, alpha=0.8)
            ax.plot(batches, [r["step_us"] for r in rows], marker, label=f"{method}: step (median)")
            f = report["fits"].get(method)
            if f:
                ax.plot(batches, [f["fixed_us"] + f["per_sequence_us"] * b for b in batches], marker[0] + "--",
                        label=f"{f['fixed_us']:.0f} µs + {f['per_sequence_us']:.1f} µs x batch")
        for overlap, marker in ((False, "r^"), (True, "mv")):
            served = [r for r in report.get("server", []) if kind == "eager" and r["overlap"] is overlap]
            if served:
                ax.plot([r["batch"] for r in served], [r["tpot_us"] for r in served], marker, ms=8,
                        label=f"through the server{', overlapped' if overlap else ''} (time per output token)")
        ax.set(title=f"{kind}: the probe's decode step", xlabel="batch (sequences)", ylabel="µs per step")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Host work per decode step, {report['device']}", fontsize=10)
    return fig


def add_arguments(p) -> None:
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=60, help="decode steps timed per point (and as many per phase)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the probe's forward needs one)")
    p.add_argument("--server", default=None, metavar="BATCHES",
                   help="also serve the probe and stream this many requests at once, e.g. 1,8,32")
    p.add_argument("--tokens", type=int, default=64, help="tokens per streamed request (with --server)")
    add_options(p, "--device", "--out")


def run_from_args(args, out: Path) -> Path:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"--methods takes {', '.join(METHODS)}, not {args.methods!r}")
    if args.steps < 2 or args.threads < 1 or args.tokens < 2:
        raise UsageError("--steps and --tokens must be at least 2, --threads at least 1")
    device = torch.device(args.device) if args.device else default_device()
    served = parse_batches(args.server) if args.server else []
    report = run_host_bench(parse_batches(args.batches), methods, args.steps, args.threads, device, served, args.tokens)
    pyplot()  # Agg before the figure: it goes to a file
    return save_report(report, out / f"host-{device.type}.json", lambda r, png: save_figure(figure(r), png))
