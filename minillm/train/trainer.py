"""Training: teach a GPT to continue stories, then save it for every later chapter to serve.

The loop is the standard one (nanoGPT's shape): sample windows of the token stream, predict
each next token, average the cross-entropy, backpropagate, clip the gradient, and take an
AdamW step on a warm-up-then-cosine schedule, under autocast where it pays.

``python -m minillm.train --preset cpu`` trains the book's model; under ``torchrun`` the same
command trains with DistributedDataParallel, each rank reading its own shard of the data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from minillm.model.checkpoint import CHECKPOINT_NAME, load_model, load_state, preset_dir, save_checkpoint
from minillm.model.config import ModelConfig, get_preset
from minillm.data.corpus import BatchSampler, Corpus, prepare_corpus
from minillm.decoding.generate import generate_naive
from minillm.machine.hardware import default_device, dtype_name, matmul_peak, measure_matmul_flops, median_seconds
from minillm.model.gpt import GPT, training_flops_per_token
from minillm.settings import quick
from minillm.data.tokenizer import get_tokenizer

# Per-preset defaults; a flag given on the command line wins. QUICK mode caps the steps.
# cpu: 1,100 steps of 4 x 256 tokens (1.13M tokens). Per token a batch of 4 learns more than one
# of 8 (validation loss 0.523 vs 0.540 after 1.02M tokens; a batch of 2 gave 0.540, a peak lr of
# 2e-3 0.536, of 5e-3 0.569), and the fused step is as fast per token at either size; 8 x 600
# reached 0.511 with 9% more tokens. Measured on a 2-core Xeon.
PRESET_TRAINING: dict[str, dict] = {
    "tiny": dict(batch_size=8, max_steps=60, lr=2e-3, warmup=10, eval_every=30),
    "cpu": dict(batch_size=4, max_steps=1100, lr=3e-3, warmup=30, eval_every=200),
    "draft": dict(batch_size=8, max_steps=300, lr=5e-3, warmup=20, eval_every=100),
    "tinystories-50m": dict(batch_size=32, grad_accum=4, max_steps=20_000, lr=6e-4, warmup=500, eval_every=1000),
}
QUICK_MAX_STEPS = 30


@dataclass
class TrainConfig:
    """Every training setting; ``None`` means "the preset's default" (see ``PRESET_TRAINING``)."""

    preset: str = "cpu"
    data: str = "auto"
    max_stories: int | None = None
    max_steps: int | None = None
    max_tokens: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None  # default: the model's whole context
    grad_accum: int | None = None
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int | None = None
    eval_batches: int = 20
    out: str | None = None
    resume: bool = False
    stop_after: int | None = None  # end this run after so many steps (the schedule still spans max_steps)
    device: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    seed: int = 0
    compile: bool = False
    progress: bool = True


def resolve(cfg: TrainConfig, world_size: int = 1) -> tuple[TrainConfig, ModelConfig]:
    """Fill in defaults and check that the settings can work, with errors that name the setting."""
    model_cfg = get_preset(cfg.preset)
    defaults = {"grad_accum": 1, **PRESET_TRAINING[cfg.preset]}
    filled = {k: (getattr(cfg, k) if getattr(cfg, k) is not None else v) for k, v in defaults.items()}
    cfg = replace(cfg, **filled)
    cfg.seq_len = cfg.seq_len or model_cfg.context_length
    cfg.out = cfg.out or str(preset_dir(cfg.preset))
    if cfg.max_tokens is not None:
        if cfg.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, not {cfg.max_tokens}")
        cfg.max_steps = math.ceil(cfg.max_tokens / (cfg.batch_size * cfg.seq_len * cfg.grad_accum * world_size))
    elif quick():
        cfg.max_steps = min(cfg.max_steps, QUICK_MAX_STEPS)
    for name in ("batch_size", "grad_accum", "max_steps", "eval_every", "seq_len"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}")
    if cfg.seq_len > model_cfg.context_length:
        raise ValueError(f"seq-len {cfg.seq_len} is longer than the {cfg.preset} model's context of {model_cfg.context_length}")
    if not cfg.lr > 0 or cfg.warmup < 0:
        raise ValueError(f"lr must be positive and warmup non-negative (got lr={cfg.lr}, warmup={cfg.warmup})")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {cfg.dtype!r}")
    return cfg, model_cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then a cosine down to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min((step - cfg.warmup) / max(cfg.max_steps - cfg.warmup, 1), 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and embeddings) only, as GPT-2 and nanoGPT do.

    On CPUs and GPUs it is PyTorch's fused AdamW: one kernel updates every tensor, rather than
    a dozen elementwise passes over the weights and both moment buffers (on two CPU cores a
    third of the time: 30 ms rather than 87 for the ``cpu`` preset's 11.5M parameters).
    ``fused=False`` asks for the plain one (the benchmark of chapter 4 compares them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if fused is None:
        fused = bool(params) and params[0].device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The dtype to autocast to, or None for plain fp32. ``auto``: bf16 on GPUs that support it
    (fp16 on older ones); on a CPU, bf16 only where it measures faster (:func:`cpu_bf16_pays`)."""
    if cfg.dtype == "float32" or device.type == "mps":
        return None
    if cfg.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_bf16_pays() else None
    return getattr(torch, cfg.dtype)


