"""``GET /metrics``: the server's vital signs in Prometheus' text format.

The names follow vLLM's (its ``vllm:time_to_first_token_seconds`` is our
``minillm:time_to_first_token_seconds``), so an operator's dashboards and alerts carry over.
The latency histograms come from the engine's own timestamps (:mod:`server.engine_loop`), the
gauges from its latest stats at scrape time; refusals (429, 4xx) show in ``http_requests`` by
path and status. Each server owns its registry, so two servers in one process never mix counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.memory import full_context_sequences
from minillm.engine.sequence import RequestTimes
from server.engine_loop import AsyncEngine

PREFIX = "minillm:"
# vLLM's buckets, with millisecond buckets added below them: a small model on a CPU is fast.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = r = CollectorRegistry()
        self._engine = engine
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduled.",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished requests (choices) by finish reason.",
                                ["finished_reason"], registry=r)
        self.http = Counter(PREFIX + "http_requests", "HTTP responses by path and status.", ["path", "status"],
                            registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Sequences preempted to free KV blocks.", registry=r)
        self._preemptions_seen = 0
        gauges = {
            "num_requests_running": ("Requests in the running batch.", lambda s: s.running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use, 0..1.", lambda s: s.kv_cache_usage),
            "prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache / looked up.",
                                      lambda s: s.prefix_cache_hit_rate),
        }
        for name, (text, read) in gauges.items():
            Gauge(PREFIX + name, text, registry=r).set_function(lambda read=read: read(self._engine.stats))

    def show_memory(self, engine: LLMEngine) -> None:
        """Export ``engine``'s memory split (module docstring): set once, since the pool never
        changes size."""
        r, pool, ctx = self.registry, engine.pool, engine.model.cfg.context_length
        parts = engine.memory.parts() if engine.memory is not None else {"kv_cache": pool.nbytes}
        memory = Gauge(PREFIX + "memory_bytes", "The memory budget's split, by part (bytes).", ["part"], registry=r)
        for part, value in parts.items():
            memory.labels(part).set(value)
        Gauge(PREFIX + "kv_cache_blocks", "KV-cache blocks in the pool.", registry=r).set(pool.num_blocks)
        Gauge(PREFIX + "kv_cache_full_context_sequences", "Sequences of full context the KV cache holds at once.",
              registry=r).set(full_context_sequences(pool.num_blocks, pool.block_size, ctx))

    def choice_finished(self, reason: str, times: RequestTimes | None) -> None:
        """Count one finished choice; a normal finish also records its latencies."""
        self.finished.labels(reason).inc()
        if times is None:
            return
        self.ttft.observe(times.ttft)
        self.e2e.observe(times.e2e)
        self.queue_time.observe(times.queue_time)
        for gap in times.inter_token_latencies():
            self.itl.observe(gap)

    def render(self) -> bytes:
        """The text exposition, after bringing the preemption counter up to the engine's."""
        total = self._engine.stats.preemptions
        self.preemptions.inc(max(0, total - self._preemptions_seen))
        self._preemptions_seen = max(total, self._preemptions_seen)
        return generate_latest(self.registry)
