"""Where a training step's time goes, and what each change to the step bought (chapter 4).

Two measurements on random tokens (speed does not depend on what they say): the parts of one
optimizer step (:func:`profile_step`), and whole steps of each version from the plain step
(``F.cross_entropy`` over full logits, the unfused AdamW) to the package's (the chunked fused
loss of :mod:`minillm.model.losses`, PyTorch's fused AdamW) (:func:`compare_steps`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.train import trainer as T
from minillm.model.config import get_preset
from minillm.bench import interleaved_times, pyplot, save_figure
from minillm.machine.hardware import default_device, device_name, synchronize
from minillm.model.losses import linear_cross_entropy
from minillm.model.gpt import GPT

# name -> (fused loss, fused AdamW), from the plain step to the package's
VARIANTS = {"plain": (False, False), "fused loss": (True, False), "fused loss + fused AdamW": (True, True)}


class PlainLoss(nn.Module):
    """A GPT whose loss is the textbook one: full ``[batch, time, vocab]`` logits, then
    ``F.cross_entropy`` in fp32. The baseline every change is measured against."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _setup(preset: str, batch_size: int, seq_len: int | None, dtype: str, device: torch.device, fused_optimizer: bool):
    model_cfg = get_preset(preset)
    cfg = replace(T.TrainConfig(preset=preset, dtype=dtype), lr=1e-4, warmup=0, max_steps=10)
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device).train()
    optimizer = T.make_optimizer(model, cfg, fused=fused_optimizer)
    _, amp, scaler = T.mixed_precision(cfg, device)  # as training runs: fp16 scales its gradients
    x = torch.randint(model_cfg.vocab_size, (batch_size, (seq_len or model_cfg.context_length) + 1), device=device)
    return model, optimizer, amp, scaler, (x[:, :-1], x[:, 1:])


def compare_steps(preset: str = "cpu", *, batch_size: int = 8, seq_len: int | None = None, dtype: str = "float32",
                  repeats: int = 5, device: torch.device | None = None) -> dict:
    """Whole optimizer steps of every version in :data:`VARIANTS`, one of each per round, after
    a warm-up each: ``{name: {"seconds": [...], "tok_s": median, "tok_s_min", "tok_s_max"}}``."""
    device = device or default_device()
    runs = {}
    for name, (fused_loss, fused_opt) in VARIANTS.items():
        model, optimizer, amp, scaler, batch = _setup(preset, batch_size, seq_len, dtype, device, fused_opt)
        runner = model if fused_loss else PlainLoss(model)
        runs[name] = (lambda r=runner, o=optimizer, a=amp, b=batch, s=scaler: T.train_step(r, o, s, a, [b], 1.0))
    seconds = interleaved_times(runs, device, repeats)
    tokens = batch_size * (seq_len or get_preset(preset).context_length)
    return {name: {"seconds": s, "tok_s": tokens / statistics.median(s), "tok_s_min": tokens / max(s),
                   "tok_s_max": tokens / min(s)} for name, s in seconds.items()}


def profile_step(preset: str = "cpu", *, batch_size: int = 8, seq_len: int | None = None, dtype: str = "float32",
                 repeats: int = 5, fused: bool = True, device: torch.device | None = None) -> dict[str, float]:
    """Median milliseconds of each part of a step. With ``fused`` the output layer's forward
    already computes its gradients (that is the fusion), so its backward holds the blocks' only."""
    device = device or default_device()
    model, optimizer, amp, _, (x, y) = _setup(preset, batch_size, seq_len, dtype, device, fused)
    parts: dict[str, list[float]] = {"blocks forward": [], "output layer + loss forward": [], "backward": [],
                                     "clip + AdamW": []}

    def timed(name: str, fn):
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        parts[name].append((time.perf_counter() - start) * 1e3)
        return out

    for _ in range(repeats + 1):
        with amp:
            hidden = timed("blocks forward", lambda: model.hidden_states(x))
            if fused:
                loss = timed("output layer + loss forward", lambda: linear_cross_entropy(hidden, model.tok_emb.weight, y))
            else:
                loss = timed("output layer + loss forward", lambda: F.cross_entropy(
                    model.logits(hidden).float().view(-1, model.cfg.vocab_size), y.reshape(-1)))
        timed("backward", loss.backward)
        timed("clip + AdamW", lambda: (torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), optimizer.step()))
        optimizer.zero_grad(set_to_none=True)
    return {name: statistics.median(ms[1:]) for name, ms in parts.items()}


