"""The load generator's arithmetic: one request's timings, and a run's summary of them.

The definitions are those of vLLM's ``bench serve``, so our figures compare with anyone's:

- **TTFT**, time to first token: from sending the request to the first streamed chunk.
- **ITL**, inter-token latency: every gap between consecutive chunks of one request, pooled
  over all requests. (A chunk usually carries one token; our server holds back a token that
  ends mid-character, so now and then a chunk carries two and the gap covers both.)
- **TPOT**, time per output token: ``(E2E - TTFT) / (output tokens - 1)`` for each request
  with more than one token; the mean decode speed one user saw.
- **E2E**, end-to-end latency: from sending to the last chunk.
- **Goodput**: completed requests per second that met *every* SLO given (TTFT, TPOT, E2E).

All of these are measured on the client's clock (``time.perf_counter()``), so they include
the network, HTTP and JSON on both sides, and any wait in the server's queue: what a user
feels. The server's ``/metrics`` histograms time the same events from the request's arrival
in the handler to the engine producing the token, and so read a little lower.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 95, 99)
SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}
UNITS = {"ms": 1e-3, "s": 1.0}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, numpy's "linear" method: sort, place
    rank ``h = (n - 1) * q / 100``, and interpolate between the values either side of it.

    >>> percentile([1, 2, 3, 4], 50)
    2.5
    """
    if not values:
        raise ValueError("the percentile of no values is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds on the client's clock."""

    prompt_len: int
    output_len: int  # the max_tokens asked for
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None  # "HTTP 429", "timeout", ...; None when it completed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for a one-token answer."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets(self, slo: dict[str, float]) -> bool:
        """Whether this request met every service-level objective in ``slo`` (seconds). A
        one-token answer has no TPOT and so cannot miss a TPOT objective."""
        measured = {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2e}
        return self.ok and all(measured[k] is None or measured[k] <= limit for k, limit in slo.items())


@dataclass
class Latency:
    """Mean and percentiles of one latency, in milliseconds (None when nothing was measured)."""

    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        if not seconds:
            return cls(None, None, None, None)
        ms = [s * 1e3 for s in seconds]
        return cls(sum(ms) / len(ms), *(percentile(ms, q) for q in PERCENTILES))


@dataclass
class Summary:
    """What a run achieved: vLLM's ``bench serve`` report, field for field."""

    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input + output tokens per second
    peak_concurrency: int
    ttft_ms: Latency
    tpot_ms: Latency
    itl_ms: Latency
    e2el_ms: Latency
    slo_ms: dict[str, float]
    goodput: float | None  # requests per second meeting every SLO; None without SLOs


def summarize(results: list[RequestResult], duration_s: float, peak_concurrency: int,
              slo: dict[str, float] | None = None) -> Summary:
    """Aggregate a run's requests. Throughputs divide by the whole run's wall-clock duration,
    from the first request sent to the last one finished."""
    slo = slo or {}
    done = [r for r in results if r.ok]
    rate = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: 0.0)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return Summary(
        completed=len(done),
        failed=len(results) - len(done),
        errors=dict(Counter(r.error for r in results if not r.ok)),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        peak_concurrency=peak_concurrency,
        ttft_ms=Latency.of([r.ttft for r in done]),
        tpot_ms=Latency.of([r.tpot for r in done if r.tpot is not None]),
        itl_ms=Latency.of([gap for r in done for gap in r.itl]),
        e2el_ms=Latency.of([r.e2e for r in done]),
        slo_ms={k: v * 1e3 for k, v in slo.items()},
        goodput=rate(sum(r.meets(slo) for r in done)) if slo else None,
    )


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=500ms,tpot=100ms,e2el=2s"`` -> seconds per objective. A bare number is in
    milliseconds, as in vLLM's ``--goodput``."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        key = SLO_NAMES.get(name.strip().lower())
        if key is None or not value:
            raise ValueError(f"an SLO looks like ttft=500ms, tpot=100ms or e2el=2s, not {part!r}")
        value = value.strip().lower()
        unit = next((u for u in ("ms", "s") if value.endswith(u)), "")
        try:
            number = float(value.removesuffix(unit)) if unit else float(value)
        except ValueError:
            raise ValueError(f"the SLO {part!r} needs a number of ms or s") from None
        if not number > 0:
            raise ValueError(f"the SLO {part!r} must be positive")
        slo[key] = number * UNITS[unit or "ms"]
    return slo
