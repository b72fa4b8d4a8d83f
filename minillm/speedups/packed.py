"""Weights laid out for the CPU's matrix kernels: oneDNN's prepacked linear, and a kernel for few rows.

At decoding's small batches PyTorch's default CPU product reads a weight well below memory
speed: on a 2-core AVX2 machine the LM head (103 MB in fp32) takes 9 ms at batch 1 and 25 ms
at batch 8. Reordered once into oneDNN's blocked layout it takes 5 and 7 ms.

At a few rows a kernel written for them can win instead. At one row the plainest one: each
thread streams its own slab of the weight's rows as stored, one ``bmm`` over
``[slabs, out / slabs, in]`` (:func:`slabs_for`), 1.2-1.5x faster than oneDNN there, but
slower on a Xeon with AMX, where plain ``F.linear`` beat both on some shapes. Up to
:data:`FEW_ROWS` rows, :mod:`minillm.speedups.gemv`'s C++ kernel, which reads each weight once
for all of them. Which is fastest depends on the CPU, the shape and the row count, so packing
times every road over the whole model's weights in the order a step reads them, at 1, 2, 4, 8
and 16 rows (:func:`time_roads`), and a product takes the fastest at its row count's bucket;
more rows take oneDNN's GEMM.

:func:`pack_weights` returns a copy of the model that shares every parameter and multiplies
through the packed copies (the only new memory). Eager steps only (a compiled step lets
Inductor lay weights out), on a CPU, in float32, and in bfloat16 where oneDNN runs it (it needs
AVX-512; the kernel's bf16 path needs AVX512-BF16, and is timed only where it has it). A
compiled step takes :func:`small_batch_products` instead: the same model, its few-row products
through the kernel, the rest left to Inductor.
"""

from __future__ import annotations

import copy
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.gpt import GPT, TokenEmbedding
from minillm.speedups import gemv
from minillm.speedups.gemv import BUCKETS, FEW_ROWS, bucket_of
from minillm.speedups.huge_pages import into_huge_pages
from minillm.speedups.quant import is_quantized

@dataclass
class PackedWeight:
    """A weight's packed copy, how many modules use it, and the road a product by it takes at
    each of :data:`BUCKETS`, whichever :func:`fastest_roads` timed fastest: ``"slabs"`` (one row
    only: ``slabs`` slabs of rows, :func:`slabs_for`), ``"packed"`` (oneDNN's kernel),
    ``"plain"`` (``F.linear`` on the weight as stored) or ``"gemv"``
    (:func:`minillm.speedups.gemv.small_linear`)."""

    packed: torch.Tensor
    users: int
    roads: dict[int, str]
    slabs: int


# Packed copies by (address, shape) of their weight, so two engines over one model share one
# (the address stays the weight's while a module holds it). A snapshot: a weight changed in
# place afterwards leaves its packed copy stale.
_PACKED: dict[tuple[int, tuple[int, ...]], PackedWeight] = {}


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape)


def slabs_for(out_features: int, threads: int) -> int:
    """How many equal slabs of rows ``threads`` threads share evenly: the smallest divisor of
    ``out_features`` >= ``threads`` leaving no thread 10% above the average (50,257 rows: 29
    slabs), else 1."""
    for slabs in range(max(threads, 1), 64):
        if out_features % slabs == 0 and -(-slabs // threads) * threads <= 1.1 * slabs:
            return slabs
    return 1


def _slabs(weight: torch.Tensor) -> int:
    return slabs_for(weight.shape[0], torch.get_num_threads()) if weight.is_contiguous() else 1


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the road timed fastest for ``weight`` at this many rows'
    bucket, oneDNN's kernel on the packed copy past :data:`FEW_ROWS`. A weight with no packed
    copy (it was cast or moved after packing) takes the plain product: same result."""
    entry = _PACKED.get(_key(weight))
    if entry is None:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    chosen = entry.roads[bucket_of(n)] if n <= FEW_ROWS else "packed"
    return multiply(chosen, rows, weight, entry.packed, entry.slabs, bias).view(*x.shape[:-1], weight.shape[0])


def multiply(road: str, rows: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, slabs: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` ``[n, in]`` times ``weight`` (plus ``bias``) by one road: ``"plain"``
    (``F.linear``), ``"gemv"`` (the small-batch kernel), ``"slabs"`` (one row: ``slabs``
    slabs of the weight's rows in one ``bmm``) or ``"packed"`` (oneDNN on ``packed``)."""
    if road == "plain":
        return F.linear(rows, weight, bias)
    if road == "gemv":
        return gemv.small_linear(rows, weight, bias)
    if road == "slabs":
        (out_features, in_features) = weight.shape
        stacked = weight.view(slabs, out_features // slabs, in_features)
        column = rows.t().expand(slabs, in_features, 1)
        if bias is None:
            out = torch.bmm(stacked, column)
        else:
            out = torch.baddbmm(bias.view(slabs, -1, 1), stacked, column)
        return out.view(1, out_features)  # [slabs, out / slabs, 1] is the row's outputs in order
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _pack(owner: nn.Module, weight: torch.Tensor, roads: dict[int, str]) -> None:
    """Pack ``weight`` for as long as ``owner`` (or another module packing it) lives."""
    key = _key(weight)
    if key in _PACKED:
        _PACKED[key].users += 1
    else:
        weight = weight.detach()
        _PACKED[key] = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight), 1, dict(roads), _slabs(weight))
    weakref.finalize(owner, _release, key)


