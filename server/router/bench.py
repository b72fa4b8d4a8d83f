"""``python -m server.router.bench``: what the router does, measured with the load generator.

Four experiments, on replicas this module starts (``python -m server``, the same checkpoint,
``--max-num-seqs 16`` so that queues can form, a small KV cache so that caches can fill) and
a router it runs in its own event loop:

1. **Scaling**: the same open-loop load through 1, 2 and 3 replicas (least-outstanding).
2. **Policies under skew**: another tenant keeps replica 0 busy with requests that never pass
   through the router; the same load goes through each policy in turn.
3. **Shared prefixes**: requests that share one of a few dozen long "system prompts"; each
   policy in turn, with the prefix-cache hit rate the replicas report.
4. **Failover**: a replica is killed (SIGKILL) in the middle of a run; every request must end
   either complete or with an error the client sees, none silently truncated. Then the
   replica is restarted on its old port and the router re-admits it.

All replicas share this machine's cores: on a small CPU more replicas add no compute, only
contention, so experiment 1 measures the router's overhead and the cost of splitting a batch,
not the scaling a fleet of machines would show. Results go to ``router-<device>.json`` and a
PNG in ``benchmarks/results/``. ``MINILLM_QUICK=1`` shrinks every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from minillm.bench import add_options, results_dir, save_figure, save_report
from minillm.cli import ArgumentParser, run
from minillm.settings import quick
from server.connections import running
from server.launch import ServerProcess, start_server, stop_all
from server.loadgen.client import LoadRun, LoadSpec, send_request
from server.loadgen.stats import Summary, parse_slo
from server.router.__main__ import ROUTER, RouterState, create_router, spawn_replicas
from server.router.config import RouterConfig
from server.router.policy import POLICIES

REPLICA_FLAGS = "--device cpu --max-num-seqs 16 --kv-cache-memory 24MiB"
CLOCK = "client: time.perf_counter() around each streamed request; router in the client's process"


@dataclass(frozen=True)
class BenchSizes:
    """How much traffic each experiment sends."""

    replicas: int = 3
    requests: int = 80  # per run, experiments 1, 2 and 4
    rate: float = 5.0  # requests per second
    input_len: int = 64
    output_len: int = 32
    slo: str = "ttft=500ms,tpot=100ms"
    tenant_requests: int = 14  # experiment 2: the other tenant's requests in flight on replica 0
    tenant_output_len: int = 160
    groups: int = 24  # experiment 3: distinct shared prefixes
    prefix_len: int = 192
    suffix_len: int = 16
    prefix_output_len: int = 16
    prefix_requests: int = 96
    prefix_rate: float = 6.0
    kill_at: float = 0.4  # experiment 4: the kill, as a fraction of the run's arrivals
    failover_output_len: int = 128  # long answers, so that some are mid-stream at the kill

    def spec(self, url: str, **changes) -> LoadSpec:
        return replace(LoadSpec(url=url, num_prompts=self.requests, request_rate=self.rate, input_len=self.input_len,
                                output_len=self.output_len, slo=parse_slo(self.slo), request_timeout=60), **changes)


FULL = BenchSizes()
QUICK = BenchSizes(requests=16, rate=10.0, input_len=32, output_len=16, tenant_requests=14, tenant_output_len=64,
                   groups=8, prefix_len=96, prefix_requests=16, prefix_rate=10.0, failover_output_len=48)


def sizes() -> BenchSizes:
    return QUICK if quick() else FULL


def row(summary: Summary) -> dict:
    """The figures a table shows for one run (milliseconds, client clock)."""
    return {"completed": summary.completed, "failed": summary.failed, "req/s": summary.request_throughput,
            "output tok/s": summary.output_throughput, "TTFT p50": summary.ttft_ms.p50,
            "TTFT p99": summary.ttft_ms.p99, "TPOT p50": summary.tpot_ms.p50, "TPOT p99": summary.tpot_ms.p99,
            "goodput req/s": summary.goodput}


@contextlib.asynccontextmanager
async def routed(urls: Sequence[str], policy: str, **options) -> AsyncIterator[tuple[str, RouterState]]:
    """A router over ``urls`` on a free port of this process; yields its URL and state."""
    app = create_router(urls, RouterConfig(replicas=list(urls), policy=policy, **options))
    async with running(app, shutdown_grace=1) as url:
        yield url, app[ROUTER]


# ----------------------------------------------------------------------------- 1. scaling


async def scaling(urls: Sequence[str], size: BenchSizes) -> list[dict]:
    rows = []
    for n in range(1, len(urls) + 1):
        async with routed(urls[:n], "least-outstanding") as (url, _):
            rows.append({"replicas": n, **row(await LoadRun(size.spec(url)).run())})
    return rows


# ----------------------------------------------------------------------------- 2. policies under skew


@contextlib.asynccontextmanager
async def other_tenant(url: str, in_flight: int, output_len: int) -> AsyncIterator[None]:
    """Keep ``in_flight`` requests running on the replica at ``url`` (a closed loop), as
    traffic from a client the router never sees would."""
    rng = random.Random(1)

    async def loop(session: aiohttp.ClientSession) -> None:
        while True:
            await send_request(session, url, "minillm", [rng.randrange(50000) for _ in range(64)], output_len, 60)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(loop(session)) for _ in range(in_flight)]
        await asyncio.sleep(1.0)  # let its queue form
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def policies_under_skew(urls: Sequence[str], size: BenchSizes) -> list[dict]:
    rows = []
    async with other_tenant(urls[0], size.tenant_requests, size.tenant_output_len):
        for policy in POLICIES:
            async with routed(urls[:2], policy, health_interval=0.25, health_timeout=0.2) as (url, state):
                summary = await LoadRun(size.spec(url)).run()
                sent = [r.requests for r in state.replicas.replicas]
            rows.append({"policy": policy, **row(summary), "share to busy replica": sent[0] / sum(sent)})
    return rows


# ----------------------------------------------------------------------------- 3. shared prefixes


def shared_prefix_prompts(size: BenchSizes, seed: int) -> list[list[int]]:
    """``prefix_requests`` prompts, each one of ``groups`` shared prefixes plus its own suffix,
    in random order. A different seed gives different prefixes, so no run finds another's."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50000) for _ in range(size.prefix_len)] for _ in range(size.groups)]
    return [rng.choice(prefixes) + [rng.randrange(50000) for _ in range(size.suffix_len)]
            for _ in range(size.prefix_requests)]


