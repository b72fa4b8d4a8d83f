"""The decode benchmark: ``python -m minillm.bench decode``.

``B`` sequences of ``PROMPT_LEN`` prompt tokens each decode ``NEW_TOKENS`` tokens together;
the rate is ``B x (tokens decoded)`` over the decode steps' time (prefill excluded), for
``B`` in 1, 8, 32, 64, on the same weights, in one run: our engine three ways (the plain
reference, ``enforce_eager=True``; eager with weights prepacked for oneDNN,
:mod:`minillm.speedups.packed`, a CPU's default; captured, :mod:`minillm.speedups.decode_graphs`:
Inductor on a CPU, CUDA graphs on a GPU), ``transformers`` ``generate`` and, when
``make llamacpp`` has built it, llama.cpp on the GGUF of the same weights. On a CPU the packed
engine also runs without the small-batch kernel (:mod:`minillm.speedups.gemv`), on the
library's roads alone: what the kernel adds, measured side by side. With ``--int8`` the same
weights, quantized to int8 with a scale per row (chapter 13), run through the kernel's int8
products (fp32 activations) against llama.cpp's ``q8_0`` GGUF of them.

Each rate is also given as a fraction of the roof: a step cannot beat reading every weight
once and each sequence's cached keys and values (those bytes over the bandwidth measured at the
weights' working-set size) nor doing its FLOPs at the measured matmul rate. Ratios are what to quote: the machine's absolute speed
moves from run to run, the ratios measured side by side much less.
"""

from __future__ import annotations

import copy
import gc
import statistics
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch

from minillm.bench import llamacpp, pyplot, save_figure, save_report
from minillm.bench.engine import as_transformers, prefilled
from minillm.engine.config import EngineConfig
from minillm.engine.build import build_engine
from minillm.machine.hardware import measure_bandwidth, measure_matmul_flops
from minillm.machine.roofline import decode_step_cost
from minillm.model.gpt import GPT, matmul_parameters
from minillm.decoding.sampling import SamplingParams
from minillm.speedups import gemv, packed
from minillm.speedups.quant import cast_and_quantize, model_bytes

PROMPT_LEN = 16
NEW_TOKENS = 128
BATCHES = (1, 8, 32, 64)
ENGINES = {  # method -> EngineConfig options
    "ours, captured": dict(enforce_eager=False),
    "ours, eager + packed weights": dict(enforce_eager=None, pack_weights=True),
    "ours, plain eager": dict(enforce_eager=True),
}
# The packed and captured engines on a CPU without the small-batch kernel (not an EngineConfig
# option: the benchmark hides the kernel while it builds the engine), beside the engine each
# would otherwise be
LIBRARY_ROADS = {"ours, packed, library roads": dict(enforce_eager=None, pack_weights=True),
                 "ours, captured, library products": dict(enforce_eager=False)}
WITH_KERNEL = {"ours, packed, library roads": "ours, eager + packed weights",
               "ours, captured, library products": "ours, captured"}
# An int8 model keeps its own products (QuantLinear): no packing, captured or not
INT8_ENGINES = {"ours, captured": dict(enforce_eager=False), "ours, eager (the default)": dict(enforce_eager=None)}


