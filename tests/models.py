"""Small models the tests share."""

from __future__ import annotations

import torch

from minillm.model.config import ModelConfig, get_preset
from minillm.model.gpt import GPT


def tiny_model(context_length: int = 128) -> GPT:
    """A small random model with large weights: peaky logits, so greedy decoding has no
    near-ties for batching or rounding to break differently."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(context_length=context_length, d_model=64, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return m


def lively_tiny() -> GPT:
    """A random tiny model whose greedy continuations vary. At GPT-2's initialisation a tiny
    model repeats one token, its top two logits a thousandth apart; larger weights (biases and
    norms included, so every tensor matters) and a sharper final LayerNorm give it changing
    tokens, each step's winner clear by a margin."""
    torch.manual_seed(0)
    m = GPT(get_preset("tiny"))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.startswith("tok_emb"):
                p.add_(0.3 * torch.randn_like(p))
        m.ln_f.weight.mul_(20)
    return m.eval()
