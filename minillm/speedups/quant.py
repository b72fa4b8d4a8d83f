"""Weight-only quantization: the GPT's matrices in int8 or int4, written here.

A small-batch decode step's speed is set by the bytes of its weights (chapter 1), so storing
them in fewer bits pays while the activations stay in floating point (W8A16, W4A16).

- **int8, per output channel**: each row gets its own scale, ``absmax(row) / 127``.
- **int4, group-wise**: sixteen levels are too few for a whole row (one outlier would coarsen
  it), so each run of ``group_size`` weights gets ``absmax(group) / 7``; stored as ``q + 8``,
  two nibbles to a byte (:func:`pack_int4`).

:class:`QuantLinear` multiplies through PyTorch's CPU weight-only kernel where one exists and
agrees with our dequantization, and otherwise *dequantizes on the fly* (a full-size float copy
per call, which can be slower than never quantizing). int8 products of decode-sized batches can
take chapter 12's small-batch kernel instead (:mod:`minillm.speedups.gemv`), which reads the
int8 matrix once for every row: :func:`use_small_kernel` times it against the layers' own
product. The tied token embedding, most of the small presets' weights, is quantized once:
:class:`QuantEmbedding` reads the same matrix.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.speedups import gemv

SCHEMES = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32
INT8_MAX = 127
INT4_MAX = 7  # symmetric: [-7, 7], stored as q + 8 in [1, 15]
# When the fused CPU kernels pay (chapter 14): bf16 activations (their fp32 and fp16 paths are
# many times slower) and few rows; their time grows with the rows, while dequantizing costs the
# same for any, so a prefill dequantizes. The crossover moved from 16 to 128 rows between runs;
# 64 keeps every decode batch fused.
FUSED_DTYPE = torch.bfloat16
FUSED_MAX_ROWS = 64
QUANTIZED_DTYPE = torch.bfloat16  # a quantized model's activations unless told otherwise
# Row buckets at which the small-batch kernel is timed against a layer's own int8 product: up to
# FUSED_MAX_ROWS, the decode batches (past them, a prefill dequantizes once for one GEMM). Wider
# than the float kernel's: the alternative here may be dequantizing on every call (fp32 inputs).
KERNEL_BUCKETS = tuple(1 << i for i in range(FUSED_MAX_ROWS.bit_length()))


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    return scheme


# ----------------------------------------------------------------------------- int8


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` floats -> (int8 ``[out, in]``, fp32 scales ``[out]``): absmax per row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.to(scales.dtype) * scales[:, None]


# ----------------------------------------------------------------------------- int4


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """Values in [0, 15], ``[..., 2k]`` -> uint8 ``[..., k]``: column ``2j`` in the low four bits
    of byte ``j``, column ``2j + 1`` in the high four."""
    if nibbles.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {nibbles.shape[-1]}")
    u = nibbles.to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 ``[..., k]`` -> uint8 ``[..., 2k]`` in [0, 15]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _check_groups(in_features: int, group_size: int) -> None:
    if group_size < 2 or group_size % 2 or in_features % group_size:
        raise ValueError(f"group_size must be even and divide the {in_features} input features, got {group_size}")


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` floats -> (packed uint8 ``[out, in / 2]``, fp32 scales ``[out, in / group_size]``)."""
    out_features, in_features = weight.shape
    _check_groups(in_features, group_size)
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / INT4_MAX
    q = torch.round(groups / scales[..., None]).clamp(-INT4_MAX, INT4_MAX)
    return pack_int4((q + 8).view(out_features, in_features)), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    return _nibbles_to_float(unpack_int4(packed), scales, group_size)


