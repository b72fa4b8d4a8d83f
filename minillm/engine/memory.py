"""One memory budget for the whole engine: measure what the model needs, give the cache the rest.

``kv_cache_memory`` sizes the KV cache alone, and leaves the user to guess what the weights,
the activations and the runtime take beside it. ``memory_budget`` (``--memory-budget 6GiB``)
is the whole process's memory instead: at start-up the engine measures what is resident and
what its largest step needs on top, by running that step, as vLLM profiles before it sizes its
cache; the KV cache gets what remains (:func:`measure`, then :func:`plan`, plain arithmetic).

What the budget covers:

- **CPU**: the process's resident memory (``VmRSS``: what ``top``, a container's memory limit
  and the OOM killer count), all of it: the interpreter and torch's libraries (about 280 MB
  before any model is loaded), the tokenizer, the weights, the activations and the KV cache.
  The operating system counts all of it against the process, so that is the figure a budget
  can promise, and the test checks it (a child process's ``ru_maxrss`` stays under the
  budget through a full batch run to full context). The part that is not the model shows
  in the split as ``runtime``. A budgeted engine keeps its weights unpacked by default
  (``EngineConfig.pack_weights`` says why).
- **CUDA**: the device's memory in use (``total - free`` from ``cudaMemGetInfo``): what
  PyTorch's allocator holds (weights, activations, KV cache) and what it does not (the CUDA
  context, cuBLAS handles, lazily loaded kernels: ``runtime``). The device cannot tell this
  process's memory from another's, so on a GPU shared with other processes theirs counts in
  ``runtime`` too. Not counted: the caching allocator's fragmentation (memory reserved beyond
  the allocated peak); ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` keeps it small.
- **Tensor parallelism**: the budget is per rank (per process on a CPU, per GPU on CUDA). The
  split is measured on rank 0, whose share is the largest (it alone computes the logits,
  samples and runs the engine), over ``model.cfg``, which there is rank 0's slice: a block's
  bytes are one rank's heads. Every rank's pool has the same number of blocks, so every rank
  fits what rank 0 fits.

The split: ``runtime + weights + activations + allocator + graphs + kv_cache <= budget``, where
``kv_cache`` is the pool the engine allocates, ``(blocks + 1) * block_bytes`` (the pool's pad
block included), and ``blocks = floor((budget - runtime - weights - activations - allocator -
graphs) / block_bytes) - 1``. A budget whose pool cannot hold one sequence of full context is
refused (:class:`MemoryBudgetError`: one line, what does not fit and by how much).
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
from minillm.decoding.sampling import SamplingParams, make_generator
from minillm.sizes import parse_memory

_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"

# glibc's malloc hands a large block back to the system when it is freed, but after the first
# such free it raises its mmap threshold to that block's size (up to 32 MiB) and serves blocks
# below it from its heap, which it trims only when more than twice the threshold lies free at
# the top. So between and within steps the resident set may sit up to 2 x 32 MiB above what is
# live, and never more than twice the largest temporary (bounded by the step's peak): that
# much is set aside on a CPU as ``allocator``. Runs of the test batch came out 3-31 MB above
# the measured peak without it.
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
    """How a budget is shared out, in bytes (the module docstring says what each part covers).

    ``runtime``: what is resident besides the weights (the interpreter, torch, the tokenizer,
    a draft model; on CUDA the context). ``activations``: the largest step's peak above that,
    as measured. ``allocator``: what the C allocator may hold on top on a CPU
    (:data:`CPU_HEAP_SLACK`). ``graphs``: what captured decode programs add (0 when steps run
    eagerly). ``kv_cache``: the pool, ``(blocks + 1) * block_bytes``.
    """

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
        extra = "".join(f" + {name} {mib(n)}" for name, n in
                        (("allocator slack", self.allocator), ("decode graphs", self.graphs)) if n)
        return (
            f"memory budget {mib(self.budget)} = runtime {mib(self.runtime)} + weights {mib(self.weights)} + "
            f"activations peak {mib(self.activations)}{extra} + "
            + describe_cache(self.kv_cache, self.blocks, self.block_size, self.context_length)
        )


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
        extra = "".join(f", {name} {mib(n)}" for name, n in
                        (("allocator slack", allocator), ("decode graphs", graphs)) if n)
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
    """Bytes of the tensors ``models`` hold (parameters and buffers, each storage once however
    many of them share it). A model split over processes counts this rank's part (``local``).
    A budgeted engine never runs packed weights (``EngineConfig.pack_weights`` says why), so
    their copies need no counting here."""
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


def check_measurable(device: torch.device) -> None:
    """A :class:`MemoryBudgetError` unless memory on ``device`` can be measured: CUDA, or a
    CPU under Linux, whose ``/proc/self/clear_refs`` resets the resident high-water mark."""
    if device.type == "cuda":
        return
    if device.type != "cpu" or not os.access(_CLEAR_REFS, os.W_OK):
        raise MemoryBudgetError(
            f"memory budget: memory is measured on CUDA and on a Linux CPU, not on {device.type} here; "
            "size the cache alone with kv_cache_memory"
        )


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


def worst_steps(cfg: ModelConfig, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                device: torch.device) -> tuple[SchedulerOutput, SchedulerOutput]:
    """The two largest steps the scheduler can build: a decode of ``max_num_seqs`` rows (or
    ``max_num_batched_tokens``, if fewer), and a prefill of ``max_num_batched_tokens`` tokens
    (in chunks of one sequence each, at most ``max_num_seqs`` of them).

    Every row is as costly as a row can be. Each sits at the end of a full context, so its
    attention reads ``context_length`` keys; a prefill chunk is ``context_length - 1`` tokens
    at most, so it takes the masked attention path (a chunk that starts at position 0 takes the
    cheaper causal one); and every row samples with ``top_k`` = the vocabulary, which sorts the
    whole vocabulary, the dearest thing a request can ask of the sampler. All the sequences
    share one block table: what they write over each other is never read, and the pool they
    run on needs one sequence's blocks only.
    """
    ctx = cfg.context_length
    table = list(range(-(-ctx // block_size)))
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=cfg.vocab_size, seed=0)

    def chunk(i: int, num_tokens: int) -> ScheduledChunk:
        seq = Sequence(f"memory-profile-{i}", [0] * ctx, params, ctx, block_table=table,
                       generator=make_generator(params, device))
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
    """The memory the largest steps need above what is resident before them, as
    ``(step_peak, decode_peak)`` in bytes, measured by running them (:func:`worst_steps`)
    through a :class:`ModelRunner` over a throwaway pool of one sequence's blocks.

    Why run rather than count: a step's activations are easy to count, but what the sampler's
    sort, the attention's gather buffer, a kernel's first call or a library's workspace take
    is not, and a high-water mark sees all of it (on CUDA the allocator's, on a CPU the
    resident set's). The decode runs first and the prefill after it, as in a server, whose
    pool keeps the gather buffer of its widest decode between steps: ``step_peak`` is the mark
    over both, ``decode_peak`` over the decode alone (what a CUDA graph's private memory
    holds). The throwaway pool is allocated, and zero-filled, before the baseline is taken, so
    it is not counted; what the first steps leave allocated for good (a library's caches) is.
    """
    cfg, device = model.cfg, model.device
    pool = PagedKVPool(cfg, -(-cfg.context_length // block_size), block_size, device, model.dtype)
    runner = ModelRunner(model, pool, attention)
    decode, prefill = worst_steps(cfg, block_size, max_num_seqs, max_num_batched_tokens, device)
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
            attention: str | AttentionKernels, graph_bytes: Callable[[int], int] | None) -> MemorySplit:
    """The split of ``budget`` for an engine about to run ``model`` with those settings (its
    ``EngineConfig``'s, and its attention backend).

    ``graph_bytes`` says what captured decode programs will hold, given the measured decode
    peak (:meth:`minillm.speedups.decode_graphs.Capture.graph_bytes`: a CUDA graph holds one
    decode step's intermediates, a compiled CPU step a copy of the weights per bucket); None
    when steps run eagerly. Inductor's own state once it has compiled (about 150 MB here) is
    held before a CPU server's first request but after this split: leave room for it, or keep
    a budgeted CPU server eager (its default).
    """
    device = model.device
    check_measurable(device)
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
                graphs=graphs, block_bytes=block_size * kv_bytes_per_token(model.cfg, model.dtype),
                block_size=block_size, context_length=model.cfg.context_length)
