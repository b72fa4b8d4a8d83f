"""The roofline applied to the GPT: why one decode step waits on memory, and when it stops.

A decode step runs every sequence of a batch forward by one token. Its FLOPs grow with the
batch (2 per weight per sequence, plus attention), but most of its bytes do not: the weights
are read once per step however many sequences share them. So the step's arithmetic intensity
(FLOP per byte) grows with the batch until it reaches the device's ridge point, and up to
there a bigger batch costs almost no extra time. Each sequence's KV cache is the exception:
those bytes grow with the batch *and* with the context, and push the ridge away.

Everything here counts from the model's shape (``minillm.model.gpt``'s counting functions) and
measures on real forward passes (``minillm.decoding.generate.ContiguousKVCache``), so predicted and
measured points can sit on the same plot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from minillm.model.config import ModelConfig
from minillm.decoding.generate import ContiguousKVCache
from minillm.machine.hardware import (
    DeviceSpec,
    MachineProfile,
    dtype_bytes,
    dtype_name,
    format_rate,
    Timing,
    measure_bandwidth,
    time_repeats,
)
from minillm.model.gpt import GPT, count_parameters, inference_flops_per_token
from minillm.settings import quick


@dataclass(frozen=True)
class StepCost:
    """The work of one decode step: FLOPs, and the bytes it must move, by where they come from."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte moved: where the step sits on the roofline's horizontal axis."""
        return self.flops / self.bytes


def decode_step_cost(
    cfg: ModelConfig, batch: int, context: int, *, weight_bytes: float = 2, kv_bytes: float | None = None
) -> StepCost:
    """FLOPs and bytes of one decode step: ``batch`` sequences, each with ``context`` tokens
    already cached, each adding one token.

    - FLOPs: per sequence, 2 per matmul weight plus attention over ``context + 1`` keys.
    - Weights: every parameter once per step (the tied embedding doubles as the output
      matrix, read in full), except the position table, of which each sequence reads one row.
    - KV cache (``kv_bytes`` per element, default ``weight_bytes``; 0 leaves the cache out):
      each sequence reads its ``context + 1`` keys and values in every layer, and writes the
      new token's.
    - Activations: each sequence's embedding vector, each layer's input read and output
      written, and its logits written. Eager PyTorch moves more (every intermediate tensor),
      so this undercounts, which is the safe side for a roof: fewer bytes only raise it.
    """
    if batch < 1 or context < 0:
        raise ValueError(f"need batch >= 1 and context >= 0, got batch={batch}, context={context}")
    kv_bytes = weight_bytes if kv_bytes is None else kv_bytes
    d, layers = cfg.d_model, cfg.n_layers
    weights = (count_parameters(cfg) - cfg.context_length * d + batch * d) * weight_bytes
    kv = batch * layers * 2 * d * (context + 2) * kv_bytes
    activations = batch * (d + 2 * layers * d + cfg.vocab_size) * weight_bytes
    return StepCost(batch * inference_flops_per_token(cfg, context + 1), weights, kv, activations)


def _linear_in_batch(
    cfg: ModelConfig, context: int, weight_bytes: float, kv_bytes: float | None
) -> tuple[float, float, float]:
    """(FLOPs per sequence, bytes per sequence, fixed bytes): every cost is ``a + b * batch``."""
    one, two = (decode_step_cost(cfg, b, context, weight_bytes=weight_bytes, kv_bytes=kv_bytes) for b in (1, 2))
    per_seq = two.bytes - one.bytes
    return one.flops, per_seq, one.bytes - per_seq


def max_intensity(cfg: ModelConfig, context: int, *, weight_bytes: float = 2, kv_bytes: float | None = None) -> float:
    """The intensity an unbounded batch approaches: once the weights are shared by enough
    sequences, each sequence's own bytes (its KV cache, its activations) set the ratio."""
    flops, per_seq, _ = _linear_in_batch(cfg, context, weight_bytes, kv_bytes)
    return flops / per_seq


def ridge_batch(
    cfg: ModelConfig, context: int, spec: DeviceSpec, dtype: str, *, kv_bytes: float | None = None
) -> float:
    """The batch at which decode turns compute-bound on ``spec`` with ``dtype`` weights, or
    ``inf`` if no batch ever gets there (the per-sequence bytes cap the intensity below the
    ridge). Solves ``B * flops / (fixed + B * per_seq) = ridge`` for ``B``."""
    flops, per_seq, fixed = _linear_in_batch(cfg, context, dtype_bytes(dtype), kv_bytes)
    ridge = spec.ridge(dtype)
    return ridge * fixed / (flops - ridge * per_seq) if flops > ridge * per_seq else math.inf


def attainable_flops(intensity: float, spec: DeviceSpec, dtype: str) -> float:
    """The roof itself: ``min(peak FLOP/s, bandwidth * intensity)``."""
    return min(spec.flops[dtype], spec.bandwidth * intensity)