async def cache_counts(session: aiohttp.ClientSession, urls: Sequence[str]) -> tuple[float, float, float]:
    """Prompt tokens looked up and found in the prefix caches, and preemptions, summed over
    ``urls``. The replicas export a hit *rate*; times their prompt-token counter it is a
    count, exactly so while nothing has been preempted (a preempted request is looked up
    again when it comes back), which is why the preemptions are returned too."""
    looked = found = preempted = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        value = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        tokens = value["minillm:prompt_tokens_total"]
        looked, found = looked + tokens, found + tokens * value["minillm:prefix_cache_hit_rate"]
        preempted += value["minillm:num_preemptions_total"]
    return looked, found, preempted


async def prefix_sharing(urls: Sequence[str], size: BenchSizes) -> list[dict]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for seed, policy in enumerate(POLICIES, start=10):
            looked, found, preempted = await cache_counts(session, urls)
            async with routed(urls, policy) as (url, _):
                summary = await LoadRun(size.spec(
                    url, fixed_prompts=shared_prefix_prompts(size, seed), num_prompts=size.prefix_requests,
                    warmup=0, request_rate=size.prefix_rate,
                    output_len=size.prefix_output_len)).run()
            looked_after, found_after, preempted_after = await cache_counts(session, urls)
            hit_rate = (found_after - found) / (looked_after - looked) if looked_after > looked else 0.0
            rows.append({"policy": policy, **row(summary), "prefix cache hit rate": hit_rate,
                         "preemptions so far": preempted_after})
    return rows


# ----------------------------------------------------------------------------- 4. failover


async def failover(fleet: list[ServerProcess], checkpoint: str, size: BenchSizes) -> dict:
    """Kill the last replica mid-run; count what happened to every request; restart it on
    its old port and time the router's re-admission. ``fleet``'s last entry is replaced by
    the restarted replica."""
    victim = fleet[-1]
    async with routed([s.url for s in fleet], "least-outstanding") as (url, state):  # checks every 1 s
        load = LoadRun(size.spec(url, output_len=size.failover_output_len))
        timeline, t0 = [], time.perf_counter()

        async def watch() -> None:
            while True:
                timeline.append({"t": time.perf_counter() - t0, "completed": sum(r.ok for r in load.results),
                                 "failed": sum(not r.ok for r in load.results),
                                 "healthy": sum(r.healthy for r in state.replicas.replicas)})
                await asyncio.sleep(0.1)

        async def kill() -> None:
            while load.sent < size.kill_at * size.requests:
                await asyncio.sleep(0.02)
            victim.proc.kill()
            timeline.append({"t": time.perf_counter() - t0, "event": "killed"})

        watcher, killer = asyncio.create_task(watch()), asyncio.create_task(kill())
        summary = await load.run()
        await killer
        victim_state = next(r for r in state.replicas.replicas if r.url == victim.url)
        ejected = not victim_state.healthy
        port = victim.url.rsplit(":", 1)[1]
        restart = time.perf_counter()
        fleet[-1] = await asyncio.to_thread(start_server, checkpoint, *REPLICA_FLAGS.split(), "--port", port)
        while not victim_state.healthy:
            await asyncio.sleep(0.05)
        readmitted_after = time.perf_counter() - restart
        watcher.cancel()
        truncated = sum(r.ok and r.output_tokens != r.output_len for r in load.results)
        return {"summary": row(summary), "errors": summary.errors, "sent": load.sent,
                "retries": state.retries, "midstream failures": state.midstream_failures,
                "ejected": ejected, "silently truncated": truncated, "unanswered": load.sent - len(load.results),
                "restart to re-admission s": readmitted_after, "timeline": timeline}