def mixed_precision(cfg: TrainConfig, device: torch.device):
    """The autocast dtype (None for plain fp32), its context, and a gradient scaler that
    scales only for fp16, whose small gradients would otherwise underflow."""
    amp_dtype = autocast_dtype(cfg, device)
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    return amp_dtype, amp, torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX) for oneDNN to use."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@functools.cache
def cpu_bf16_pays(margin: float = 1.2) -> bool:
    """Whether bf16 matrix products run at least ``margin`` times faster than fp32 here, timed
    (a few 1024-wide products each, a fraction of a second). Having the instructions is not
    enough: a CPU without them emulates bf16 some 30x slower than fp32, and one with AVX-512 BF16
    but no AMX (a 2-core Xeon VM here) measured 145 against 244 GFLOP/s, and trained 1.4x slower."""
    if not cpu_has_bf16_matmul():
        return False
    return measure_matmul_flops("cpu", torch.bfloat16, n=1024) > margin * measure_matmul_flops("cpu", torch.float32, n=1024)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 whatever the autocast dtype. The model computes
    it with its output layer, a chunk of tokens at a time (:mod:`minillm.model.losses`); the plain
    ``F.cross_entropy(model(x), y)`` gives the same number and gradients, at twice the cost."""
    return model(x, targets=y)


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, seq_len: int, batch_size: int, n_batches: int, amp: contextlib.AbstractContextManager) -> dict:
    """Validation loss over fixed, evenly spaced windows of the held-out split (the same windows
    every time, so successive evaluations are comparable), with perplexity and bits per byte.

    Bits per byte divides the total information (loss in bits, over all tokens) by the bytes of
    text those tokens encode, so it compares models with different tokenizers.
    """
    tokens = corpus.tokens("validation")
    n = min(n_batches * batch_size, max(len(tokens) - seq_len - 1, 1))
    starts = np.linspace(0, len(tokens) - seq_len - 1, n).astype(np.int64)
    was_training = model.training
    model.eval()
    losses = []
    device = next(model.parameters()).device
    for chunk in np.array_split(starts, math.ceil(n / batch_size)):
        xy = torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in chunk]).astype(np.int64)).to(device)
        with amp:
            losses.append(loss_fn(model, xy[:, :-1], xy[:, 1:]).item() * len(chunk))
    model.train(was_training)
    loss = sum(losses) / n
    stats = corpus.stats("validation")
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_bpb": loss / math.log(2) * stats["tokens"] / stats["bytes"]}


def sample(model: GPT, max_new_tokens: int = 60, prompt: str = "", seed: int = 0) -> str:
    """A short sample from the start of a story (top-k 40 at temperature 0.8), for progress logs."""
    tok = get_tokenizer()
    ids = [tok.eot, *tok.encode(prompt)]
    out = generate_naive(model, ids, max_new_tokens, temperature=0.8, top_k=40, stop_token=tok.eot, seed=seed)
    return prompt + tok.decode([t for t in out if t != tok.eot])


# ----------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> Dist:
    """Join the process group when launched by ``torchrun`` (it sets RANK and WORLD_SIZE)."""
    if "RANK" not in os.environ:
        return Dist()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend)
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


# ----------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) a model and return its final metrics; the checkpoint is in ``cfg.out``."""
    device = torch.device(cfg.device) if cfg.device else default_device()
    dist = init_distributed(device)
    if dist.world_size > 1 and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
    try:
        return _train(cfg, device, dist)
    finally:
        if dist.world_size > 1:
            torch.distributed.destroy_process_group()


