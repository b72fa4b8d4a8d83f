"""One memory budget for the whole engine: measure what the model needs, give the cache the rest.

``memory_budget`` (``--memory-budget 6GiB``) is the whole process's memory, where
``kv_cache_memory`` sizes the cache alone and leaves the user to guess the rest. At start-up
the engine measures what is resident and what its largest step needs on top, by running that
step, as vLLM profiles before it sizes its cache (:func:`measure`, then :func:`plan`).

- **CPU**: the resident set (``VmRSS``: what ``top``, a container's limit and the OOM killer
  count), interpreter and libraries included (about 280 MB before any model), since that is
  the figure a budget can promise; the test holds a child process's ``ru_maxrss`` under it.
- **CUDA**: the device's memory in use (``total - free``), the CUDA context and other
  processes included (as ``runtime``); the caching allocator's fragmentation is not counted
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` keeps it small).
- **Tensor parallelism**: the budget is per rank, measured on rank 0, whose share is the
  largest (it alone samples and runs the engine); every rank's pool has as many blocks.

A budget whose pool cannot hold one sequence of full context is refused
(:class:`MemoryBudgetError`: what does not fit and by how much).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from minillm.model.config import ModelConfig
from minillm.engine.kv_cache import AttentionKernels, PagedKVPool, kv_bytes_per_token
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.sequence import Sequence
from minillm.model.gpt import GPT
from minillm.decoding.sampling import SamplingParams, request_seed
from minillm.sizes import parse_memory

_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"

# glibc's malloc raises its mmap threshold to each large block it frees (up to 32 MiB) and
# trims its heap only when twice that lies free at the top, so the resident set may sit up to
# 2 x 32 MiB above what is live (and never above twice the step's peak): set aside on a CPU as
# ``allocator``. Runs of the test batch came out 3-31 MB above the measured peak without it.
CPU_HEAP_SLACK = 64 * 2**20


class MemoryBudgetError(ValueError):
    """A ``memory_budget`` that cannot be honoured: too small, or not measurable here."""


def mib(n: int) -> str:
    """``48234496`` -> ``"46.0 MiB"``; from 1 GiB up in GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def full_context_sequences(blocks: int, block_size: int, context_length: int) -> int:
    """How many sequences of ``context_length`` tokens ``blocks`` blocks hold at once."""
    return blocks // -(-context_length // block_size)


def describe_cache(kv_bytes: int, blocks: int, block_size: int, context_length: int) -> str:
    """``KV cache 53.7 MiB (572 blocks of 16 tokens: 35 sequences of full context, 256 tokens)``."""
    n = full_context_sequences(blocks, block_size, context_length)
    return (f"KV cache {mib(kv_bytes)} ({blocks:,} blocks of {block_size} tokens: {n:,} sequences of full context, "
            f"{context_length} tokens)")


@dataclass(frozen=True)
class MemorySplit:
    """How a budget is shared out, in bytes: ``runtime`` (what is resident besides the weights:
    interpreter, libraries, a draft model, the CUDA context), ``activations`` (the largest
    step's measured peak), ``allocator`` (:data:`CPU_HEAP_SLACK`), ``graphs`` (captured decode
    programs) and ``kv_cache``, the pool with its pad block, ``(blocks + 1) * block_bytes``."""

    budget: int
    runtime: int
    weights: int
    activations: int
    allocator: int
    graphs: int
    kv_cache: int
    blocks: int
    block_bytes: int
    block_size: int
    context_length: int

    @property
    def full_context_sequences(self) -> int:
        """How many sequences of ``context_length`` tokens the pool holds at once."""
        return full_context_sequences(self.blocks, self.block_size, self.context_length)

    @property
    def unused(self) -> int:
        """The budget's bytes no part takes: less than two blocks."""
        return self.budget - (self.runtime + self.weights + self.activations + self.allocator + self.graphs
                              + self.kv_cache)

    def parts(self) -> dict[str, int]:
        """The budget and its parts by name, as ``/metrics`` labels them."""
        return {"budget": self.budget, "runtime": self.runtime, "weights": self.weights,
                "activations_peak": self.activations, "allocator": self.allocator, "graphs": self.graphs,
                "kv_cache": self.kv_cache}

    def describe(self) -> str:
        """The banner's line: ``memory budget 512.0 MiB = runtime ... + KV cache ... (N blocks ...)``."""
        return (
            f"memory budget {mib(self.budget)} = runtime {mib(self.runtime)} + weights {mib(self.weights)} + "
            f"activations peak {mib(self.activations)}{_optional_parts(' + ', self.allocator, self.graphs)} + "
            + describe_cache(self.kv_cache, self.blocks, self.block_size, self.context_length)
        )