def _nibbles_to_float(nibbles: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = nibbles.shape
    q = nibbles.view(rows, cols // group_size, group_size).to(scales.dtype) - 8
    return (q * scales[..., None]).view(rows, cols)


# ----------------------------------------------------------------------------- aten's int4 CPU layout
# aten's int4 packing tiles the matrix in blocks of rows, [in, rows / 2] bytes each, two rows'
# nibbles to a byte, paired by the CPU's vector width (64 rows on AVX-512, 32 on AVX2 and
# without). The embedding looks rows up in the kernel's own copy, so the layout is read off the
# packing itself (_aten_int4_tile) and checked on this machine (_aten_int4_layout_ok).


_TILE_PROBE = torch.stack([torch.arange(128) % 16, torch.arange(128) // 16], dim=1).to(torch.int32)


@functools.lru_cache(maxsize=None)
def _aten_int4_tile() -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """aten's int4 tile on this CPU, read off its packing of a probe whose two columns spell each
    row's index (see :func:`_tile_from_probe`)."""
    return _tile_from_probe(torch.ops.aten._convert_weight_to_int4pack_for_cpu(_TILE_PROBE, 1))


def _tile_from_probe(packed: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """From aten's packing of ``_TILE_PROBE``: (rows per tile, and for each row of a tile the byte,
    within one input column's slice of the tile, that holds its nibble, and that nibble's shift).
    None if no tile size explains the packing."""
    for block in (64, 32, 16):
        tiles = packed.reshape(-1, 2, block // 2)  # [tile, input column, byte]
        low, high = tiles & 0xF, tiles >> 4
        found = torch.stack([low[:, 0] + 16 * low[:, 1], high[:, 0] + 16 * high[:, 1]], dim=-1).long()
        found -= block * torch.arange(tiles.shape[0])[:, None, None]  # row within its tile
        order = found[0].flatten()  # position 2 * byte + nibble holds row order[position]
        if (found == found[0]).all() and torch.equal(order.sort().values, torch.arange(block)):
            where = torch.empty(block, dtype=torch.long)
            where[order] = torch.arange(block)
            return block, where // 2, (where % 2 * 4).to(torch.uint8)
    return None


def _to_aten_int4(nibbles: torch.Tensor) -> torch.Tensor:
    block = _aten_int4_tile()[0]
    rows = -(-nibbles.shape[0] // block) * block
    padded = torch.full((rows, nibbles.shape[1]), 8, dtype=torch.int32, device=nibbles.device)
    padded[: nibbles.shape[0]] = nibbles.to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)


def _aten_int4_all_rows(packed: torch.Tensor) -> torch.Tensor:
    """Every row of the nibble matrix in aten's layout (the padding rows included), tile by
    tile: the whole matrix a forward needs, without gathering it row by row."""
    block, byte, shift = _aten_int4_tile()
    tiles = packed.view(packed.shape[0] // block, packed.shape[1] * 2, block // 2)
    nibbles = (tiles[:, :, byte] >> shift) & 0xF  # [tile, in, row within the tile]
    return nibbles.transpose(1, 2).reshape(packed.shape[0], -1)


def _aten_int4_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the nibble matrix held in aten's tiled layout, as uint8 ``[len(rows), in]``."""
    block, byte, shift = _aten_int4_tile()
    tiles = packed.view(packed.shape[0] // block, packed.shape[1] * 2, block // 2)
    inner = rows % block
    raw = tiles[rows // block, :, byte[inner]]
    return (raw >> shift[inner][:, None]) & 0xF


@functools.lru_cache(maxsize=None)
def _aten_int4_layout_ok() -> bool:
    tile = _aten_int4_tile()
    if tile is None:
        return False
    nibbles = torch.randint(0, 16, (3 * tile[0], 64), generator=torch.Generator().manual_seed(0))
    rows = torch.randperm(nibbles.shape[0], generator=torch.Generator().manual_seed(1))
    packed, expected = _to_aten_int4(nibbles), nibbles.to(torch.uint8)
    return torch.equal(_aten_int4_rows(packed, rows), expected[rows])


# ----------------------------------------------------------------------------- which kernel


@functools.lru_cache(maxsize=None)
def fused_kernel_works(scheme: str, device_type: str, group_size: int = DEFAULT_GROUP_SIZE) -> bool:
    """Whether PyTorch's weight-only kernel for ``scheme`` runs on this device and agrees with
    our own dequantize-then-matmul on a small random layer (in bf16, its fast input type)."""
    if device_type != "cpu":
        return False  # the kernels used here are the CPU ones; elsewhere we dequantize on the fly
    try:
        if scheme == "int4" and not _aten_int4_layout_ok():
            return False
        g = torch.Generator().manual_seed(0)
        width = group_size * max(2, 128 // group_size)
        layer = QuantLinear.from_float(torch.randn(128, width, generator=g), None, scheme, group_size, kernel="fused")
        layer.to(torch.bfloat16)
        x = torch.randn(3, width, generator=g).bfloat16()
        expected = x.float() @ layer.dequantized_weight().float().T
        return bool(torch.allclose(layer(x).float(), expected, rtol=0.02, atol=0.3))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


FUSED_KERNELS = {"int8": "aten._weight_int8pack_mm", "int4": "aten._weight_int4pack_mm_for_cpu"}


# ----------------------------------------------------------------------------- the modules


class QuantLinear(nn.Module):
    """``nn.Linear`` with int8 or int4 weights; the float parts (scales, bias) follow
    ``module.to(dtype)``. ``kernel`` is ``"fused"`` (PyTorch's weight-only kernel, for bf16
    inputs of up to ``FUSED_MAX_ROWS`` rows; int4 nibbles in aten's tiled layout) or
    ``"dequantize"`` (rebuild the float matrix, then an ordinary matmul)."""

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int, kernel: str,
                 qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.kernel = check_scheme(scheme), group_size, kernel
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)  # int4 fused: aten's [in/group, rows, 2] (scale, zero)
        self.register_buffer("bias", bias)
        # Row buckets (KERNEL_BUCKETS) whose products take the small-batch kernel: use_small_kernel
        self.kernel_rows: frozenset[int] = frozenset()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                   group_size: int = DEFAULT_GROUP_SIZE, kernel: str = "auto") -> "QuantLinear":
        """Quantize a ``[out, in]`` weight. ``kernel="auto"`` takes the fused kernel where
        :func:`fused_kernel_works`, else dequantizes on the fly."""
        check_scheme(scheme)
        if kernel == "auto":
            kernel = "fused" if fused_kernel_works(scheme, weight.device.type, group_size) else "dequantize"
        if kernel not in ("fused", "dequantize"):
            raise ValueError(f"kernel must be 'auto', 'fused' or 'dequantize', got {kernel!r}")
        dtype = weight.dtype
        out_features, in_features = weight.shape
        if scheme == "int8":
            qweight, scales = quantize_int8(weight)
        else:
            qweight, scales = quantize_int4(weight, group_size)
            if kernel == "fused":
                qweight = _to_aten_int4(unpack_int4(qweight))
                rows = qweight.shape[0]
                scales = F.pad(scales, (0, 0, 0, rows - out_features), value=1.0)
                scales = torch.stack([scales.T, torch.zeros_like(scales.T)], dim=-1).contiguous()
        bias = None if bias is None else bias.detach().clone()
        return cls(in_features, out_features, scheme, group_size, kernel, qweight, scales.to(dtype), bias)

    def row_scales(self) -> torch.Tensor:
        """Scales as ``[out]`` (int8) or ``[out, in / group_size]`` (int4), whatever the layout."""
        if self.scheme == "int4" and self.kernel == "fused":
            return self.scales[..., 0].T[: self.out_features]
        return self.scales

    def nibbles_or_ints(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stored integers of ``rows`` (all of them, by default): int8 values, or int4
        nibbles (``q + 8``)."""
        every = slice(None) if rows is None else rows
        if self.scheme == "int8":
            return self.qweight[every]
        if self.kernel == "fused":
            if rows is None:
                return _aten_int4_all_rows(self.qweight)[: self.out_features]
            return _aten_int4_rows(self.qweight, rows)
        return unpack_int4(self.qweight[every])

    def weight_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized rows ``[len(rows), in]`` (the whole matrix, by default): an embedding
        lookup reads its rows without rebuilding the matrix, and a whole matrix is read with
        views, not gathered row by row."""
        ints = self.nibbles_or_ints(rows)
        scales = self.row_scales() if rows is None else self.row_scales()[rows]
        if self.scheme == "int8":
            return dequantize_int8(ints, scales)
        return _nibbles_to_float(ints, scales, self.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The whole float matrix ``[out, in]`` that the integers stand for."""
        return self.weight_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows <= FUSED_MAX_ROWS and gemv.bucket_of(rows) in self.kernel_rows:
            out = self.small(flat)
        else:
            out = self.library(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def small(self, flat: torch.Tensor) -> torch.Tensor:
        """The product by the small-batch kernel (int8 only), reading the int8 matrix as stored."""
        return gemv.small_linear_int8(flat, self.qweight, self.scales, self.bias)

    def library(self, flat: torch.Tensor) -> torch.Tensor:
        """The product by PyTorch: its fused kernel where it applies, else dequantize and multiply."""
        bias = None if self.bias is None else self.bias.to(flat.dtype)
        if self.kernel == "fused" and flat.dtype == FUSED_DTYPE and flat.shape[0] <= FUSED_MAX_ROWS:
            out = self.fused(flat)
            return out if bias is None else out + bias
        return nn.functional.linear(flat, self.dequantized_weight().to(flat.dtype), bias)

    def fused(self, flat: torch.Tensor) -> torch.Tensor:
        """PyTorch's fused kernel on ``[rows, in]`` (no bias), whatever the rows and dtype."""
        scales = self.scales.to(flat.dtype)
        if self.scheme == "int8":
            return torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.qweight, scales)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.qweight, self.group_size, scales)
        return out[:, : self.out_features]

    @property
    def kernel_name(self) -> str:
        library = FUSED_KERNELS[self.scheme] if self.kernel == "fused" else "dequantize on the fly + matmul"
        if self.kernel_rows:
            return f"minillm.small_linear_int8 at {', '.join(map(str, sorted(self.kernel_rows)))} rows, else {library}"
        return library

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return f"{self.in_features}, {self.out_features}, {self.scheme}{group}, kernel={self.kernel_name}"


class QuantEmbedding(nn.Module):
    """The tied token embedding, quantized once and used twice, with the contract of
    ``minillm.model.gpt.TokenEmbedding`` (lookup, and ``project`` for ``GPT.logits``). It has no
    float ``weight``: ``table.dequantized_weight()`` builds one, knowingly."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.weight_rows(tokens.reshape(-1)).view(*tokens.shape, self.table.in_features)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table(hidden)

    def cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of :meth:`project`'s scores: a packed table has no float matrix for the
        fused loss, so this one builds the logits (the quant lab's perplexities ask for it)."""
        return F.cross_entropy(self.project(hidden).float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- the whole model


def is_quantized(model: nn.Module) -> bool:
    """Whether any of ``model``'s layers holds integers (:func:`quantize_model` replaced it):
    the other speed-ups, built for float matrices, leave such a model as it is."""
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


def schemes(model: nn.Module) -> set[str]:
    """The quantization schemes ``model``'s layers hold (empty for a float model)."""
    return {m.scheme for m in model.modules() if isinstance(m, QuantLinear)}


def quantize_model(model: nn.Module, scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                   kernel: str = "auto") -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` and its tied ``tok_emb`` with quantized
    versions, and return it. Quantize after moving the model: the packing depends on the device."""
    check_scheme(scheme)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                quantized = QuantLinear.from_float(child.weight, child.bias, scheme, group_size, kernel)
                setattr(parent, name, quantized)
    embedding = getattr(model, "tok_emb", None)
    if isinstance(embedding, nn.Embedding):
        model.tok_emb = QuantEmbedding(QuantLinear.from_float(embedding.weight, None, scheme, group_size, kernel))
    return model


def cast_and_quantize(model: nn.Module, dtype: torch.dtype | None, scheme: str | None) -> nn.Module:
    """What the engine does with ``dtype`` and ``quantize``: the cast, or quantize from the weights
    as trained, then cast the float parts to ``dtype`` (bf16 by default: the fused kernels' input),
    and time the small-batch kernel for the int8 products of few rows (:func:`use_small_kernel`)."""
    if scheme is None:
        return model.to(dtype=dtype)
    quantize_model(model, check_scheme(scheme))
    return use_small_kernel(model.to(dtype=dtype or QUANTIZED_DTYPE))


def step_layers(model: nn.Module) -> list[QuantLinear]:
    """``model``'s quantized layers in the order a step multiplies by them: the blocks', then the
    tied LM head."""
    tables = [m.table for m in model.modules() if isinstance(m, QuantEmbedding)]
    return [m for m in model.modules() if isinstance(m, QuantLinear) and all(m is not t for t in tables)] + tables


_KERNEL_ROWS: dict[tuple, frozenset[int]] = {}  # by (shapes, activations' dtype, threads): timed once per process


@torch.inference_mode()
def small_kernel_rows(layers: list[QuantLinear], dtype: torch.dtype, rounds: int = 5) -> frozenset[int]:
    """The buckets (:data:`KERNEL_BUCKETS`) at which the small-batch kernel
    multiplied ``layers``' int8 weights faster than their own kernel, with ``dtype`` activations.
    Both are timed over all the layers in step order, so each product finds its weight in
    memory as a step does (see :func:`minillm.speedups.packed.time_roads`): medians of
    ``rounds`` passes after an untimed one, once per process."""
    key = (tuple(tuple(m.qweight.shape) for m in layers), dtype, torch.get_num_threads())
    if key not in _KERNEL_ROWS:
        faster = set()
        for rows in KERNEL_BUCKETS:
            inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in layers}
            seconds: dict[str, list[float]] = {"small": [], "library": []}
            for _ in range(rounds + 1):
                for road, times in seconds.items():
                    start = time.perf_counter()
                    for m in layers:
                        getattr(m, road)(inputs[m.in_features])
                    times.append(time.perf_counter() - start)
            if statistics.median(seconds["small"][1:]) < statistics.median(seconds["library"][1:]):
                faster.add(rows)
        _KERNEL_ROWS[key] = frozenset(faster)
    return _KERNEL_ROWS[key]


def use_small_kernel(model: nn.Module) -> nn.Module:
    """Let ``model``'s int8 layers multiply by the small-batch kernel at the row counts where it
    was timed faster than their own kernel (:func:`small_kernel_rows`), and return it. Layers
    stay as they are where the kernel cannot read their weights (int4, another device, no
    compiler)."""
    layers = [m for m in step_layers(model) if m.scheme == "int8" and gemv.supports_int8(m.qweight)]
    if layers:
        dtype = layers[0].scales.dtype
        rows = small_kernel_rows(layers, dtype)
        for layer in layers:
            layer.kernel_rows = rows
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of everything the model stores: parameters and buffers (packed weights, scales)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def kernels_used(model: nn.Module) -> dict[str, int]:
    """How many quantized layers run each kernel, e.g. ``{"aten._weight_int8pack_mm": 17}``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.kernel_name] = counts.get(module.kernel_name, 0) + 1
    return counts
