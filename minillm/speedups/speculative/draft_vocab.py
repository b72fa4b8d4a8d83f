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

import json
import math
from pathlib import Path

import torch

from minillm.data.corpus import Corpus

COVERAGE = 0.9999  # the share of the training tokens that the kept ones must make up


def training_token_counts(state: dict) -> torch.Tensor | None:
    """How often each token id occurred in a checkpoint's training split: recorded by the
    trainer, or, for a checkpoint saved before it recorded them, counted from the corpus it
    names when that is still on disk, whole (None otherwise)."""
    data = state.get("data") or {}
    if data.get("token_counts") is not None:
        return data["token_counts"]
    directory = Path(data["directory"]) if data.get("directory") else None
    if directory is None or not (directory / "meta.json").is_file():  # written last: the cache is whole
        return None
    corpus = Corpus(directory, json.loads((directory / "meta.json").read_text()))
    return corpus.token_counts("train", state["model_config"]["vocab_size"])


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
