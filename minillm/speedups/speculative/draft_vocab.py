"""The tokens a draft model may propose: those it learned, not the whole vocabulary.

A draft model's step is mostly the read of its output matrix, one row per token of the
vocabulary (97% of the ``draft`` preset's parameters), and most of those rows are tokens that
never occurred in its training text: it cannot guess them well, and the target rarely wants
them. Scoring only the tokens that make up nearly all of the training text (here, by
default, every token but the rarest that together make up a ten-thousandth of it) shrinks
the draft's step to its layers, and loses only the guesses it would almost never have made.
FR-Spec (Zhao et al., 2025) and EAGLE-3 cut their drafts' vocabularies the same way, and
SGLang takes such a list of tokens as ``--speculative-token-map``.

The acceptance rule does not care which tokens a draft could propose: a token outside the
list has probability 0 under the draft, so the residual distribution gives the target's whole
probability to it when the target wants it (chapter 15's proof holds for any draft). Greedy
output stays the target's alone, and sampled output keeps the target's distribution.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

COVERAGE = 0.9999  # the share of the training tokens that the kept ones must make up


def training_token_counts(state: dict) -> torch.Tensor | None:
    """How often each token id occurred in a checkpoint's training split: recorded by the
    trainer, or, for a checkpoint saved before it recorded them, counted from the corpus it
    names when that is still on disk (None otherwise)."""
    data = state.get("data") or {}
    if data.get("token_counts") is not None:
        return data["token_counts"]
    path = Path(data.get("directory", "")) / "train.bin"
    if not data.get("directory") or not path.is_file():
        return None
    vocab_size = state["model_config"]["vocab_size"]
    counts = np.bincount(np.memmap(path, dtype=np.uint16, mode="r"), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts.astype(np.int64))


def draft_vocabulary(counts: torch.Tensor, coverage: float = COVERAGE) -> torch.Tensor:
    """The ids of the most frequent tokens that together make up ``coverage`` of ``counts``'
    total, most frequent first (every token that occurred, for ``coverage=1``)."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no token was counted")
    order = torch.argsort(counts, descending=True, stable=True)
    covered = torch.cumsum(counts[order], dim=0)
    kept = int(torch.searchsorted(covered, torch.tensor(math.ceil(coverage * total)))) + 1
    return order[:min(kept, int((counts > 0).sum()))]