def _train(cfg: TrainConfig, device: torch.device, dist: Dist) -> dict:
    cfg, model_cfg = resolve(cfg, dist.world_size)
    if dist.main:  # one process tokenizes; the others wait, then read the cache
        corpus = prepare_corpus(cfg.data, max_stories=cfg.max_stories, seed=cfg.seed, verbose=cfg.progress)
    if dist.world_size > 1:
        torch.distributed.barrier()
    if not dist.main:
        corpus = prepare_corpus(cfg.data, max_stories=cfg.max_stories, seed=cfg.seed, verbose=False)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg).to(device)
    optimizer = make_optimizer(model, cfg)
    out = Path(cfg.out) / CHECKPOINT_NAME
    step, history = 0, []
    if cfg.resume and out.is_file():
        state = load_state(out, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    runner = model if not cfg.compile else torch.compile(model)
    if dist.world_size > 1:
        runner = torch.nn.parallel.DistributedDataParallel(runner, device_ids=[device.index] if device.type == "cuda" else None)
    token_counts = corpus.token_counts("train", model_cfg.vocab_size)
    sampler = BatchSampler(corpus.tokens("train"), cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                           rank=dist.rank, world_size=dist.world_size, device=device)
    amp_dtype, amp, scaler = mixed_precision(cfg, device)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist.world_size
    flops_per_step = training_flops_per_token(model_cfg, cfg.seq_len) * tokens_per_step
    # MFU's denominator: the measured matmul peak of the dtype the step's matrix products use
    # (fp32 without autocast, the autocast dtype under it), and the bar names it beside every figure
    matmul_dtype = amp_dtype or torch.float32
    peak = matmul_peak(device, matmul_dtype) * dist.world_size
    peak_name = dtype_name(matmul_dtype)
    bar = None
    if cfg.progress and dist.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, desc=f"training {cfg.preset}", unit="step",
                   dynamic_ncols=True)
        bar.write(f"mfu = model FLOPs per second / this machine's measured {peak_name} "
                  f"matmul peak ({peak / 1e9:,.0f} GFLOP/s)")
    last = {}
    model.train()
    stop = min(cfg.max_steps, step + cfg.stop_after) if cfg.stop_after else cfg.max_steps
    while step < stop:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = train_step(runner, optimizer, scaler, amp, [sampler.batch(step * cfg.grad_accum + i) for i in range(cfg.grad_accum)], cfg.grad_clip)
        step += 1
        elapsed = time.perf_counter() - start
        last = {"step": step, "train_loss": loss, "lr": optimizer.param_groups[0]["lr"],
                "tokens": step * tokens_per_step, "tok_s": tokens_per_step / elapsed, "mfu": flops_per_step / elapsed / peak}
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{last['tok_s']:,.0f}", mfu=f"{last['mfu']:.0%} of {peak_name} peak")
        if dist.main:
            history.append(last)
            if step % cfg.eval_every == 0 or step == stop:
                last.update(evaluate(model, corpus, cfg.seq_len, cfg.batch_size, cfg.eval_batches, amp))
                last["sample"] = sample(model, seed=step)
                _log(bar, last)
                _save(out, model, optimizer, step, cfg, model_cfg, corpus, token_counts, history)
    if bar is not None:
        bar.close()
    return last


