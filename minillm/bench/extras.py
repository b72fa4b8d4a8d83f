"""What a request's extras cost its batch: ``python -m minillm.bench extras``.

Penalties, a logit bias, logprobs and a JSON Schema each add work to the step that samples a
row (:meth:`minillm.engine.model_runner.ModelRunner.compute`). The question a server cares about is what
that does to everyone's step: a batch of 32 decoding requests where one asks (its neighbours
plain, greedy) and where all 32 ask, beside the same batch where none does.

Each variant is its own engine holding 32 requests that have finished their prefill; a round
times a few decode steps of every variant in turn, so a slow moment of a shared machine hits
all variants alike, and the contexts of all of them grow together. Medians and quartiles over
the rounds.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from minillm.bench import add_options, pyplot, save_figure, save_report
from minillm.bench.engine import load_weights, prefilled
from minillm.cli import UsageError
from minillm.engine.config import EngineConfig
from minillm.engine.build import build_engine
from minillm.engine.llm_engine import LLMEngine
from minillm.machine.hardware import Timing, default_device, device_name
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams
from minillm.decoding.structured import GrammarCompiler
from minillm.data.tokenizer import get_tokenizer

BATCH = 32
PROMPT_LEN = 32
# A schema the answer cannot complete within the measured steps (a 4,000-character string),
# so the constrained rows are masked at every one of them.
LONG_ANSWER = {"type": "object", "required": ["story"], "additionalProperties": False,
               "properties": {"story": {"type": "string", "minLength": 4000}}}
# What each variant asks of a row that asks: the extras of one feature, nothing else.
EXTRAS: dict[str, dict] = {
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "logit_bias": dict(logit_bias={t: -5.0 for t in range(0, 50_000, 500)}),
    "logprobs=5": dict(logprobs=5),
    "json_schema": dict(json_schema=LONG_ANSWER),
}


def _engine(model: GPT, asking: int, extras: dict, max_tokens: int) -> LLMEngine:
    """An engine with ``BATCH`` greedy requests past their prefill, the first ``asking`` of
    them with ``extras``."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model.cfg.vocab_size - 1, (PROMPT_LEN,), generator=gen).tolist() for _ in range(BATCH)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **(extras if i < asking else {}))
              for i in range(BATCH)]
    return prefilled(build_engine(model, EngineConfig(max_num_seqs=BATCH)), prompts, params)


def _timed_steps(engine: LLMEngine, steps: int) -> float:
    """Seconds per decode step over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def step_costs(model: GPT, rounds: int = 30, steps: int = 2, progress: Callable[[str], None] | None = None) -> dict:
    """Decode-step seconds, median and quartiles over ``rounds`` interleaved rounds of
    ``steps`` steps, for the plain batch and for 1 and ``BATCH`` rows asking each extra."""
    max_tokens = 4 + rounds * steps + 2
    variants = {"plain": _engine(model, 0, {}, max_tokens)}
    for name, extras in EXTRAS.items():
        for asking in (1, BATCH):
            variants[f"{name}, {asking}/{BATCH}"] = _engine(model, asking, extras, max_tokens)
    for engine in variants.values():  # warm every shape once before any timing
        _timed_steps(engine, 1)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order, shuffler = list(variants), random.Random(0)
    for r in range(rounds):
        # every round in its own order, so that no variant always follows the same neighbour
        # (in a fixed order plain, timed right after the slowest variant, read slower than
        # variants doing more work)
        shuffler.shuffle(order)
        for name in order:
            times[name].append(_timed_steps(variants[name], steps))
        if progress:
            progress(f"round {r + 1}/{rounds}")
    plain = statistics.median(times["plain"])
    rows = []
    for name, ts in times.items():
        t = Timing.of(ts)
        rows.append({"variant": name, "median_ms": t.median * 1e3, "q1_ms": t.q1 * 1e3, "q3_ms": t.q3 * 1e3,
                     "vs_plain": t.median / plain})
    return {"batch": BATCH, "prompt_len": PROMPT_LEN, "rounds": rounds, "steps_per_round": steps,
            "device": device_name(model.device), "threads": torch.get_num_threads(), "rows": rows,
            "grammar_setup": grammar_setup()}


def grammar_setup() -> dict:
    """What a first schema costs before its first step: indexing the vocabulary (once per
    process) and compiling one schema (once per new schema: the compiler keeps it, so each
    time a different one, a longer minimum length)."""
    compiler = GrammarCompiler(get_tokenizer())
    start = time.perf_counter()
    compiler.vocabulary
    indexed = time.perf_counter()
    compiles = []
    for i in range(20):
        story = {**LONG_ANSWER["properties"]["story"], "minLength": 4000 + i}
        t = time.perf_counter()
        compiler.compile({**LONG_ANSWER, "properties": {"story": story}})
        compiles.append(time.perf_counter() - t)
    return {"vocabulary_index_s": indexed - start, "schema_compile_ms": statistics.median(compiles) * 1e3}


def table(report: dict) -> str:
    lines = [f"{'variant':<26}{'median ms':>10}{'q1..q3':>16}{'x plain':>9}"]
    for row in report["rows"]:
        lines.append(f"{row['variant']:<26}{row['median_ms']:>10.2f}{row['q1_ms']:>8.2f}..{row['q3_ms']:<6.2f}"
                     f"{row['vs_plain']:>9.2f}")
    g = report["grammar_setup"]
    lines.append(f"vocabulary index for grammars: {g['vocabulary_index_s']:.2f} s once; "
                 f"a schema compiles in {g['schema_compile_ms']:.2f} ms")
    return "\n".join(lines)


def figure(report: dict):
    """Step time per variant, with its quartiles, beside the plain batch's."""
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = [r["variant"] for r in rows]
    med = [r["median_ms"] for r in rows]
    err = [[m - r["q1_ms"] for m, r in zip(med, rows)], [r["q3_ms"] - m for m, r in zip(med, rows)]]
    colors = ["C7" if n == "plain" else ("C0" if n.endswith(f" 1/{report['batch']}") else "C1") for n in names]
    ax.barh(names, med, xerr=err, color=colors)
    ax.axvline(med[0], color="gray", lw=0.8, ls="--")
    ax.invert_yaxis()
    ax.set(xlabel="decode step (ms), median and quartiles",
           title=f"batch {report['batch']}: one row asking (blue) or all (orange)")
    fig.tight_layout()
    return fig


def run_from_args(args, out: Path) -> Path:
    if args.rounds < 1 or args.steps < 1:
        raise UsageError("--rounds and --steps must be at least 1")
    model, source = load_weights(args.preset, default_device())
    report = step_costs(model, rounds=args.rounds, steps=args.steps, progress=lambda s: print(s, flush=True))
    report |= {"preset": args.preset, "weights": source}
    print(table(report))
    pyplot()  # Agg before the figure: it goes to a file
    return save_report(report, out / f"extras-{args.preset}.json", lambda r, png: save_figure(figure(r), png))


def add_arguments(p) -> None:
    add_options(p, "--preset", preset="cpu")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (median and quartiles)")
    p.add_argument("--steps", type=int, default=2, help="decode steps timed per variant per round")
    add_options(p, "--out")
