"""``python -m minillm.train``: the training command line (flags map one-to-one onto ``TrainConfig``)."""

from __future__ import annotations

import torch

from minillm.model.checkpoint import preset_dir
from minillm.train.trainer import TrainConfig, resolve, train


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    from minillm.cli import ArgumentParser
    from minillm.model.config import PRESETS

    p = ArgumentParser(prog="python -m minillm.train", description="Train a GPT on the story corpus.")
    p.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model size (default: cpu)")
    p.add_argument("--data", default="auto", help="auto | tinystories | synthetic | path to .txt/.jsonl")
    p.add_argument("--max-stories", type=int, help="training stories to take from the corpus")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: the preset's)")
    p.add_argument("--max-tokens", type=int, help="train on this many tokens instead of --max-steps")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warm-up steps")
    p.add_argument("--eval-every", type=int, help="steps between evaluations and checkpoints")
    p.add_argument("--out", help="checkpoint directory (default: checkpoints/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--stop-after", type=int, help="end this run after N steps; continue later with --resume")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the best available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="autocast dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    return TrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    from minillm.cli import UsageError
    from minillm.data.corpus import CorpusUnavailable

    cfg = parse_args(argv)
    try:
        if cfg.device:
            torch.empty(0, device=cfg.device)
        resolve(cfg)
        metrics = train(cfg)
    except (ValueError, FileNotFoundError, CorpusUnavailable, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not _is_user_error(err):
            raise
        raise UsageError(str(err).splitlines()[0]) from None
    if metrics and "val_loss" in metrics:
        print(f"done: step {metrics['step']}, val loss {metrics['val_loss']:.3f}, {metrics['val_bpb']:.3f} bits/byte -> {cfg.out or preset_dir(cfg.preset)}")
    return 0


def _is_user_error(err: RuntimeError) -> bool:
    """A bad --device shows up as a RuntimeError from torch; anything else is a real bug."""
    text = str(err)
    return "device" in text.lower() or "Expected one of" in text


if __name__ == "__main__":
    from minillm.cli import run

    run(main, prog="python -m minillm.train")
