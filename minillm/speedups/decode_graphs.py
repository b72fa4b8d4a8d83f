"""The decode step as a captured program: fixed shapes, compiled or recorded once, replayed.

An eager step pays a few microseconds of Python and dispatch per operation, a few hundred
times per step: at batch 1 on a GPU, most of the step. A decode-only step padded to a bucket
(1, 2, 4, 8, ...) and reading its inputs from buffers that never move has one of a handful of
shapes, so it can be prepared once and replayed: on CUDA as a **CUDA graph** per bucket (as
vLLM and nano-vllm do), on a CPU through **torch.compile** (Inductor fuses the elementwise
chains; products of up to 16 rows call the small-batch kernel, :mod:`minillm.speedups.gemv`,
and larger ones the faster of two matrix kernels Inductor times per shape; all cached in
``.cache/inductor``).

Padding rows write into the pool's pad block and their tokens are dropped. The eager path
stays the reference (``enforce_eager``): greedy tokens must be identical.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from minillm.speedups.graph_attention import CPU_KERNEL, PaddedDecodeAttention, decode_backend
from minillm.engine.kv_cache import AttentionKernels, PagedKVPool
from minillm.engine.memory import weight_bytes
from minillm.engine.model_runner import LENGTH, POSITION, TABLE, StagedDecodes, with_pending
from minillm.model.gpt import GPT
from minillm.settings import cache_dir
from minillm.speedups.packed import small_batch_products
from minillm.speedups.quant import QuantLinear, is_quantized, schemes

# Inductor's settings for a CPU decode step: "freezing" makes the weights constants it may lay
# out for its own kernels; max-autotune with the "CPP" backend times its generated matrix
# kernel against the library's per shape and keeps the faster (about 1.3x oneDNN's on a 2-core
# AVX2 machine, chapter 12), at a few seconds per shape on first start and a weight copy per
# bucket. The last two keys keep the timings quiet.
CPU_INDUCTOR_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                       "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
Program = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two from 1 up to the first that holds ``max_batch`` rows."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


def capture_unsupported(model: GPT) -> str | None:
    """Why ``model``'s decode step cannot be captured, or None if it can: a tensor- or
    pipeline-parallel model runs in several processes, and a quantized one through kernels
    this path has not been checked with, but for int8 on a CPU (the small-batch kernel and
    PyTorch's int8 kernel, both operators a compiled step calls)."""
    if not isinstance(model, GPT):
        return "a model split over processes runs its steps eagerly"
    if is_quantized(model) and (model.device.type != "cpu" or schemes(model) != {"int8"}):
        return "a quantized model runs its steps eagerly, but for int8 weights on a CPU"
    return None


def capture_mode(device: torch.device) -> str:
    """How a decode step is captured on ``device``: ``"cuda-graph"`` or ``"compile"``."""
    return "cuda-graph" if device.type == "cuda" else "compile"


@dataclass
class Capture:
    """Decode steps as captured programs, as ``build_engine`` plugs them into an engine: what
    they will hold, for its memory budget, and then the :class:`DecodeGraphs` over the pool it
    sized. ``model`` is the plain model, ``mode`` a :func:`capture_mode`."""

    model: GPT
    max_batch: int
    kernels: AttentionKernels | None
    mode: str

    def graph_bytes(self, decode_peak: int) -> int:
        """The memory the programs will hold beside the engine's: a CUDA graph keeps one decode
        step's intermediates (``decode_peak``); a frozen compiled CPU step up to a copy of the
        weights per bucket (:func:`frozen_weight_bytes`). Inductor's own state (about 150 MB
        here) is not counted."""
        if self.mode == "cuda-graph":
            return decode_peak
        return len(bucket_sizes(self.max_batch)) * frozen_weight_bytes(self.model)

    def __call__(self, pool: PagedKVPool) -> DecodeGraphs:
        return DecodeGraphs(self.model, pool, self.max_batch, self.kernels, self.mode)


def frozen_weight_bytes(model: GPT) -> int:
    """The most of the weights one frozen CPU program may hold: a copy of the model's, and, for
    an int8 model, its matrices in the activations' dtype (a product too wide for the int8
    kernels dequantizes its matrix, and freezing keeps the result as a constant)."""
    dequantized = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
    return weight_bytes(model) + dequantized * model.dtype.itemsize


class DecodeStep(nn.Module):
    """One padded decode step as a module: the model is its submodule, so a compiler sees the
    weights as the module's parameters (constants, once frozen), while the KV pool and the
    step's buffers come in as inputs."""

    def __init__(self, model: GPT, pool: PagedKVPool, backend: str, trim: bool) -> None:
        super().__init__()
        self.model, self.pool, self.backend, self.trim = model, pool, backend, trim

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                tables: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, vocab]`` (float32) and their argmax ``[B]``, the same code in every mode."""
        cache = PaddedDecodeAttention(self.pool, slots, tables, lengths, trim=self.trim, backend=self.backend)
        hidden = self.model.hidden_states(tokens[None], positions[None], cache)[0]
        logits = self.model.logits(hidden).float()
        return logits, logits.argmax(dim=-1)


class DecodeGraphs:
    """One prepared decode program per batch bucket, and the static buffers they all read.
    ``model`` is the plain model (Inductor lays its weights out itself); ``kernels`` replace the
    gather for ``attention="triton"``."""

    def __init__(self, model: GPT, pool: PagedKVPool, max_batch: int, kernels: AttentionKernels | None = None,
                 mode: str | None = None) -> None:
        reason = capture_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        self.pool = pool
        self.mode = mode or capture_mode(model.device)
        if self.mode not in ("compile", "cuda-graph"):
            raise ValueError(f"mode must be 'compile' or 'cuda-graph', got {self.mode!r}")
        backend = CPU_KERNEL if kernels is not None and kernels.name == CPU_KERNEL else decode_backend(kernels)
        if self.mode == "compile":  # few-row products through the small-batch kernel, where it builds
            model = small_batch_products(model) or model
        self.step = DecodeStep(model, pool, backend, trim=self.mode == "compile")
        self.buckets = bucket_sizes(max_batch)
        size, device = self.buckets[-1], model.device
        width = -(-model.cfg.context_length // pool.block_size)
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slots = torch.full((size,), pool.pad_block * pool.block_size, **long)
        self.tables = torch.full((size, width), pool.pad_block, **long)
        self.lengths = torch.ones(size, **long)
        self._programs: dict[int, Program] = {}
        self._graph_pool = None  # the memory CUDA graphs share, largest bucket first
        self.prepare_seconds: dict[int, float] = {}
        if self.mode == "compile":
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir("inductor")))
            self._allow_recompiles()

    def _allow_recompiles(self) -> None:
        """Every bucket is one more compiled version of ``DecodeStep.forward``, past Dynamo's
        limit (8 by default) a failure. The limit is per thread: an overlapped engine runs the
        programs on a thread of its own, which compiles its own versions, so ``run`` sets it too."""
        dynamo = torch._dynamo.config
        if dynamo.recompile_limit < 4 * len(self.buckets):
            dynamo.recompile_limit = 4 * len(self.buckets)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` rows."""
        return next(b for b in self.buckets if b >= n)

    def prepare(self, buckets: list[int] | None = None) -> float:
        """Compile or record the programs of ``buckets`` (default: all), largest first so CUDA
        graphs can share the largest one's memory; returns the seconds taken."""
        start = time.perf_counter()
        for b in sorted(buckets or self.buckets, reverse=True):
            self.program(b)
        return time.perf_counter() - start

    def program(self, b: int) -> Program:
        """Bucket ``b``'s program, prepared on first use (the time it took goes in
        ``prepare_seconds``)."""
        if b not in self._programs:
            start = time.perf_counter()
            self._programs[b] = self._record(b) if self.mode == "cuda-graph" else self._compile(b)
            self.prepare_seconds[b] = time.perf_counter() - start
        return self._programs[b]

    @torch.inference_mode()
    def run(self, staged: StagedDecodes, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[n, vocab]`` (float32) and their argmax ``[n]`` for the ``n`` staged decodes
        (:func:`~minillm.engine.model_runner.stage_decodes`); a pending token is taken from the
        previous step's ``sampled`` ones."""
        if self.mode == "compile":
            self._allow_recompiles()
        n = staged.rows.shape[0]
        b = self.bucket(n)
        self.fill(staged, b, sampled)
        logits, greedy = self.program(b)()
        return logits[:n], greedy[:n]

    def fill(self, staged: StagedDecodes, b: int, sampled: torch.Tensor | None = None) -> None:
        """Copy the staged rows into the buffers, in one copy to the device, pending tokens
        taken from ``sampled``, and reset the padding rows after them, up to the bucket ``b``."""
        bs, n, width = self.pool.block_size, staged.rows.shape[0], staged.width
        packed = staged.rows.to(self.tokens.device, non_blocking=True)
        self.tokens[:n] = with_pending(packed, staged.pending, sampled)
        self.positions[:n], self.slots[:n], self.lengths[:n] = packed[:, POSITION : LENGTH + 1].unbind(1)
        self.tables[:n, :width] = packed[:, TABLE:]
        if b > n:
            self.tokens[n:b] = 0
            self.positions[n:b] = 0
            self.slots[n:b] = self.pool.pad_block * bs
            self.lengths[n:b] = 1
            self.tables[n:b, :width] = self.pool.pad_block

    def _inputs(self, b: int) -> tuple[torch.Tensor, ...]:
        return self.tokens[:b], self.positions[:b], self.slots[:b], self.tables[:b], self.lengths[:b]

    def _compile(self, b: int) -> Program:
        compiled = torch.compile(self.step, fullgraph=True, dynamic=False)
        inputs = self._inputs(b)
        with torch.inference_mode(), torch._inductor.config.patch(CPU_INDUCTOR_CONFIG), warnings.catch_warnings():
            # Inductor's autotuner reads a storage the deprecated way: torch's business, not the reader's
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            compiled(*inputs)  # compiles now, not in the first step that needs it
        return lambda: compiled(*inputs)

    def _record(self, b: int) -> Program:
        inputs = self._inputs(b)
        replay, self._graph_pool = capture_cuda_graph(lambda: self.step(*inputs), self._graph_pool)
        return replay


def capture_cuda_graph(fn: Program, pool: object | None) -> tuple[Program, object]:
    """Record ``fn`` as a CUDA graph in the graph memory ``pool`` (None: a new one); returns
    a function that replays it and returns ``fn``'s outputs, and the pool. ``fn`` runs twice
    first, on a side stream, so one-time work (cuBLAS handles, Triton's autotuning) stays out
    of the recording; it may not ask the host for a value."""
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()

    def replay() -> tuple[torch.Tensor, torch.Tensor]:
        graph.replay()
        return outputs

    return replay, graph.pool()