@contextmanager
def without_small_kernel():
    """Products as they were before the small-batch kernel: packing does not time its road, so
    never takes it, and a compiled step leaves its products to Inductor. The roads timed
    meanwhile are forgotten afterwards."""
    saved = dict(packed._TIMINGS)
    packed._TIMINGS.clear()
    try:
        with mock.patch.object(gemv, "supports", lambda weight: False):
            yield
    finally:
        packed._TIMINGS.clear()
        packed._TIMINGS.update(saved)


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` different prompts (a shared one would be a prefix-cache hit for all but one)."""
    return [[(97 * i + 13 * j) % (vocab - 1) + 1 for j in range(PROMPT_LEN)] for i in range(batch)]


@torch.inference_mode()
def engine_rate(model: GPT, batch: int, new_tokens: int, small_kernel: bool = True, **options) -> tuple[float, float]:
    """Our engine's decode tokens/s at ``batch`` (and its start-up seconds: weight packing and
    compiling or recording the bucket). Every prompt is prefilled before the clock starts."""
    gc.collect()  # an earlier engine's packed copies, and the roads they took, go now: this one has its own
    start = time.perf_counter()
    with nullcontext() if small_kernel else without_small_kernel():
        engine = build_engine(model, EngineConfig(max_num_seqs=batch, kv_cache_memory="1GiB", **options))
    if engine.graphs is not None:
        engine.graphs.prepare([engine.graphs.bucket(batch)])
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    prefilled(engine, prompts(batch, model.cfg.vocab_size), params)
    decoded = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        decoded += sum(len(out.new_token_ids) for out in engine.step())
    rate = decoded / (time.perf_counter() - start)
    if engine.graphs is not None:
        # Dynamo keeps every compiled program for the life of the process, the engine gone or
        # not: on the 51M shape a captured CPU engine left 1.25 GB behind, and a sweep of seven
        # batch sizes in three rounds outgrew 24 GiB. Dropped, about 0.2 GB stays per engine.
        del engine
        torch._dynamo.reset()
    return rate, startup


@torch.inference_mode()
def hf_rate(hf, batch: int, new_tokens: int, vocab: int) -> float:
    """``transformers`` decode tokens/s at ``batch``: (time for ``new_tokens``) minus (time for one)."""
    ids = torch.tensor(prompts(batch, vocab), device=hf.device)

    def seconds(n: int) -> float:
        start = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=vocab - 1)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    return batch * (new_tokens - 1) / (seconds(new_tokens) - seconds(1))


def llamacpp_rates(model: GPT, batches: list[int], new_tokens: int, dtype: str) -> dict | None:
    """llama.cpp's decode tokens/s on the GGUF of ``model`` (``dtype``: f32, bf16 or q8_0), or
    None when its programs are not built. ``llama-batched-bench`` crashed (SIGSEGV) on q8_0
    weights repacked for this CPU's int8 instructions, so its batches read q8_0 as stored;
    ``llama-bench``'s batch 1 repacks."""
    if not llamacpp.available():
        return None
    from minillm.export.gguf import export_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = export_gguf(model, Path(tmp) / "model.gguf", dtype)
        rates = {"llama-bench": {1: llamacpp.llama_bench_tg(path, new_tokens)}}
        rates["llama-batched-bench"] = llamacpp.batched_bench_tg(path, batches, n_prompt=PROMPT_LEN, n_gen=new_tokens,
                                                                 repack=dtype != "q8_0")
    return rates


def roof(model: GPT, batch: int, bandwidth: float, flops: float, context: int) -> float:
    """The most decode tokens/s a step of ``batch`` could reach: the slower of reading what the
    step must read (every weight once, as stored: int8 weights are a byte each; and each
    sequence's keys and values over ``context`` tokens, in the model's dtype) and doing ``2 x
    matmul weights`` FLOPs per token. The cache's bytes grow with the batch, which is why the
    roof's step time is not flat all the way to the ridge."""
    cache = decode_step_cost(model.cfg, batch, context, weight_bytes=0, kv_bytes=model.dtype.itemsize).kv_bytes
    return min(batch * bandwidth / (model_bytes(model) + cache), flops / (2 * matmul_parameters(model.cfg)))


def mean_context(new_tokens: int) -> int:
    """The context a decode step sees on average while ``new_tokens`` follow the prompt."""
    return PROMPT_LEN + new_tokens // 2


def run_decode_bench(model: GPT, batches: list[int], new_tokens: int, with_hf: bool = True,
                     with_llamacpp: bool = True, repeats: int = 3, engines: dict[str, dict] | None = None,
                     int8: bool = False) -> dict:
    """Every method at every batch size, as ``{"rates": {method: {batch: [tok/s, ...]}}, ...}``.
    ``engines`` (default: ``ENGINES``) names our engine's configurations to run: on a GPU,
    weight packing (a CPU's oneDNN) does not apply. ``int8`` quantizes a copy of the (fp32)
    model to int8 and runs :data:`INT8_ENGINES` on it against llama.cpp's q8_0 GGUF of the
    float weights, without ``transformers``.

    The ``repeats`` rounds are interleaved: each round runs every method once, so a machine
    that speeds up or slows down during the run (other jobs, heat) moves all of them alike,
    and the medians compare methods measured side by side."""
    exported = model
    if int8:
        model, with_hf = cast_and_quantize(copy.deepcopy(model), torch.float32, "int8"), False
    weight_bytes = model_bytes(model)
    bandwidth = measure_bandwidth(model.device, "reduce", nbytes=weight_bytes)
    flops = measure_matmul_flops(model.device, model.dtype)
    report = {"bandwidth": bandwidth, "matmul_flops": flops, "weight_bytes": weight_bytes,
              "roof_context": mean_context(new_tokens),
              "roof": {b: roof(model, b, bandwidth, flops, mean_context(new_tokens)) for b in batches},
              "rates": {}, "startup_s": {}}
    rates, startups = report["rates"], report["startup_s"]
    hf = as_transformers(model) if with_hf else None
    llama_dtype = "q8_0" if int8 else "f32" if model.dtype == torch.float32 else "bf16"
    if engines is None:
        engines = INT8_ENGINES if int8 else ENGINES | (LIBRARY_ROADS if model.device.type == "cpu" else {})
    for round_ in range(repeats):
        for b in batches:
            for method, options in engines.items():
                rate, startup = engine_rate(model, b, new_tokens, small_kernel=method not in LIBRARY_ROADS, **options)
                rates.setdefault(method, {}).setdefault(b, []).append(rate)
                startups.setdefault(method, {}).setdefault(b, []).append(startup)
                print(f"  round {round_ + 1}: {method:<30} batch {b:>3}: {rate:8.1f} tok/s", flush=True)
            if hf is not None:
                rates.setdefault("transformers generate", {}).setdefault(b, []).append(
                    hf_rate(hf, b, new_tokens, model.cfg.vocab_size))
        llama = llamacpp_rates(exported, batches, new_tokens, llama_dtype) if with_llamacpp else None
        for name, by_batch in (llama or {}).items():
            for b, rate in by_batch.items():
                rates.setdefault(f"llama.cpp ({name})", {}).setdefault(b, []).append(rate)
    return report


def summary(report: dict) -> list[str]:
    """The table's lines: median tok/s [lowest-highest of the rounds] (fraction of roof), and
    the ratios the targets are stated in, for our captured and packed-eager engines."""
    rates, lines = report["rates"], []
    median = {m: {b: statistics.median(v) for b, v in r.items()} for m, r in rates.items()}
    for method, by_batch in median.items():
        cells = [f"{by_batch[b]:8.1f} [{min(rates[method][b]):.0f}-{max(rates[method][b]):.0f}] "
                 f"({by_batch[b] / report['roof'][b]:3.0%})" for b in by_batch]
        lines.append(f"  {method:<34}" + "".join(cells))
    for ours in [m for m in ("ours, captured", "ours, eager + packed weights", "ours, eager (the default)")
                 if m in median]:
        for other in [m for m in median if m.startswith(("llama.cpp", "transformers"))]:
            ratios = ", ".join(f"batch {b} {median[ours][b] / r:.2f}x" for b, r in median[other].items())
            lines.append(f"  {ours.removeprefix('ours, ')} vs {other}: {ratios}")
    for method, by_batch in median.items():  # the thesis's own measure: how much longer a bigger batch's step takes
        if 1 in by_batch and len(by_batch) > 1:
            steps = ", ".join(f"batch {b} {step_ratio(by_batch, b):.2f}" for b in by_batch if b != 1)
            lines.append(f"  step(B)/step(1), {method}: {steps}")
    for library, default in WITH_KERNEL.items():
        if default in median and library in median:
            ratios = ", ".join(f"batch {b} {median[default][b] / r:.2f}x" for b, r in median[library].items())
            lines.append(f"  {default.removeprefix('ours, ')} with the small-batch kernel vs "
                         f"{library.removeprefix('ours, ')}: {ratios}")
    return lines


def step_ratio(rates: dict[int, float], batch: int) -> float:
    """How many times batch 1's step a step of ``batch`` sequences takes, from decode tokens/s
    (a step makes one token per sequence): 1.0 is a batch for free, ``batch`` no gain at all."""
    return batch * rates[1] / rates[batch]


def save(report: dict, out: Path) -> Path:
    """``decode-<preset>.json`` and a plot of tokens/s against batch size, one panel per dtype."""
    return save_report(report, out / f"decode-{report['preset']}.json", plot)


def plot(report: dict, path: Path) -> None:
    """Per dtype, two panels: tokens/s against the roof, and each step's time as a multiple of
    batch 1's (the roof's is 1.0 up to the ridge: a batch for free)."""
    plt = pyplot()
    runs = report["runs"]
    cols = max(len(runs), 1)
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 7.5), squeeze=False)
    for col, (dtype, run_) in enumerate(runs.items()):
        rate_ax, step_ax = axes[0][col], axes[1][col]
        roof_ = {int(b): v for b, v in run_["roof"].items()}  # a report read back from JSON has text keys
        batches = sorted(roof_)
        rate_ax.plot(batches, [roof_[b] for b in batches], "k--", label="roof (weights and KV cache read, or FLOPs)")
        if 1 in roof_:
            step_ax.plot(batches, [step_ratio(roof_, b) for b in batches], "k--", label="roof")
        for method, by_batch in run_["rates"].items():
            medians = {int(b): statistics.median(v) for b, v in by_batch.items()}
            xs = sorted(medians)
            rate_ax.plot(xs, [medians[b] for b in xs], "o-", label=method)
            if 1 in medians:
                step_ax.plot(xs, [step_ratio(medians, b) for b in xs], "o-", label=method)
        rate_ax.set(xscale="log", yscale="log", ylabel="decode tokens/s", title=f"{report['preset']}, {dtype}")
        step_ax.set(xscale="log", yscale="log", xlabel="batch (sequences decoding together)",
                    ylabel="step time / batch 1's")
        for ax in (rate_ax, step_ax):
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.legend(fontsize=7)
    fig.suptitle(f"{report['device']}, {report['threads']} threads", fontsize=9)
    save_figure(fig, path)
