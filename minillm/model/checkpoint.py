"""Checkpoints: everything needed to serve a model or to continue training it exactly.

A checkpoint is one ``torch.save`` file holding the model's weights and shape, the optimizer's
state, the step reached, the training settings and the data they read, and the history of
losses. It is written to a temporary file and renamed into place, so a run killed mid-write
leaves the previous checkpoint intact, never half of a new one. (Training one on first use is
``minillm.train.trainer.load_or_train``: training writes checkpoints, so it imports this module, never
the other way.)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT
from minillm.settings import CHECKPOINT_NAME, preset_dir, resolve_checkpoint

# Where checkpoints live is settings' business (the router reads it without torch); the
# chapters find it here, beside the loading it serves.
__all__ = ["CHECKPOINT_NAME", "load_model", "load_state", "model_from_state", "preset_dir", "save_checkpoint"]


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


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    return torch.load(resolve_checkpoint(path), map_location=map_location, weights_only=False)


def model_from_state(state: dict, device: str | torch.device = "cpu") -> GPT:
    """The trained model in a checkpoint, in eval mode, on ``device``."""
    model = GPT(ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def load_model(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    return model_from_state(load_state(path), device)