# ----------------------------------------------------------------------------- all of it


async def run_experiments(fleet: list[ServerProcess], checkpoint: str, size: BenchSizes) -> dict:
    """In this order: the prefix experiment needs replicas that have not preempted yet (see
    :func:`cache_counts`), and the failover replaces a replica."""
    urls = [s.url for s in fleet]
    results = {"scaling": await scaling(urls, size), "shared prefixes": await prefix_sharing(urls, size)}
    results["policies under skew"] = await policies_under_skew(urls, size)
    results["failover"] = await failover(fleet, checkpoint, size)
    return results


def start_fleet(checkpoint: str, n: int) -> list[ServerProcess]:
    return spawn_replicas(RouterConfig(spawn=n, checkpoint=checkpoint, replica_args=REPLICA_FLAGS))


def bench(checkpoint: str, size: BenchSizes | None = None) -> dict:
    """Start the replicas, run the four experiments, stop the replicas; return the report."""
    size = size or sizes()
    fleet = start_fleet(checkpoint, size.replicas)
    try:
        results = asyncio.run(run_experiments(fleet, checkpoint, size))
    finally:
        stop_all(fleet)
    return make_report(size, results)


def make_report(size: BenchSizes, results: dict) -> dict:
    """The JSON record: what was sent, on which clock, with which replicas, and the results."""
    return {"clock": CLOCK, "replica flags": REPLICA_FLAGS, "sizes": asdict(size), **results}


def save(report: dict, out: Path, device: str = "cpu") -> Path:
    return save_report(report, out / f"router-{device}.json", lambda r, png: save_figure(plot(r), png, dpi=110),
                       allow_nan=False)


def plot(report: dict):
    """Four panels: p99 TTFT by replica count, by policy under skew, hit rate by policy, and
    the failover timeline."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    scale = report["scaling"]
    axes[0].bar([str(r["replicas"]) for r in scale], [r["TTFT p99"] for r in scale], color="#9ab8d8")
    axes[0].set(xlabel="replicas (same cores)", ylabel="p99 TTFT (ms)", title="1 vs 2 vs 3 replicas, same load")
    skew = report["policies under skew"]
    axes[1].bar([r["policy"] for r in skew], [r["TTFT p99"] for r in skew], color="#e0a458")
    axes[1].set(ylabel="p99 TTFT (ms)", title="policies, one replica busy with another tenant")
    shared = report["shared prefixes"]
    axes[2].bar([r["policy"] for r in shared], [r["prefix cache hit rate"] for r in shared], color="#7fb77e")
    axes[2].set(ylabel="prompt tokens found cached", ylim=(0, 1), title="policies, shared prefixes")
    for ax in axes[1:3]:
        ax.tick_params(axis="x", labelrotation=20)
    timeline = report["failover"]["timeline"]
    points = [p for p in timeline if "event" not in p]
    t = [p["t"] for p in points]
    axes[3].plot(t, [p["completed"] for p in points], label="completed")
    axes[3].plot(t, [p["failed"] for p in points], label="failed, error seen")
    for p in timeline:
        if p.get("event") == "killed":
            axes[3].axvline(p["t"], color="#c53030", ls="--", lw=1, label="replica killed")
    axes[3].set(xlabel="seconds (from the warm-up request)", ylabel="requests", title="failover: a replica killed mid-run")
    healthy = axes[3].twinx()
    healthy.plot(t, [p["healthy"] for p in points], color="#555555", ls=":", drawstyle="steps-post")
    healthy.set(ylabel="healthy replicas (dotted)", ylim=(0, report["sizes"]["replicas"] + 2))
    axes[3].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    from minillm.model.checkpoint import preset_dir

    parser = ArgumentParser(prog="python -m server.router.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="what the replicas serve (default: the cpu preset's)")
    add_options(parser, "--out")
    args = parser.parse_args(argv)
    print(f"saved {save(bench(args.checkpoint or str(preset_dir('cpu'))), results_dir(args.out))}")
    return 0


if __name__ == "__main__":
    run(main, prog="python -m server.router.bench")
