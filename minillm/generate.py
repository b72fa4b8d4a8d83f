"""Generation, the obvious way first: feed the whole sequence back in for every new token.

This is the naive loop of chapter 5. It recomputes every earlier position's keys and values at
every step, so producing ``n`` tokens costs on the order of ``n^2`` token-forwards; the KV cache
(chapter 6) removes that waste. It stays here as the reference every faster path is checked
against: given the same model and greedy decoding, they must produce the same tokens.
"""

from __future__ import annotations

import torch

from minillm.model import GPT


@torch.no_grad()
def generate_naive(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns only the new ones.

    ``temperature == 0`` is greedy (always the most likely token). Otherwise logits are divided
    by the temperature, optionally cut to the ``top_k`` largest, and sampled. The window slides
    when the sequence outgrows the model's context. Generation stops after ``stop_token``.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token (e.g. <|endoftext|>)")
    device = next(model.parameters()).device
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-model.cfg.context_length:]], device=device)
        logits = model(window)[0, -1].float()
        if temperature == 0.0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        ids.append(token)
        new.append(token)
        if token == stop_token:
            break
    return new
