"""Checkpoints: everything needed to serve a model or to continue training it exactly.

A checkpoint is one ``torch.save`` file holding the model's weights and shape, the optimizer's
state, the step reached, the training settings and the data they read, and the history of
losses. It is written to a temporary file and renamed into place, so a run killed mid-write
leaves the previous checkpoint intact, never half of a new one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minillm.config import ModelConfig
from minillm.model import GPT
from minillm.settings import checkpoints_dir

CHECKPOINT_NAME = "ckpt.pt"


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` atomically: to ``path.tmp``, flushed to disk, then renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def resolve(path: str | Path) -> Path:
    """A checkpoint file, given the file itself or the directory ``--out`` wrote."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    return torch.load(resolve(path), map_location=map_location, weights_only=False)


def model_from_state(state: dict, device: str | torch.device = "cpu") -> GPT:
    """The trained model in a checkpoint, in eval mode, on ``device``."""
    model = GPT(ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def load_model(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    return model_from_state(load_state(path), device)


def preset_dir(preset: str) -> Path:
    """Where ``python -m minillm.train --preset NAME`` writes by default."""
    return checkpoints_dir() / preset


def load_or_train(preset: str, device: str | torch.device | None = None) -> GPT:
    """The newest trained model of a preset; trains it first (with a progress bar) if none exists.

    Later chapters and the server start here, so a reader who skipped training still gets a
    model, and one who trained gets theirs.
    """
    from minillm.hardware import default_device
    from minillm.train import TrainConfig, train

    device = device or default_device()
    path = preset_dir(preset) / CHECKPOINT_NAME
    if not path.is_file():
        print(f"No trained '{preset}' model in {path.parent}; training one now.", flush=True)
        train(TrainConfig(preset=preset, out=str(path.parent)))
    return load_model(path, device)
