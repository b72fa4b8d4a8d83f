"""Checking and timing tensor parallelism on this machine: the functions chapter 16 calls.

:func:`check_equivalence` splits a model over worker processes and compares it with itself
unsplit: logits, then greedy tokens through both KV caches. :func:`measure_decode_step`
times a decode step split over CPU processes, and the part of it spent in all-reduces.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from minillm.model.config import ModelConfig
from minillm.engine.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.decoding.generate import ContiguousKVCache, generate_kv_cache
from minillm.machine.hardware import Timing
from minillm.model.gpt import GPT
from minillm.distributed.tensor import ShardedGPT, check_tensor_parallel_size, make_group, rendezvous, shard_state_dict
from minillm.distributed.tensor_workers import TensorParallelGPT
from minillm.decoding.sampling import SamplingParams
from minillm.data.tokenizer import get_tokenizer


# ----------------------------------------------------------------------------- checks


@dataclass
class Equivalence:
    """Tensor-parallel model vs the one-process model it was split from, same prompts."""

    world_size: int
    max_abs_logit_diff: float  # over every position of every prompt, one full forward each
    reference_tokens: list[list[int]]  # greedy, generate_kv_cache on the whole model
    parallel_tokens: list[list[int]]  # greedy, generate_kv_cache driving the ranks
    engine_tokens: list[list[int]]  # greedy, the paged engine (LLMEngine) driving the ranks

    @property
    def tokens_identical(self) -> bool:
        return self.reference_tokens == self.parallel_tokens == self.engine_tokens


def check_equivalence(
    model: GPT, prompts: list[str] | list[list[int]], world_size: int = 2, max_new_tokens: int = 20
) -> Equivalence:
    """Split ``model`` over ``world_size`` processes (gloo on CPU) and compare: the logits of a
    full forward over each prompt, then greedy generation through the contiguous KV cache and
    through the paged engine, all against the unsplit model's greedy tokens."""
    tokenizer = get_tokenizer()
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    device = model.device
    model.eval()
    with TensorParallelGPT(model, world_size) as tp, torch.inference_mode():
        diff = 0.0
        for prompt in ids:
            x = torch.tensor([prompt], device=device)
            diff = max(diff, (tp(x).float() - model(x).float()).abs().max().item())
        reference = [generate_kv_cache(model, p, max_new_tokens) for p in ids]
        parallel = [generate_kv_cache(tp, p, max_new_tokens) for p in ids]
        blocks = sum((len(p) + max_new_tokens) // 16 + 1 for p in ids)  # all fit at once
        config = EngineConfig(num_blocks=blocks, tensor_parallel_size=world_size)
        engine = LLMEngine(tp, config, tokenizer)  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(ids)]
        while engine.has_unfinished:
            engine.step()
    return Equivalence(world_size, diff, reference, parallel, [s.output_ids for s in seqs])


# ----------------------------------------------------------------------------- timing


def _time_decode(
    model: GPT | ShardedGPT, batch: int, context: int, steps: int
) -> tuple[float, float, float, float]:
    """Median seconds of one greedy decode step of ``batch`` sequences ``context`` tokens
    long, the median of those seconds spent in all-reduces (0 for an unsplit model), and the
    first and third quartiles of the step's seconds (the spread over the ``steps``)."""
    allreduce = getattr(model, "allreduce", None)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=generator)
    cache = ContiguousKVCache(model, batch, context + steps)  # type: ignore[arg-type]
    step_s, reduce_s = [], []
    with torch.inference_mode():
        token = model.logits(model.hidden_states(prompt, cache=cache)[:, -1]).argmax(-1, keepdim=True)
        for _ in range(steps):
            positions = torch.full((batch, 1), cache.length)
            before, start = allreduce.seconds if allreduce else 0.0, time.perf_counter()
            token = model.logits(model.hidden_states(token, positions, cache)[:, -1]).argmax(-1, keepdim=True)
            step_s.append(time.perf_counter() - start)
            reduce_s.append((allreduce.seconds if allreduce else 0.0) - before)
    step = Timing.of(step_s)
    return step.median, statistics.median(reduce_s), step.q1, step.q3


def _measure_rank(rank: int, world_size: int, port: int, cfg: ModelConfig, state: dict, batches: list[int],
                  context: int, steps: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    group, _store = make_group("gloo", rank, world_size, port)
    shard = ShardedGPT(cfg, rank, world_size, group).eval()
    shard.load_state_dict(shard_state_dict(state, cfg, rank, world_size))
    timings = [_time_decode(shard, b, context, steps) for b in batches]
    if rank == 0:
        results.put(timings)


def measure_decode_step(
    model: GPT,
    world_size: int = 2,
    batches: tuple[int, ...] = (1, 8),
    context: int = 128,
    steps: int = 20,
    threads: int = 1,
) -> list[dict]:
    """Time one decode step, split over ``world_size`` CPU processes (gloo) of ``threads``
    threads each, against the unsplit model on ``world_size * threads`` threads, for each
    batch size; ``context`` tokens are prefilled first. One row per batch size, medians in
    milliseconds: ``single_ms``, ``tp_ms`` and its parts ``allreduce_ms`` and ``compute_ms``
    (rank 0's view: waiting for a slower rank counts as all-reduce time), ``allreduce_share``,
    ``allreduces_per_step`` (``2 * n_layers``) and ``allreduce_us_each``, with the spread of
    the steps: ``single_q1_ms`` / ``single_q3_ms`` and ``tp_q1_ms`` / ``tp_q3_ms``. On a shared CPU the split cannot be faster than one process using
    the same cores: it does the same arithmetic, plus the all-reduces."""
    check_tensor_parallel_size(model.cfg, world_size)
    if context + steps > model.cfg.context_length:
        limit = model.cfg.context_length
        raise ValueError(f"context + steps ({context + steps}) exceeds the model's {limit} positions")
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    single = _time_unsplit(model.cfg, state, batches, context, steps, threads * world_size)
    store = rendezvous(world_size)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _measure_rank,
        args=(world_size, store.port, model.cfg, state, list(batches), context, steps, threads, results),
        nprocs=world_size,
        start_method="spawn",
    )
    calls = 2 * model.cfg.n_layers
    rows = []
    for b, (one, _, one_q1, one_q3), (step, reduce, q1, q3) in zip(batches, single, results.get()):
        rows.append({"batch": b, "single_ms": 1e3 * one, "tp_ms": 1e3 * step, "allreduce_ms": 1e3 * reduce,
                     "compute_ms": 1e3 * (step - reduce), "allreduce_share": reduce / step,
                     "allreduces_per_step": calls, "allreduce_us_each": 1e6 * reduce / calls,
                     "single_q1_ms": 1e3 * one_q1, "single_q3_ms": 1e3 * one_q3,
                     "tp_q1_ms": 1e3 * q1, "tp_q3_ms": 1e3 * q3})
    return rows


def _time_unsplit(
    cfg: ModelConfig, state: dict, batches: tuple[int, ...], context: int, steps: int, threads: int
) -> list[tuple[float, float, float, float]]:
    """The baseline, in this process: the whole model, float32 on the CPU, on ``threads`` threads."""
    model = GPT(cfg).eval()
    model.load_state_dict(state)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [_time_decode(model, b, context, steps) for b in batches]
    finally:
        torch.set_num_threads(previous)