@dataclass(frozen=True)
class DecodePoint:
    """One decode step on the roofline: its cost, the roofline's time for it, and (when timed)
    the time it really took."""

    batch: int
    context: int
    dtype: str
    cost: StepCost
    predicted_seconds: float
    measured_seconds: float | None = None  # the median of the timed runs
    measured_quartiles: tuple[float, float] | None = None  # their first and third quartiles

    @property
    def intensity(self) -> float:
        return self.cost.intensity

    @property
    def predicted_flops(self) -> float:
        return self.cost.flops / self.predicted_seconds

    @property
    def achieved_flops(self) -> float | None:
        return None if self.measured_seconds is None else self.cost.flops / self.measured_seconds

    def as_row(self) -> dict:
        """A table row: times in milliseconds, rates in GFLOP/s and GB/s."""
        row = {"dtype": self.dtype, "batch": self.batch, "context": self.context,
               "FLOP/byte": round(self.intensity, 2), "MB moved": round(self.cost.bytes / 1e6, 2),
               "predicted ms": round(self.predicted_seconds * 1e3, 3),
               "roof GFLOP/s": round(self.predicted_flops / 1e9, 2)}
        if self.measured_seconds is not None:
            row |= {"measured ms": round(self.measured_seconds * 1e3, 3)}
            if self.measured_quartiles is not None:
                row["quartiles ms"] = "..".join(f"{q * 1e3:.2f}" for q in self.measured_quartiles)
            row |= {"achieved GFLOP/s": round(self.achieved_flops / 1e9, 2),
                    "achieved GB/s": round(self.cost.bytes / self.measured_seconds / 1e9, 2),
                    "of roof": round(self.predicted_seconds / self.measured_seconds, 2)}
        return row


def predict_decode(cfg: ModelConfig, spec: DeviceSpec, dtype: str, batch: int, context: int) -> DecodePoint:
    """The roofline's time for a step: the longer of computing its FLOPs and moving its bytes."""
    cost = decode_step_cost(cfg, batch, context, weight_bytes=dtype_bytes(dtype))
    seconds = max(cost.flops / spec.flops[dtype], cost.bytes / spec.bandwidth)
    return DecodePoint(batch, context, dtype, cost, seconds)


@torch.inference_mode()
def decode_step_timing(model: GPT, batch: int, context: int, repeats: int = 5) -> Timing:
    """Seconds of one real decode step of ``model`` over ``repeats`` runs: ``batch`` new tokens at
    position ``context`` over a contiguous KV cache holding ``context`` tokens each. The cache's
    keys are zeros, which costs the same to read as real ones."""
    device = model.tok_emb.weight.device
    cache = ContiguousKVCache(model, batch, context + 1)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = torch.full((batch, 1), context, device=device)

    def step() -> None:
        cache.length = context
        model(tokens, positions, cache)

    return time_repeats(step, device, repeats, warmup=2)


def time_decode_step(model: GPT, batch: int, context: int, repeats: int = 5) -> float:
    """The median of :func:`decode_step_timing`: seconds of one decode step."""
    return decode_step_timing(model, batch, context, repeats).median


def measure_decode(
    model: GPT, spec: DeviceSpec, batches: Sequence[int], context: int, repeats: int | None = None
) -> list[DecodePoint]:
    """Time ``model``'s decode step at each batch size and pair it with the prediction for
    ``spec`` (in the model's own dtype)."""
    repeats = repeats or (3 if quick() else 7)
    dtype = dtype_name(model.dtype)
    points = []
    for b in batches:
        timing = decode_step_timing(model, b, context, repeats)
        points.append(replace(predict_decode(model.cfg, spec, dtype, b, context), measured_seconds=timing.median,
                              measured_quartiles=timing.quartiles))
    return points


def nearly_free_batch(points: Sequence[DecodePoint], slack: float = 1.5) -> int:
    """The largest measured batch before the first whose step took more than ``slack`` times
    the smallest batch's: how far batching is nearly free here, measured, not predicted."""
    ordered = sorted(points, key=lambda p: p.batch)
    best = ordered[0].batch
    for p in ordered:
        if p.measured_seconds > slack * ordered[0].measured_seconds:
            break
        best = p.batch
    return best


