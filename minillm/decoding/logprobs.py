"""What the model thought of each token: log-probabilities, computed in the step that made it.

A client that asks for ``logprobs`` gets, for every position, the log-probability of the
token that was chosen there and of the model's few most likely alternatives. They are the
model's own distribution, a float32 log-softmax of the raw logits, before penalties,
temperature and top-k/top-p change what the sampler draws from (vLLM's default,
``raw_logprobs``): so they answer "how likely did the model find this text?", the question an
evaluation harness asks, whatever sampling settings produced the text.

They come from the logits the step computed anyway, never from a second forward pass: the
cost is one log-softmax and one top-k over the rows that asked, and one transfer to the host.
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
