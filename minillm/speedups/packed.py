"""Weights laid out for the CPU's matrix kernels: oneDNN's prepacked linear.

A linear layer multiplies activations ``[B, in]`` by a weight stored ``[out, in]``. For the
small ``B`` of decoding, PyTorch's default CPU product (MKL's ``sgemm`` on the weight as it is
stored) reads that weight well below the memory's speed: on a 2-core AVX2 machine the LM
head (``50,257 x 512``, 103 MB in fp32) takes 9 ms at batch 1 and 25 ms at batch 8, that is
11 and 4 GB/s. oneDNN can reorder a weight once into the blocked layout its kernels stream
through (``torch.ops.mkldnn._reorder_linear_weight``) and multiply by it directly
(``_linear_pointwise``): the same head then takes 5 and 7 ms.

At one row a product is a matrix-vector product, and there the plainest kernel can win: each
thread streams its own contiguous slab of the weight's rows as stored. Viewing the weight
``[out, in]`` as ``[slabs, out / slabs, in]`` makes that one ``bmm`` whose batch the threads
share (:func:`slabs_for`). On the same machine it reads a block's matrices alone 1.2-1.5x
faster than oneDNN's packed kernel, and takes a whole batch-1 forward pass from 25.8 to
22.0 ms (median of 12 interleaved rounds); from two rows on, the packed kernel is faster. On a
2-core Xeon with AMX the slabs lost instead (a forward pass of the 50M model: 11.9 ms through
oneDNN, 19.5 through the slabs), and there plain ``F.linear`` beat both on some shapes. So
packing times the roads for one row on each weight shape and keeps the fastest
(:func:`one_row_road`).

:func:`pack_weights` returns the model the engine runs: a copy whose ``nn.Linear`` layers and
tied output matrix use prepacked weights, and which shares every parameter tensor with the
original (the packed copies are the only new memory, one more copy of the matrices). The
product is :func:`packed_linear`. This is the eager path's layout: a compiled decode step
(``minillm.speedups.decode_graphs``) starts from the plain model and lets Inductor lay the
weights out for its own kernels. Only float32 on a CPU: oneDNN's bf16 kernels need AVX-512 or
AVX-NE instructions, and on a GPU cuBLAS reads the weights as they are.
"""

from __future__ import annotations

import copy
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.gpt import GPT, TokenEmbedding

@dataclass
class PackedWeight:
    """A weight's packed copy, how many modules use it, and how a one-row product by it goes:
    ``"slabs"`` (``slabs`` slabs of rows, :func:`slabs_for`), ``"packed"`` (oneDNN's kernel)
    or ``"plain"`` (``F.linear`` on the weight as stored), whichever was timed fastest."""

    packed: torch.Tensor
    users: int
    one_row: str
    slabs: int


# Packed copies by (address, shape) of the weight they were made from: two engines over one
# model share one copy. The address cannot be reused by another tensor while a module holding
# the weight is alive. Packing is a snapshot: a weight changed in place afterwards (training,
# load_state_dict) leaves its packed copy stale (the slabs and the plain road read the weight
# itself).
_PACKED: dict[tuple[int, tuple[int, ...]], PackedWeight] = {}


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape)


