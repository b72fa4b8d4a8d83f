"""A request's adjustments to a step's logits: penalties, biases and ``min_tokens``.

The sampler (:mod:`minillm.sampling`) chooses from logits; these change the logits first, row
by row, for the rows whose requests ask (:attr:`SamplingParams.adjusts`). A step where no row
asks never calls :func:`adjust_logits`, so plain requests pay nothing for the feature. Nothing
here draws a random number, so a seeded request stays reproducible whatever its neighbours ask.

The order, and each definition, follows vLLM (whose users' requests we want to mean the same
here) and OpenAI's documentation:

1. ``logit_bias``: the bias is added to its token's logit.
2. ``min_tokens``: while fewer tokens have been generated, the tokens that would end the
   request (end-of-text unless ``ignore_eos``, and ``stop_token_ids``) get ``-inf``.
3. ``repetition_penalty`` r (the CTRL paper's): every token seen in the prompt or the output
   has its logit divided by r if positive and multiplied by r if negative, so r > 1 always
   makes it less likely.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): a token generated c times
   loses ``c * f + (c > 0) * p``. Only the output counts, not the prompt.
"""

from __future__ import annotations

import torch

from minillm.sampling import SamplingParams


@torch.no_grad()
def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    eos_token_ids: list[int | None],
) -> torch.Tensor:
    """``logits`` (``[n, vocab]``, float) adjusted for each row's request; a new tensor.

    Row ``i`` belongs to a request with settings ``params[i]`` whose prompt is ``prompts[i]``
    and whose generated tokens so far are ``outputs[i]``; ``eos_token_ids[i]`` is its
    end-of-text token (``None``: it has none). Rows whose settings adjust nothing come back
    unchanged.
    """
    logits = logits.clone()
    n, vocab = logits.shape
    device = logits.device
    _add_biases(logits, params)
    _ban_early_stops(logits, params, outputs, eos_token_ids)
    counts = _token_counts(outputs, n, vocab, device)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((repetition != 1).any()):
        seen = (counts > 0) | (_token_counts(prompts, n, vocab, device) > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen & (repetition != 1), penalised, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * counts - presence * (counts > 0)


def _add_biases(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    ids = [t for p in params for t in p.logit_bias]
    biases = [b for p in params for b in p.logit_bias.values()]
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    logits.index_put_(index, torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)


def _ban_early_stops(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
                     eos_token_ids: list[int | None]) -> None:
    for i, (p, out, eos) in enumerate(zip(params, outputs, eos_token_ids)):
        if len(out) < p.min_tokens:
            banned = [*p.stop_token_ids, *([eos] if eos is not None and not p.ignore_eos else [])]
            logits[i, [t for t in banned if t < logits.shape[1]]] = float("-inf")


def _token_counts(rows: list[list[int]], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: ``[n, vocab]`` float counts."""
    counts = torch.zeros(n, vocab + 1, device=device)  # column ``vocab`` takes the padding
    width = max((len(r) for r in rows), default=0)
    if width:
        ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]