def train_step(runner, optimizer, scaler, amp, batches: list[tuple[torch.Tensor, torch.Tensor]], grad_clip: float) -> float:
    """One optimizer step over ``len(batches)`` micro-batches (gradient accumulation): each
    micro-batch's loss is divided by their number, so the step sees their mean gradient. Under
    DDP, gradients are all-reduced only on the last micro-batch."""
    total = 0.0
    for i, (x, y) in enumerate(batches):
        sync = i == len(batches) - 1 or not hasattr(runner, "no_sync")
        with (contextlib.nullcontext() if sync else runner.no_sync()), amp:
            loss = loss_fn(runner, x, y) / len(batches)
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(runner.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


def load_or_train(preset: str, device: str | torch.device | None = None) -> GPT:
    """The newest trained model of a preset; trains it first (with a progress bar) if none exists.

    Later chapters and the server start here, so a reader who skipped training still gets a
    model, and one who trained gets theirs.
    """
    device = device or default_device()
    path = preset_dir(preset) / CHECKPOINT_NAME
    if not path.is_file():
        cfg = TrainConfig(preset=preset, out=str(path.parent), device=str(device))
        print(f"No trained '{preset}' model in {path.parent}; training one now.", flush=True)
        print(forecast(cfg), flush=True)
        train(cfg)
    return load_model(path, device)


def forecast(cfg: TrainConfig) -> str:
    """How long training ``cfg`` should take on this machine, from a short timed warm-up (three
    steps of the same shape on random tokens, about as long as three steps of the real run).

    Each evaluation forwards ``eval_batches`` batches, about a third of a step each (a forward
    without the backward); corpus preparation, once per machine, is not counted."""
    cfg, _ = resolve(cfg)
    device = torch.device(cfg.device) if cfg.device else default_device()
    rate = measure_throughput(cfg.preset, cfg.dtype, batch_size=cfg.batch_size * cfg.grad_accum,
                              seq_len=cfg.seq_len, steps=2, device=device)
    step_s = cfg.batch_size * cfg.grad_accum * cfg.seq_len / rate
    evals = math.ceil(cfg.max_steps / cfg.eval_every)
    seconds = cfg.max_steps * step_s + evals * cfg.eval_batches * step_s / 3
    duration = f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} seconds"
    return (f"Expected: about {duration} on this machine ({cfg.max_steps} steps at "
            f"{rate:,.0f} tokens/s, measured just now, and {evals} evaluations), plus writing the corpus on a first run.")


def measure_throughput(
    preset: str, dtype: str = "float32", *, batch_size: int = 8, seq_len: int | None = None,
    steps: int = 3, device: str | torch.device | None = None, compile: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Training tokens per second of a preset: the median of ``steps`` timed optimizer steps
    on random tokens (speed does not depend on the data), after one warm-up step, which also
    pays for ``torch.compile`` when ``compile`` is set. (``clock`` lets a test time the steps
    on a fake clock.)"""
    device = torch.device(device) if device else default_device()
    model_cfg = get_preset(preset)
    cfg = replace(TrainConfig(preset=preset, dtype=dtype), lr=1e-4, warmup=0, max_steps=steps)
    seq_len = seq_len or model_cfg.context_length
    model = GPT(model_cfg).to(device).train()
    runner = torch.compile(model) if compile else model
    optimizer = make_optimizer(model, cfg)
    _, amp, scaler = mixed_precision(cfg, device)
    x = torch.randint(model_cfg.vocab_size, (batch_size, seq_len + 1), device=device)
    batch = [(x[:, :-1], x[:, 1:])]
    seconds = median_seconds(lambda: train_step(runner, optimizer, scaler, amp, batch, cfg.grad_clip),
                             device, steps, clock=clock)
    return batch_size * seq_len / seconds


def _log(bar, m: dict) -> None:
    line = (f"step {m['step']:>6} | train {m['train_loss']:.3f} | val {m['val_loss']:.3f} | "
            f"ppl {m['val_ppl']:.2f} | {m['val_bpb']:.3f} bits/byte | sample: {m['sample'][:120]!r}")
    (bar.write if bar is not None else print)(line)


def _save(out: Path, model: GPT, optimizer, step: int, cfg: TrainConfig, model_cfg: ModelConfig, corpus: Corpus,
          token_counts: torch.Tensor, history: list) -> None:
    save_checkpoint(out, {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        "model_config": model_cfg.to_dict(), "train_config": asdict(cfg), "history": history,
        "data": {"source": corpus.source, "directory": str(corpus.directory), "position": f"step {step} of sampler seed {cfg.seed}",
                 "token_counts": token_counts},
    })
    (out.parent / "history.json").write_text(json.dumps(history, indent=1))