def decode_roof(profile: MachineProfile, cfg: ModelConfig, dtype: str) -> DeviceSpec:
    """The roof that bounds this model's decode on the measured machine.

    ``profile`` measured memory with buffers far larger than any cache. A small model's weights
    may fit in a cache (a CPU's L3, a GPU's L2) and stream from there faster, step after step;
    then the honest slope is the bandwidth of reading a buffer the size of the weights, again
    and again, which this measures once per size and keeps in the profile, so that a saved
    profile (``minillm.machine.measured``) gives later chapters the same roof. For weights larger
    than the caches the two agree.
    """
    nbytes = int(decode_step_cost(cfg, 1, 0, weight_bytes=dtype_bytes(dtype), kv_bytes=0).weight_bytes)
    if nbytes not in profile.resident:  # measured once per size, then kept with the profile
        profile.resident[nbytes] = measure_bandwidth(profile.device, "reduce", nbytes, 3 if quick() else 7)
    resident = profile.resident[nbytes]
    spec = profile.as_spec()
    if resident <= spec.bandwidth:
        return spec
    note = f"reading {nbytes / 1e6:.0f} MB (the {dtype} weights) repeatedly: {resident / 1e9:.1f} GB/s"
    return replace(spec, name=f"{spec.name} ({nbytes / 1e6:.0f} MB working set)", bandwidth=resident, note=note)


# ----------------------------------------------------------------------------- plots

COLORS = {"fp32": "tab:blue", "bf16": "tab:orange", "fp16": "tab:green"}


def plot_roofline(
    spec: DeviceSpec,
    dtypes: Sequence[str],
    points: Sequence[DecodePoint] = (),
    *,
    slopes: dict[str, float] | None = None,
    title: str | None = None,
) -> Figure:
    """The roofline of ``spec`` for each dtype (bandwidth slope, compute ceiling, ridge marked),
    any further ``slopes`` (label -> bytes/s) dashed, and decode ``points``: the prediction
    hollow, the measurement (where there is one) filled and labelled with its batch."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    known = [spec.ridge(d) for d in dtypes] + [p.intensity for p in points]
    xs = np.logspace(math.log10(min([0.25, *known]) / 2), math.log10(max(known) * 4), 200)
    for label, bandwidth in (slopes or {}).items():
        ax.plot(xs, bandwidth * xs, ls="--", color="grey", lw=1, label=label)
    for dtype in dtypes:
        color, peak, ridge = COLORS.get(dtype, "black"), spec.flops[dtype], spec.ridge(dtype)
        ax.plot(xs, [attainable_flops(x, spec, dtype) for x in xs], color=color, lw=2,
                label=f"{dtype} roof: {format_rate(peak, 'FLOP/s')}, {format_rate(spec.bandwidth, 'B/s')}")
        ax.plot([ridge], [peak], marker="D", color=color)
        ax.annotate(f"ridge {ridge:.1f}", (ridge, peak), textcoords="offset points", xytext=(4, 6), color=color)
    for p in points:
        color = COLORS.get(p.dtype, "black")
        ax.plot(p.intensity, p.predicted_flops, marker="o", mfc="none", color=color, ls="none")
        if p.achieved_flops is not None:
            ax.plot(p.intensity, p.achieved_flops, marker="o", color=color, ls="none")
            ax.annotate(f"B={p.batch}", (p.intensity, p.achieved_flops), textcoords="offset points",
                        xytext=(3, -11), fontsize=7, color=color)
    handles, _ = ax.get_legend_handles_labels()
    if points:
        handles.append(Line2D([], [], marker="o", mfc="none", color="grey", ls="none", label="predicted (roofline)"))
    if any(p.measured_seconds is not None for p in points):
        handles.append(Line2D([], [], marker="o", color="grey", ls="none", label="measured"))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="attainable FLOP/s",
           title=title or f"Roofline: {spec.name}")
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    return fig


def plot_intensity_vs_batch(
    cfg: ModelConfig, spec: DeviceSpec, dtype: str, contexts: Sequence[int], batches: Sequence[int]
) -> Figure:
    """Decode intensity against batch size, one line per context length plus one without the
    KV cache, against ``spec``'s ridge: where a line crosses it is that context's ridge batch."""
    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    wb, ridge = dtype_bytes(dtype), spec.ridge(dtype)
    curves = [("no KV cache", 0, 0)] + [(f"context {c}", c, None) for c in contexts]
    for label, context, kv in curves:
        ys = [decode_step_cost(cfg, b, context, weight_bytes=wb, kv_bytes=kv).intensity for b in batches]
        line, = ax.plot(batches, ys, marker=".", ls="--" if kv == 0 else "-", label=label)
        crossing = ridge_batch(cfg, context, spec, dtype, kv_bytes=kv)
        if crossing <= max(batches):
            ax.plot([crossing], [ridge], marker="o", color=line.get_color())
    ax.axhline(ridge, color="black", lw=1)
    ax.annotate(f"ridge of {spec.name}: {ridge:.1f} FLOP/byte", (batches[0], ridge), textcoords="offset points",
                xytext=(2, 4), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="batch size (sequences per decode step)",
           ylabel="decode intensity (FLOP/byte)", title=f"{dtype} decode intensity vs batch")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    return fig
