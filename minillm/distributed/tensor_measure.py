"""Checking and timing tensor parallelism on this machine: the functions chapter 17 calls."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from minillm.engine.llm import LLM
from minillm.decoding.generate import ContiguousKVCache, generate_kv_cache
from minillm.machine.hardware import Timing
from minillm.model.gpt import GPT
from minillm.distributed.tensor import AllReduce, check_tensor_parallel_size
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


def prompt_ids(prompts: list[str] | list[list[int]]) -> list[list[int]]:
    """Each prompt as token ids: a string is encoded, a list of ids taken as it is."""
    tokenizer = get_tokenizer()
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def max_logit_diff(split, model: GPT, ids: list[list[int]]) -> float:
    """The largest difference between the logits of ``split`` and ``model``, one full forward
    over each prompt."""
    with torch.inference_mode():
        xs = [torch.tensor([p], device=model.device) for p in ids]
        return max((split(x).float() - model(x).float()).abs().max().item() for x in xs)


def check_equivalence(
    model: GPT, prompts: list[str] | list[list[int]], world_size: int = 2, max_new_tokens: int = 20
) -> Equivalence:
    """Split ``model`` over ``world_size`` processes (gloo on CPU) and compare: the logits of a
    full forward over each prompt, then greedy generation through the contiguous KV cache and
    through the paged engine, all against the unsplit model's greedy tokens."""
    ids = prompt_ids(prompts)
    reference = [generate_kv_cache(model.eval(), p, max_new_tokens) for p in ids]
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    blocks = sum((len(p) + max_new_tokens) // 16 + 1 for p in ids)  # all fit at once
    with LLM(model, tensor_parallel_size=world_size, num_blocks=blocks) as llm:
        engine = [o.token_ids for o in llm.generate(ids, params, use_tqdm=False)]
        tp = llm.engine.model
        parallel = [generate_kv_cache(tp, p, max_new_tokens) for p in ids]
        diff = max_logit_diff(tp, model, ids)
    return Equivalence(world_size, diff, reference, parallel, engine)


# ----------------------------------------------------------------------------- timing


def _time_decode(
    model: GPT | TensorParallelGPT, batch: int, context: int, steps: int
) -> tuple[float, float, float, float]:
    """Median seconds of one greedy decode step of ``batch`` sequences ``context`` tokens
    long, the median of those seconds spent in all-reduces (0 for an unsplit model), and the
    first and third quartiles of the step's seconds (the spread over the ``steps``)."""
    allreduce = model.local.allreduce if isinstance(model, TensorParallelGPT) else AllReduce(None)  # counts 0
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=generator)
    cache = ContiguousKVCache(model, batch, context + steps)  # type: ignore[arg-type]
    step_s, reduce_s = [], []
    with torch.inference_mode():
        token = model.logits(model.hidden_states(prompt, cache=cache)[:, -1]).argmax(-1, keepdim=True)
        for _ in range(steps):
            positions = torch.full((batch, 1), cache.length)
            before, start = allreduce.seconds, time.perf_counter()
            token = model.logits(model.hidden_states(token, positions, cache)[:, -1]).argmax(-1, keepdim=True)
            step_s.append(time.perf_counter() - start)
            reduce_s.append(allreduce.seconds - before)
    step = Timing.of(step_s)
    return step.median, statistics.median(reduce_s), step.q1, step.q3


def measure_decode_step(
    model: GPT,
    world_size: int = 2,
    batches: tuple[int, ...] = (1, 8),
    context: int = 128,
    steps: int = 20,
    threads: int = 1,
) -> list[dict]:
    """Time one decode step, split over ``world_size`` CPU processes (gloo, this one rank 0)
    of ``threads`` threads each, against the unsplit model on ``world_size * threads``
    threads, for each batch size; ``context`` tokens are prefilled first. One row per batch
    size, medians in milliseconds: ``single_ms``, ``tp_ms`` and its parts ``allreduce_ms`` and
    ``compute_ms`` (rank 0's view, as the engine runs it: rank 0 first sends each step to the
    workers, so their wait for that message and for a slower rank counts as all-reduce time),
    ``allreduce_share``, ``allreduces_per_step`` (``2 * n_layers``) and ``allreduce_us_each``,
    with the spread of the steps: ``single_q1_ms`` / ``single_q3_ms`` and ``tp_q1_ms`` /
    ``tp_q3_ms``. On a shared CPU the split cannot be faster than one process using the same
    cores: it does the same arithmetic, plus the all-reduces."""
    check_tensor_parallel_size(model.cfg, world_size)
    if context + steps > model.cfg.context_length:
        limit = model.cfg.context_length
        raise ValueError(f"context + steps ({context + steps}) exceeds the model's {limit} positions")
    whole = GPT(model.cfg).eval()  # float32 on the CPU, whatever ``model`` is
    whole.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads * world_size)
        single = [_time_decode(whole, b, context, steps) for b in batches]
        torch.set_num_threads(threads)
        with TensorParallelGPT(whole, world_size, threads=threads) as tp:
            split = [_time_decode(tp, b, context, steps) for b in batches]
    finally:
        torch.set_num_threads(previous)
    calls = 2 * model.cfg.n_layers
    rows = []
    for b, (one, _, one_q1, one_q3), (step, reduce, q1, q3) in zip(batches, single, split):
        rows.append({"batch": b, "single_ms": 1e3 * one, "tp_ms": 1e3 * step, "allreduce_ms": 1e3 * reduce,
                     "compute_ms": 1e3 * (step - reduce), "allreduce_share": reduce / step,
                     "allreduces_per_step": calls, "allreduce_us_each": 1e6 * reduce / calls,
                     "single_q1_ms": 1e3 * one_q1, "single_q3_ms": 1e3 * one_q3,
                     "tp_q1_ms": 1e3 * q1, "tp_q3_ms": 1e3 * q3})
    return rows