def _optional_parts(separator: str, allocator: int, graphs: int) -> str:
    """The parts most budgets lack, named only when present."""
    return "".join(f"{separator}{name} {mib(n)}" for name, n in
                   (("allocator slack", allocator), ("decode graphs", graphs)) if n)


def plan(budget: int, *, runtime: int, weights: int, activations: int, allocator: int, graphs: int,
         block_bytes: int, block_size: int, context_length: int) -> MemorySplit:
    """Give the KV cache what ``budget`` leaves after the rest, in whole blocks, one of which is
    the pool's pad block (:class:`~minillm.engine.kv_cache.PagedKVPool`); refuse a budget that
    leaves less than one sequence of full context, saying by how much it falls short."""
    if min(block_bytes, block_size, context_length) < 1:
        raise ValueError("block_bytes, block_size and context_length must be >= 1")
    rest = runtime + weights + activations + allocator + graphs
    blocks = (budget - rest) // block_bytes - 1
    need = -(-context_length // block_size)
    if blocks < need:
        one_sequence = (need + 1) * block_bytes
        extra = _optional_parts(", ", allocator, graphs)
        raise MemoryBudgetError(
            f"memory budget {mib(budget)} is {mib(rest + one_sequence - budget)} short: it must hold runtime "
            f"{mib(runtime)}, weights {mib(weights)}, activations peak {mib(activations)}{extra} and a KV cache "
            f"for one sequence of full context ({context_length} tokens: {need} blocks + the pad block, "
            f"{mib(one_sequence)}); give at least {mib(rest + one_sequence)}, or fewer max_num_seqs or "
            "max_num_batched_tokens for a smaller activations peak"
        )
    return MemorySplit(budget, runtime, weights, activations, allocator, graphs, (blocks + 1) * block_bytes,
                       blocks, block_bytes, block_size, context_length)


def weight_bytes(*models: nn.Module) -> int:
    """Bytes of the tensors ``models`` hold, each storage once however many share it (this
    rank's part of a split model). A budgeted engine never packs weights: no copies to count."""
    storages: dict[int, int] = {}
    for model in models:
        module = getattr(model, "local", model)
        for t in [*module.parameters(), *module.buffers()]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _proc_status(field: str) -> int:
    with open(_PROC_STATUS) as f:
        text = f.read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def resident_bytes(device: torch.device) -> int:
    """What counts against a budget now: the device's memory in use on CUDA, the process's
    resident set on a CPU (module docstring)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return _proc_status("VmRSS")


def _outside_allocator(device: torch.device) -> int:
    """On CUDA, the device memory in use that PyTorch's allocator does not hold (the context,
    libraries' handles, lazily loaded kernels, other processes); 0 on a CPU, whose resident
    set and its high-water mark see everything."""
    if device.type != "cuda":
        return 0
    return resident_bytes(device) - torch.cuda.memory_reserved(device)


def _reset_peak(device: torch.device) -> int:
    """Start a high-water mark; returns what is in use now, the mark's baseline. On CUDA the
    allocator's own counters (``reset_peak_memory_stats``); on a CPU the kernel's ``VmHWM``,
    reset to the current resident set by writing 5 to ``/proc/self/clear_refs``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open(_CLEAR_REFS, "w") as f:
        f.write("5")
    return _proc_status("VmRSS")


def _peak(device: torch.device) -> int:
    """The high-water mark since :func:`_reset_peak`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def worst_steps(cfg: ModelConfig, block_size: int, max_num_seqs: int,
                max_num_batched_tokens: int) -> tuple[SchedulerOutput, SchedulerOutput]:
    """The two largest steps the scheduler can build: a decode of ``max_num_seqs`` rows (or
    ``max_num_batched_tokens``, if fewer), and a prefill of ``max_num_batched_tokens`` tokens.

    Every row is as costly as a row can be: at the end of a full context, in a prefill chunk
    that does not start at 0 (the masked attention path), sampling with ``top_k`` = the
    vocabulary (a full sort). The sequences share one block table, so the pool needs one
    sequence's blocks only; what they write over each other is never read.
    """
    ctx = cfg.context_length
    table = list(range(-(-ctx // block_size)))
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=cfg.vocab_size, seed=0)

    def chunk(i: int, num_tokens: int) -> ScheduledChunk:
        seq = Sequence(f"memory-profile-{i}", [0] * ctx, params, ctx, block_table=table, seed=request_seed(params))
        return ScheduledChunk(seq, ctx - num_tokens, num_tokens)

    decode, prefill = SchedulerOutput(), SchedulerOutput()
    for i in range(min(max_num_seqs, max_num_batched_tokens)):
        decode.add(chunk(i, 1))
    width, left = max(ctx - 1, 1), max_num_batched_tokens
    while left > 0 and len(prefill.chunks) < max_num_seqs:
        prefill.add(chunk(len(prefill.chunks), min(width, left)))
        left -= prefill.chunks[-1].num_tokens
    return decode, prefill


@torch.inference_mode()
def profile_peak(model: GPT, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 attention: str | AttentionKernels = "torch") -> tuple[int, int]:
    """The memory the largest steps (:func:`worst_steps`) need above what is resident before
    them, as ``(step_peak, decode_peak)`` in bytes, measured over a throwaway pool.

    Run rather than counted: a sort's temporaries, a gather buffer, a library's workspace are
    hard to count, and a high-water mark sees them all. The decode runs first, as in a server
    whose pool keeps its widest gather buffer; ``decode_peak`` is what a CUDA graph's private
    memory holds. The pool is allocated before the baseline, so it is not counted.
    """
    cfg, device = model.cfg, model.device
    pool = PagedKVPool(cfg, -(-cfg.context_length // block_size), block_size, device, model.dtype)
    runner = ModelRunner(model, pool, attention)
    decode, prefill = worst_steps(cfg, block_size, max_num_seqs, max_num_batched_tokens)
    base = _reset_peak(device)
    runner.execute(decode)
    decode_peak = _peak(device) - base
    runner.execute(prefill)
    step_peak = _peak(device) - base
    del runner, pool
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the throwaway pool's and the steps' cached blocks, back to the device
    return max(step_peak, 0), max(decode_peak, 0)


def measure(model: GPT, budget: str | int, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
            attention: str | AttentionKernels, graph_bytes: Callable[[int], int] | None,
            beside_per_token: int = 0) -> MemorySplit:
    """The split of ``budget`` for an engine about to run ``model`` with those settings; each
    block of the cache holds ``beside_per_token`` bytes a token more in a cache beside the pool
    (a draft model's).

    ``graph_bytes`` says what captured decode programs will hold given the decode peak
    (:meth:`minillm.speedups.decode_graphs.Capture.graph_bytes`), None when steps run eagerly.
    Inductor's own state once compiled (about 150 MB here) comes after this split: a budgeted
    CPU server stays eager by default.
    """
    device = model.device
    # Measurable on CUDA, or on a Linux CPU, whose /proc/self/clear_refs resets the resident high-water mark.
    if device.type != "cuda" and (device.type != "cpu" or not os.access(_CLEAR_REFS, os.W_OK)):
        raise MemoryBudgetError(
            f"memory budget: memory is measured on CUDA and on a Linux CPU, not on {device.type} here; "
            "size the cache alone with kv_cache_memory"
        )
    budget = parse_memory(budget)
    weights = weight_bytes(model)
    resident, outside = resident_bytes(device), _outside_allocator(device)
    step_peak, decode_peak = profile_peak(model, block_size=block_size, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens, attention=attention)
    # On CUDA what the first steps load outside the allocator (kernels, cuBLAS) is not in its
    # peak: add it. On a CPU the resident set's peak has it already.
    runtime = max(resident - weights, 0) + max(_outside_allocator(device) - outside, 0)
    allocator = min(2 * step_peak, CPU_HEAP_SLACK) if device.type == "cpu" else 0
    graphs = graph_bytes(decode_peak) if graph_bytes is not None else 0
    return plan(budget, runtime=runtime, weights=weights, activations=step_peak, allocator=allocator,
                graphs=graphs, block_bytes=block_size * (kv_bytes_per_token(model.cfg, model.dtype) + beside_per_token),
                block_size=block_size, context_length=model.cfg.context_length)