def roads_for(weight: torch.Tensor, slabs: int, rows: int) -> list[str]:
    """The roads :func:`multiply` can take for ``rows`` rows by ``weight`` here: ``F.linear`` and
    oneDNN's always, the slabs for one row where ``slabs`` > 1, the small-batch kernel where it
    builds for this weight."""
    return ["plain", "packed", *(["slabs"] if slabs > 1 and rows == 1 else []),
            *(["gemv"] if gemv.supports(weight) else [])]


Timings = dict[tuple[int, ...], dict[int, dict[str, float]]]  # {shape: {bucket: {road: seconds}}}
_TIMINGS: dict[tuple, Timings] = {}  # by (the weights' shapes, dtype, threads): timed once per process


@torch.inference_mode()
def time_roads(weights: list[torch.Tensor], rounds: int = 5) -> Timings:
    """For each weight shape and each of :data:`BUCKETS`, the median seconds of a step's products
    by that shape on each road of :func:`roads_for`, summed over the weights of that shape.

    Every road is timed over all of ``weights`` in the order a step reads them, so each call
    finds its weight in memory, as a step does. Timed alone, a weight is warm in a cache on
    every call but the first, and that is not a decode step: on a 2-core Xeon with AMX (51M
    shape) the warm timing picked oneDNN for some one-row products, and a step with oneDNN for
    every one-row product took 16-18 ms against 10.3-10.9 ms with the small-batch kernel; it
    also picked the kernel for bf16 products of four rows, 1.3x slower in a real step. Medians
    of ``rounds`` passes after one untimed pass per road, once per process."""
    key = (tuple(tuple(w.shape) for w in weights), weights[0].dtype, torch.get_num_threads())
    if key not in _TIMINGS:
        copies = [torch.ops.mkldnn._reorder_linear_weight(w.detach()) for w in weights]
        slabs = [_slabs(w) for w in weights]
        timings: Timings = {tuple(w.shape): {} for w in weights}
        for rows in BUCKETS:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
            passes: dict[tuple, dict[str, list[float]]] = {shape: {} for shape in timings}
            for round_ in range(rounds + 1):  # the first pass of each road is not timed
                for road_ in ("gemv", "packed", "plain", "slabs"):
                    totals: dict[tuple, float] = {}
                    for weight, copy_, slabs_ in zip(weights, copies, slabs):
                        if road_ in roads_for(weight, slabs_, rows):
                            start = time.perf_counter()
                            multiply(road_, inputs[weight.shape[1]], weight, copy_, slabs_)
                            shape = tuple(weight.shape)
                            totals[shape] = totals.get(shape, 0.0) + time.perf_counter() - start
                    for shape, seconds in totals.items():
                        passes[shape].setdefault(road_, []).extend([seconds] if round_ else [])
            for shape, by_road in passes.items():
                timings[shape][rows] = {road_: statistics.median(times) for road_, times in by_road.items()}
        _TIMINGS[key] = timings
    return _TIMINGS[key]


def fastest_roads(weights: list[torch.Tensor]) -> dict[tuple[int, ...], dict[int, str]]:
    """For each weight shape, the road :func:`time_roads` found fastest at each bucket."""
    return {shape: {rows: min(seconds, key=seconds.get) for rows, seconds in by_rows.items()}
            for shape, by_rows in time_roads(weights).items()}


def step_weights(model: GPT) -> list[torch.Tensor]:
    """``model``'s matrices in the order a step multiplies by them: each block's, then the LM head."""
    return [m.weight for m in model.modules() if type(m) is nn.Linear] + [model.tok_emb.weight]