def run(preset: str = "cpu", *, batch_size: int = 8, seq_len: int | None = None, dtypes: tuple[str, ...] = ("float32",),
        repeats: int = 5, device: torch.device | None = None) -> dict:
    """Both measurements for each dtype, printed as they finish."""
    device = device or default_device()
    report = {"device": device_name(device), "preset": preset, "batch_size": batch_size,
              "seq_len": seq_len or get_preset(preset).context_length, "threads": torch.get_num_threads(),
              "repeats": repeats, "runs": {}}
    for dtype in dtypes:
        profile = {kind: profile_step(preset, batch_size=batch_size, seq_len=seq_len, dtype=dtype, repeats=repeats,
                                      fused=kind == "fused", device=device) for kind in ("plain", "fused")}
        steps = compare_steps(preset, batch_size=batch_size, seq_len=seq_len, dtype=dtype, repeats=repeats, device=device)
        report["runs"][dtype] = {"profile_ms": profile, "steps": steps}
        print(format_report(report["runs"][dtype], f"{preset}, {dtype}, {report['device']}"), flush=True)
    return report


def format_report(run_: dict, title: str) -> str:
    """The profile (ms per part, plain and fused) and the ladder of whole-step throughputs."""
    prof = run_["profile_ms"]
    lines = [f"== training step, {title} ==", f"{'part':<30}{'plain ms':>10}{'fused ms':>10}"]
    for part in prof["plain"]:
        lines.append(f"{part:<30}{prof['plain'][part]:>10.0f}{prof['fused'][part]:>10.0f}")
    lines.append(f"{'total':<30}{sum(prof['plain'].values()):>10.0f}{sum(prof['fused'].values()):>10.0f}")
    base = run_["steps"]["plain"]["tok_s"]
    lines.append(f"\n{'step':<28}{'tok/s (median)':>15}{'min-max':>16}{'vs plain':>10}")
    for name, r in run_["steps"].items():
        lines.append(f"{name:<28}{r['tok_s']:>15,.0f}{r['tok_s_min']:>8,.0f}-{r['tok_s_max']:<7,.0f}{r['tok_s'] / base:>9.2f}x")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """The profile as stacked bars, the ladder of throughputs beside it."""
    plt = pyplot()
    runs = report["runs"]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.4 * len(runs)), squeeze=False)
    for (ax1, ax2), (dtype, run_) in zip(axes, runs.items()):
        prof = run_["profile_ms"]
        left = {kind: 0.0 for kind in prof}
        for i, part in enumerate(prof["plain"]):
            widths = [prof[kind][part] for kind in prof]
            ax1.barh(list(prof), widths, left=[left[k] for k in prof], color=f"C{i}", label=part)
            for kind, w in zip(prof, widths):
                left[kind] += w
        ax1.invert_yaxis()
        ax1.set(xlabel="ms per optimizer step", title=f"{report['preset']}, {dtype}: where a step goes")
        ax1.legend(fontsize=7, loc="lower right")
        names = list(run_["steps"])
        med = [run_["steps"][n]["tok_s"] for n in names]
        err = [[m - run_["steps"][n]["tok_s_min"] for n, m in zip(names, med)],
               [run_["steps"][n]["tok_s_max"] - m for n, m in zip(names, med)]]
        ax2.barh(names, med, xerr=err, color="C0", capsize=3)
        ax2.invert_yaxis()
        ax2.set(xlabel="training tokens/s (median, min-max)", title=f"{report['repeats']} interleaved rounds")
    fig.suptitle(f"{report['device']}, {report['threads']} threads, batch {report['batch_size']} x {report['seq_len']}",
                 fontsize=9)
    save_figure(fig, path)
