"""``python -m server.loadgen``: throw traffic at a running server and report what users feel.

One run sends ``--num-prompts`` requests (or ``--duration`` seconds of them) arriving at
``--request-rate`` per second, streams each, and prints vLLM ``bench serve``'s report:
throughput, TTFT, TPOT, ITL and E2E at mean, p50, p95 and p99, and goodput against
``--slo``. ``--sweep 1,2,4,8`` repeats the run at each rate and draws the two curves that tell
how much load the server can take: latency against achieved throughput (flat, then a knee,
then a wall) and goodput against offered load (it rises with the rate until the SLOs start to
fail, then falls). Results go to ``benchmarks/results/`` as JSON (and a PNG for a sweep).

Everything is measured on the client's clock (:mod:`server.loadgen.stats`).
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

from minillm.bench import pyplot, results_dir, save_figure, save_report
from minillm.cli import ArgumentParser, UsageError, run
from server.loadgen.client import DATASETS, DEFAULT_URL, LoadRun, LoadSpec
from server.loadgen.stats import Summary, parse_slo

DEFAULT_NUM_PROMPTS = 100
CLOCK = "client: time.perf_counter() around each streamed request"


def build_parser() -> ArgumentParser:
    d = LoadSpec()
    p = ArgumentParser(prog="python -m server.loadgen",
                       description="Open-loop load against a minillm (or any OpenAI-compatible) server, "
                                   "measured as vLLM's bench serve measures it.")
    p.add_argument("--url", default=DEFAULT_URL, help="the server's base URL (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default: {DEFAULT_NUM_PROMPTS}, or unlimited with --duration)")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="mean arrivals per second; inf sends everything at once (default: inf)")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the gaps: 1 is Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight from this client")
    p.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens (default: %(default)s)")
    p.add_argument("--range-ratio", type=float, default=d.range_ratio,
                   help="lengths uniform in len * (1 -+ ratio) (default: %(default)s)")
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="random token ids, or windows of the training corpus (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="uncounted requests first (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request")
    p.add_argument("--slo", default="", help="objectives for goodput, e.g. ttft=500ms,tpot=100ms,e2el=5s")
    p.add_argument("--sweep", default="", help="comma-separated request rates, one run each, e.g. 1,2,4,8")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key for a server started with --api-key (default: $OPENAI_API_KEY)")
    p.add_argument("--no-keep-alive", dest="keep_alive", action="store_false",
                   help="a new connection per request, for servers that close kept-alive ones after a few "
                        "requests (llama-server)")
    p.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    return p


def spec_from_args(args) -> LoadSpec:
    """The flags as a checked ``LoadSpec``; a bad combination is a one-line ``UsageError``."""
    settings = {k: v for k, v in vars(args).items() if k not in ("sweep", "out")}
    if args.num_prompts is None and not args.duration:
        settings["num_prompts"] = DEFAULT_NUM_PROMPTS
    try:
        return LoadSpec(**{**settings, "slo": parse_slo(args.slo)})
    except ValueError as err:
        raise UsageError(str(err)) from None


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> ``[1.0, 2.0, 4.0, inf]``."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise UsageError(f"--sweep takes request rates like 1,2,4,8, not {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise UsageError(f"--sweep needs positive request rates, got {text!r}")
    return rates


async def run_rates(spec: LoadSpec, rates: list[float]) -> tuple[str, list[dict]]:
    """One run per rate, in order, on the same prompts (same seed); returns the served
    model's name and each run's summary with its offered rate."""
    runs, model = [], ""
    for rate in rates:
        load = LoadRun(replace(spec, request_rate=rate))
        summary = await load.run()
        model = load.info.model
        print(format_report(summary, rate), flush=True)
        runs.append({"request_rate": "inf" if math.isinf(rate) else rate, **asdict(summary)})  # JSON has no inf
    return model, runs


def format_report(s: Summary, rate: float) -> str:
    """The run as a person reads it; latencies in milliseconds."""
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items()))
    lines = [
        f"{'=' * 16} {s.completed + s.failed} requests at {rate:g} req/s (client clock) {'=' * 16}",
        f"{'Successful requests:':<36}{s.completed}",
        f"{'Failed requests:':<36}{s.failed}" + (f"   ({errors})" if errors else ""),
        f"{'Duration (s):':<36}{s.duration_s:.2f}",
        f"{'Peak concurrency:':<36}{s.peak_concurrency}",
        f"{'Request throughput (req/s):':<36}{s.request_throughput:.2f}",
        f"{'Output token throughput (tok/s):':<36}{s.output_throughput:.1f}",
        f"{'Total token throughput (tok/s):':<36}{s.total_token_throughput:.1f}",
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s.slo_ms.items())
        lines.append(f"{'Goodput (req/s):':<36}{s.goodput:.2f}   ({slo})")
    lines.append(f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}")
    for name, lat in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2el_ms)):
        cells = ("-" if v is None else f"{v:.1f}" for v in (lat.mean, lat.p50, lat.p95, lat.p99))
        lines.append(f"{name:<12}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def report_of(spec: LoadSpec, model: str, runs: list[dict]) -> dict:
    """The JSON record: what was sent (never the API key), on which clock, and each run."""
    sent = {k: v for k, v in asdict(spec).items() if k != "api_key"}
    sent["slo"] = {k: v * 1e3 for k, v in (spec.slo or {}).items()}
    sent["request_rate"] = [r["request_rate"] for r in runs]
    return {"clock": CLOCK, "model": model, "spec": sent, "runs": runs}


def save(report: dict, out: Path) -> Path:
    """``loadtest.json`` for one run; ``loadtest-sweep.json`` and ``.png`` for a sweep."""
    sweep = len(report["runs"]) > 1
    return save_report(report, out / ("loadtest-sweep.json" if sweep else "loadtest.json"),
                       plot_sweep if sweep else None, allow_nan=False)


def plot_sweep(report: dict, path: Path) -> None:
    """Latency against achieved throughput (TTFT, TPOT at p50 and p99), and achieved
    throughput and goodput against the offered rate."""
    plt = pyplot()
    runs = report["runs"]
    x = [r["output_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [math.nan if r[key][q] is None else r[key][q] for r in runs], style, label=f"{name} {q}")
        ax.set(xlabel="achieved output tokens/s", ylabel=f"{name} (ms)", title=f"{name} vs throughput")
        ax.legend()
    labels = [r["request_rate"] if isinstance(r["request_rate"], str) else f"{r['request_rate']:g}" for r in runs]
    positions = range(len(runs))  # evenly spaced: a sweep usually doubles, and inf has no place on an axis
    axes[2].plot(positions, [r["request_throughput"] for r in runs], "o-", label="completed req/s")
    if runs[0]["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in runs[0]["slo_ms"].items())
        axes[2].plot(positions, [r["goodput"] for r in runs], "s-", label=f"goodput ({slo})")
    axes[2].set_xticks(list(positions), labels)
    axes[2].set(xlabel="offered request rate (req/s)", ylabel="req/s", title="throughput and goodput")
    axes[2].legend()
    fig.suptitle(f"{report['model']}: {report['spec']['input_len']} in / {report['spec']['output_len']} out tokens, "
                 f"client-side timing", fontsize=10)
    save_figure(fig, path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = spec_from_args(args)
    rates = parse_rates(args.sweep) if args.sweep else [spec.request_rate]
    try:
        model, runs = asyncio.run(run_rates(spec, rates))
    except (ConnectionError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(f"\nsaved {save(report_of(spec, model, runs), results_dir(args.out))}")
    return 0


if __name__ == "__main__":
    run(main, prog="python -m server.loadgen")
