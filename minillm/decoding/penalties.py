"""A request's adjustments to a step's logits: penalties, biases and ``min_tokens``.

They change the logits before the sampler, for the rows that ask (:attr:`SamplingParams.adjusts`),
and draw no random number, so a seeded request stays reproducible. The order and each
definition follow vLLM and OpenAI's documentation:

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

from minillm.decoding.sampling import SamplingParams


@torch.no_grad()
def adjust_logits_(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    eos_token_ids: list[int | None],
) -> None:
    """Adjust ``logits`` (``[n, vocab]``, float) in place, row ``rows[i]`` for request ``i``.

    Only the tokens concerned are read and written, by index where they lie: a dense pass over
    the vocabulary would cost more than the rest of a decode step (about 1.6 ms a row for
    GPT-2's on a 2-core CPU), and so would copying the rows out and back.
    """
    device = logits.device
    where = torch.tensor(rows, dtype=torch.long, device=device)
    _add_biases(logits, rows, params)
    _ban_early_stops(logits, rows, params, outputs, eos_token_ids)
    vocab = logits.shape[1]
    repeats = [p.repetition_penalty != 1 for p in params]
    if any(repeats):
        local, ids, _ = _occurrences([prompt + out if r else [] for prompt, out, r in zip(prompts, outputs, repeats)],
                                     vocab, device)
        r = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=logits.dtype)[local]
        at = where[local]
        values = logits[at, ids]
        logits[at, ids] = torch.where(values > 0, values / r, values * r)
    counted = [bool(p.frequency_penalty or p.presence_penalty) for p in params]
    if any(counted):
        local, ids, counts = _occurrences([out if c else [] for out, c in zip(outputs, counted)], vocab, device)
        f = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)[local]
        pr = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)[local]
        logits.index_put_((where[local], ids), -(f * counts.to(logits.dtype) + pr), accumulate=True)


def _occurrences(lists: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The distinct ``(row, token)`` pairs in ``lists`` (row ``i`` holds ``lists[i]``) and how
    often each occurs: one tensor built from one flat list, deduplicated by ``torch.unique``."""
    lengths = torch.tensor([len(x) for x in lists], device=device)
    flat = torch.tensor([t for x in lists for t in x], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)
    keys, counts = torch.unique(rows * vocab + flat, return_counts=True)
    return keys // vocab, keys % vocab, counts


def _add_biases(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    at = [row for row, p in zip(rows, params) for _ in p.logit_bias]
    if not at:
        return
    ids = [t for p in params for t in p.logit_bias]
    biases = [b for p in params for b in p.logit_bias.values()]
    device = logits.device
    index = (torch.tensor(at, device=device), torch.tensor(ids, device=device))
    logits.index_put_(index, torch.tensor(biases, device=device, dtype=logits.dtype), accumulate=True)


def _ban_early_stops(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], outputs: list[list[int]],
                     eos_token_ids: list[int | None]) -> None:
    for row, p, out, eos in zip(rows, params, outputs, eos_token_ids):
        if len(out) < p.min_tokens:
            banned = [*p.stop_token_ids, *([eos] if eos is not None and not p.ignore_eos else [])]
            logits[row, [t for t in banned if t < logits.shape[1]]] = float("-inf")
