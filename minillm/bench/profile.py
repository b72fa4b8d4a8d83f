"""Where a decode step's time goes: ``python -m minillm.bench profile``.

A decode step at batch ``B`` reads every weight once and multiplies it by ``B`` vectors. If
that were all it did, its time would be the weights' bytes over the memory bandwidth. This
profile says how far from that the engine is, and why, in two views of the same steps:

- **phases**, timed from outside the engine's methods: scheduling, building the step's
  tensors, the forward pass, the LM head, sampling, and the bookkeeping after (appending
  tokens, detokenizing, freeing blocks); what is left over is Python between them;
- **operators**, from ``torch.profiler`` over as many further steps: the share of their time
  inside matrix products, attention's gathers and copies, elementwise operators (LayerNorm,
  GELU, adds), and the rest. The profiler slows every operator a little, so these are shares,
  not times.

It runs the engine the three ways the decode benchmark does (:data:`minillm.bench.decode.ENGINES`):
the plain reference, eager with packed weights, and captured
(:mod:`minillm.speedups.decode_graphs`), whose forward and LM head are one program.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from typing import Callable, Iterator
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from minillm.bench.decode import ENGINES, prompts
from minillm.bench.engine import prefilled
from minillm.engine import model_runner
from minillm.engine.config import EngineConfig
from minillm.engine.build import build_engine
from minillm.engine.llm_engine import LLMEngine
from minillm.machine.hardware import Timing, time_repeats
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams

OPERATOR_KINDS = {
    "matrix products": ("mm", "addmm", "bmm", "linear", "matmul", "baddbmm", "_weight_int8pack_mm",
                        "_weight_int4pack_mm", "mkldnn", "mkl_linear", "_linear_pointwise", "packed_linear",
                        "small_linear"),
    "attention": ("scaled_dot_product", "_flash_attention", "index_select", "index_copy", "padded_decode_attention",
                  "softmax"),
    "elementwise": ("layer_norm", "gelu", "add", "mul", "div", "tanh", "where", "masked_fill", "cpp_fused",
                    "triton_", "argmax", "embedding"),
}


def operator_kind(name: str) -> str:
    """Which of :data:`OPERATOR_KINDS` an operator's name belongs to, else ``"other"``."""
    short = name.split("::")[-1]
    for kind, prefixes in OPERATOR_KINDS.items():
        if any(short.startswith(p) for p in prefixes):
            return kind
    return "other"


@contextlib.contextmanager
def quiet_profile(**options) -> Iterator[profile]:
    """``torch.profiler.profile(**options)`` without the lines its C++ side writes to the
    process's standard error when it starts and stops (``profiler_start``, ``profiler_stop``):
    no setting turns them off, and in a notebook they land in the cell's output. Only the
    operating system's error stream is silenced, and only while the profiler starts and
    stops; Python's warnings and errors still show."""
    prof = profile(**options)
    with _no_native_stderr():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _no_native_stderr():
            prof.__exit__(*sys.exc_info())


@contextlib.contextmanager
def _no_native_stderr() -> Iterator[None]:
    """File descriptor 2 pointed at the null device, then put back."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _timed(seconds: dict[str, float], phase: str, fn: Callable) -> Callable:
    """``fn``, adding the wall time spent inside it to ``seconds[phase]``."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[phase] += time.perf_counter() - start

    return timed


def instrument_phases(engine: LLMEngine, seconds: dict[str, float]) -> Callable[[], None]:
    """Time the engine's phases into ``seconds``; returns the function that unwraps them."""
    runner, model, graphs = engine.runner, engine.runner.model, engine.graphs
    patches = [
        (engine.scheduler, "schedule", "schedule"), (engine.scheduler, "postprocess", "bookkeeping"),
        (engine, "_append", "bookkeeping"), (runner, "prepare", "step tensors"),
        (model_runner, "process_", "sampling"), (model_runner, "sample", "sampling"), (runner, "read", "read back"),
    ]
    if graphs is None:
        patches += [(model, "hidden_states", "forward"), (model, "logits", "LM head")]
    else:  # the model's methods are inside the compiled program: wrapping them would recompile it
        patches += [(graphs, "fill", "step tensors"),
                    (graphs, "program", "forward + LM head")]
    patched = contextlib.ExitStack()
    for obj, name, phase in patches:
        fn = getattr(obj, name)
        if name == "program":  # time the program's run, not its lookup
            wrapped = lambda b, fn=fn, phase=phase: _timed(seconds, phase, fn(b))  # noqa: E731
        else:
            wrapped = _timed(seconds, phase, fn)
        patched.enter_context(mock.patch.object(obj, name, wrapped))
    return patched.close


def decoding_engine(model: GPT, batch: int, options: dict, max_tokens: int, **config) -> LLMEngine:
    """An engine built with ``options`` (an :data:`ENGINES` entry), holding ``batch`` greedy
    sequences past their prefill, with its captured bucket for them ready: every step after is
    a decode step of that batch."""
    engine = build_engine(model, EngineConfig(max_num_seqs=batch, **(dict(kv_cache_memory="512MiB") | config | options)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prefilled(engine, prompts(batch, model.cfg.vocab_size), params)
    if engine.graphs is not None:
        engine.graphs.prepare([engine.graphs.bucket(batch)])
    return engine


def phase_times(engine: LLMEngine, steps: int) -> tuple[Timing, dict[str, float]]:
    """``steps`` steps timed one by one (after three warm-up steps), then as many again with
    their phases timed: seconds per step in each phase, the Python between them included."""
    wall = time_repeats(engine.step, engine.model.device, steps, warmup=3)
    seconds: dict[str, float] = defaultdict(float)
    restore = instrument_phases(engine, seconds)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        timed = time.perf_counter() - start
    finally:
        restore()
    phases = dict(seconds) | {"other Python": max(timed - sum(seconds.values()), 0.0)}
    return wall, {k: v / steps for k, v in phases.items()}


@torch.inference_mode()
def profile_decode(model: GPT, batch: int, method: str, steps: int = 10) -> dict:
    """Profile ``steps`` decode steps of ``batch`` sequences run the way ``method`` (an
    :data:`ENGINES` name) says: step time, phases, operators."""
    # serial steps: the phases of an overlapped one run on two threads at once
    engine = decoding_engine(model, batch, ENGINES[method] | {"async_scheduling": False}, 3 * steps + 8)
    wall, phases = phase_times(engine, steps)
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = time.perf_counter() - start
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::", "minillm::", "quantized::")) or "cpp_fused" in event.key:
            kinds[operator_kind(event.key)] += event.self_cpu_time_total / 1e6
    step = sum(phases.values())
    return {
        "batch": batch, "method": method,
        "step_ms": wall.median * 1e3, "step_ms_quartiles": [wall.q1 * 1e3, wall.q3 * 1e3],
        "tokens_per_s": batch / wall.median,
        "phases": {k: v / step for k, v in phases.items()},
        "operators": {k: v / profiled for k, v in sorted(kinds.items())},
    }


def print_profile(row: dict) -> None:
    head = f"  batch {row['batch']:>3} {row['method']:<30} step {row['step_ms']:7.2f} ms  {row['tokens_per_s']:8.1f} tok/s"
    print(head)
    print("      phases:    " + ", ".join(f"{k} {v:.0%}" for k, v in row["phases"].items() if v >= 0.005))
    print("      operators: " + ", ".join(f"{k} {v:.0%}" for k, v in row["operators"].items() if v >= 0.005))