def slabs_for(out_features: int, threads: int) -> int:
    """How many equal slabs of rows to cut a weight into so that ``threads`` threads share
    them evenly: the smallest divisor of ``out_features`` that is at least ``threads`` and
    leaves no thread more than 10% above the average (50,257 = 29 x 1,733 rows: 29 slabs,
    15 and 14 to two threads); 1 if none does, which leaves the product on one thread."""
    for slabs in range(max(threads, 1), 64):
        if out_features % slabs == 0 and -(-slabs // threads) * threads <= 1.1 * slabs:
            return slabs
    return 1


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``weight``'s prepacked copy, or at one row by the
    road timed fastest for it (:func:`one_row_road`). A weight with no packed copy (it was
    cast or moved after packing) takes the plain product: same result."""
    entry = _PACKED.get(_key(weight))
    rows = x.reshape(-1, x.shape[-1])
    if entry is None or (rows.shape[0] == 1 and entry.one_row == "plain"):
        return F.linear(x, weight, bias)
    n, (out_features, in_features), slabs = rows.shape[0], weight.shape, entry.slabs
    if n == 1 and entry.one_row == "slabs":
        stacked = weight.view(slabs, out_features // slabs, in_features)
        column = rows.t().expand(slabs, in_features, 1)
        if bias is None:
            out = torch.bmm(stacked, column)
        else:
            out = torch.baddbmm(bias.view(slabs, -1, 1), stacked, column)
        out = out.view(1, out_features)  # [slabs, out / slabs, 1] is the row's outputs in order
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, entry.packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


def _pack(owner: nn.Module, weight: torch.Tensor) -> None:
    """Pack ``weight`` for as long as ``owner`` (or another module packing it) lives."""
    key = _key(weight)
    if key in _PACKED:
        _PACKED[key].users += 1
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        slabs = slabs_for(weight.shape[0], torch.get_num_threads()) if weight.is_contiguous() else 1
        _PACKED[key] = PackedWeight(packed, 1, one_row_road(weight.detach(), packed, slabs), slabs)
    weakref.finalize(owner, _release, key)


# The fastest road for a one-row product, by (shape, dtype, threads): timed once per process.
_ONE_ROW: dict[tuple, str] = {}


def one_row_road(weight: torch.Tensor, packed: torch.Tensor, slabs: int) -> str:
    """How :func:`packed_linear` multiplies one row by ``weight``: ``"slabs"``, ``"packed"`` or
    ``"plain"``, whichever :func:`time_one_row` found fastest for this shape (the slabs only
    where ``slabs`` > 1 splits the rows). Which wins depends on the CPU and its matrix library,
    not on the model, so it is timed once per shape and process."""
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads(), slabs)
    if key not in _ONE_ROW:
        seconds = time_one_row(weight, packed, slabs)
        _ONE_ROW[key] = min(seconds, key=seconds.get)
    return _ONE_ROW[key]


@torch.inference_mode()
def time_one_row(weight: torch.Tensor, packed: torch.Tensor, slabs: int, rounds: int = 7) -> dict[str, float]:
    """Median seconds of one row multiplied by ``weight`` on each road, over ``rounds``
    interleaved rounds after one untimed call each (a few reads of the weight: milliseconds
    for the largest). The slabs are left out where ``slabs`` is 1."""
    out_features, in_features = weight.shape
    row = torch.randn(1, in_features, dtype=weight.dtype)
    roads = {"packed": lambda: torch.ops.mkldnn._linear_pointwise(row, packed, None, "none", [], ""),
             "plain": lambda: F.linear(row, weight)}
    if slabs > 1:
        stacked, column = weight.view(slabs, out_features // slabs, in_features), row.t().expand(slabs, in_features, 1)
        roads["slabs"] = lambda: torch.bmm(stacked, column)
    seconds: dict[str, list[float]] = {name: [] for name in roads}
    for road in roads.values():
        road()
    for _ in range(rounds):
        for name, road in roads.items():
            start = time.perf_counter()
            road()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in seconds.items()}


def _release(key: tuple[int, tuple[int, ...]]) -> None:
    entry = _PACKED[key]
    entry.users -= 1
    if not entry.users:
        del _PACKED[key]


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose product reads a prepacked copy of the (shared) weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        _pack(self, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class PackedTokenEmbedding(TokenEmbedding):
    """The token table: rows looked up as stored, the tied projection through a packed copy."""

    def __init__(self, embedding: TokenEmbedding) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, _weight=embedding.weight)
        self.weight = embedding.weight
        _pack(self, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return packed_linear(hidden, self.weight, None)


def packing_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot have packed weights, or None if it can."""
    if not isinstance(model, GPT) or getattr(model, "world_size", 1) != 1:
        return "only a single-process GPT packs its weights"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "weights are packed for float32 on a CPU only"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if type(model.tok_emb) is not TokenEmbedding or any(not t.is_floating_point() for t in model.buffers()):
        return "a quantized model keeps its own kernels"
    return None


def pack_weights(model: GPT) -> GPT:
    """A copy of ``model`` that shares its parameters and multiplies through packed weights."""
    reason = packing_unsupported(model)
    if reason is not None:
        raise ValueError(reason)
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    packed = copy.deepcopy(model, memo=shared)
    for module in list(packed.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
    packed.tok_emb = PackedTokenEmbedding(packed.tok_emb)
    return packed
