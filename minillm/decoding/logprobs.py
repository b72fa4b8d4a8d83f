"""What the model thought of each token: log-probabilities, computed in the step that made it.

They are the raw logits' log-softmax, before penalties, temperature and filters (vLLM's
``raw_logprobs``): "how likely did the model find this text?", what an evaluation harness
asks, whatever settings sampled it. They cost no second forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the ``top`` alternatives as
    ``(token id, logprob)`` pairs, most likely first (the token itself may be among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor | list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` (``[n, vocab]``, raw) scored at ``tokens[i]``, with its
    ``num_top[i]`` most likely alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.as_tensor(tokens, device=logprobs.device).long()
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    widest = max(num_top, default=0)
    top_values, top_ids = (torch.topk(logprobs, widest, dim=-1) if widest else (logprobs[:, :0], tokens[:, None][:, :0]))
    values, ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, lp, tuple(zip(i[:k], v[:k])))
            for t, lp, i, v, k in zip(tokens.tolist(), chosen, ids, values, num_top)]