def _release(key: tuple[int, tuple[int, ...]]) -> None:
    entry = _PACKED[key]
    entry.users -= 1
    if not entry.users:
        del _PACKED[key]


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose product reads a prepacked copy of the (shared) weight, taking
    ``roads`` (a road by bucket, as :func:`fastest_roads` gives; None times this weight alone)."""

    def __init__(self, linear: nn.Linear, roads: dict[int, str] | None = None) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        _pack(self, self.weight, roads or fastest_roads([self.weight])[tuple(self.weight.shape)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class PackedTokenEmbedding(TokenEmbedding):
    """The token table: rows looked up as stored, the tied projection through a packed copy."""

    def __init__(self, embedding: TokenEmbedding, roads: dict[int, str] | None = None) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight)
        self.weight = embedding.weight
        _pack(self, self.weight, roads or fastest_roads([self.weight])[tuple(self.weight.shape)])

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed_linear(hidden, self.weight, None)


def packing_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot have packed weights, or None if it can."""
    if not isinstance(model, GPT):  # a split model is not one
        return "only a single-process GPT packs its weights"
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return "weights are packed for float32 or bfloat16 on a CPU only"
    if model.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bfloat16 products (they need AVX-512): bfloat16 weights are not packed"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if is_quantized(model):
        return "a quantized model keeps its own kernels"
    return None


def pack_weights(model: GPT) -> GPT:
    """A copy of ``model`` that shares its parameters and multiplies through packed weights,
    each product by the road timed fastest for its shape and row count (:func:`fastest_roads`).
    The parameters first move into 2 MB pages where the OS allows (:func:`into_huge_pages`: the
    same objects and numbers at new addresses), before anything here knows them by address."""
    reason = packing_unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    into_huge_pages(model)
    roads = fastest_roads(step_weights(model))
    return with_products(model, lambda linear: PackedLinear(linear, roads[tuple(linear.weight.shape)]),
                         lambda table: PackedTokenEmbedding(table, roads[tuple(table.weight.shape)]))


def with_products(model: GPT, linear: Callable[[nn.Linear], nn.Module],
                  embedding: Callable[[TokenEmbedding], TokenEmbedding]) -> GPT:
    """A copy of ``model`` sharing its parameters, each ``nn.Linear`` replaced by
    ``linear(it)`` and the token table by ``embedding(it)``: the same model, multiplying
    another way."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    copied = copy.deepcopy(model, memo=shared)
    for module in list(copied.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, linear(child))
    copied.tok_emb = embedding(copied.tok_emb)
    return copied


def kernel_rows(weights: list[torch.Tensor]) -> dict[tuple, frozenset[int]]:
    """For each weight shape, the buckets at which :func:`time_roads` found the small-batch
    kernel faster than the library: oneDNN's kernel on a packed copy, and plain ``F.linear``
    (what a frozen compiled step would otherwise call)."""
    return {shape: frozenset(rows for rows, seconds in by_rows.items()
                             if "gemv" in seconds and seconds["gemv"] < min(seconds["packed"], seconds["plain"]))
            for shape, by_rows in time_roads(weights).items()}


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       kernel_rows: frozenset[int]) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the small-batch kernel when ``x`` has one of
    ``kernel_rows`` rows. Meant for a compiled step: the row count is fixed when a program is
    traced, so each program takes one road, and Inductor fuses what lies between the products."""
    if x.numel() // x.shape[-1] in kernel_rows:
        return gemv.small_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class SmallBatchLinear(nn.Module):
    """An ``nn.Linear`` multiplying by :func:`small_batch_linear` (``kernel_rows``: its shape's
    entry of :func:`kernel_rows`)."""

    def __init__(self, linear: nn.Linear, kernel_rows: frozenset[int]) -> None:
        super().__init__()
        self.weight, self.bias, self.kernel_rows = linear.weight, linear.bias, kernel_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias, self.kernel_rows)


class SmallBatchTokenEmbedding(TokenEmbedding):
    """The token table, its tied projection by :func:`small_batch_linear`."""

    def __init__(self, embedding: TokenEmbedding, kernel_rows: frozenset[int]) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight)
        self.weight, self.kernel_rows = embedding.weight, kernel_rows

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(hidden, self.weight, None, self.kernel_rows)


def small_batch_products(model: GPT) -> GPT | None:
    """A copy of ``model`` whose few-row products go through the small-batch kernel, for a
    compiled CPU step; None where the kernel cannot multiply by its weights (another device or
    dtype, no compiler) or oneDNN cannot, to be timed against (:func:`packing_unsupported`), and
    for bfloat16 on a CPU with AMX: there Inductor's own products run on AMX tiles, which no
    road timed here does, and a compiled step through the kernel ran at 0.70-0.95x the rate of
    one without it at batch 1 to 8 (51M shape, 2-core Xeon), while the timing chose the kernel."""
    if packing_unsupported(model) is not None or not gemv.supports(model.tok_emb.weight):
        return None
    if model.dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return None
    rows = kernel_rows(step_weights(model))
    return with_products(model, lambda linear: SmallBatchLinear(linear, rows[tuple(linear.weight.shape)]),
                         lambda table: SmallBatchTokenEmbedding(table, rows[tuple(table.weight.shape)]))
