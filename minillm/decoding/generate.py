"""Generation without an engine: the three teaching baselines of chapters 5-7.

:func:`generate_naive` recomputes the whole sequence for every new token (``n^2``
token-forwards); :func:`generate_kv_cache` keeps keys and values in a
:class:`ContiguousKVCache`, one prefill then one token per step; :func:`generate_static_batch`
runs a left-padded batch until its longest request is done, the baseline continuous batching
(chapter 7) beats. All call the same ``GPT.forward`` and, greedy, must give the same tokens as
the paged engine.
"""

from __future__ import annotations

import torch

from minillm.model.gpt import GPT, KVCache, fused_attention
from minillm.decoding.sampling import SamplingParams, request_seed, sample


class ContiguousKVCache:
    """Keys and values of ``batch`` sequences, preallocated for ``max_len`` positions each, a
    bill fixed up front that chapter 8's paged blocks stop paying. The rows advance together,
    so shorter ones are left-padded: ``pad[i]`` leading slots of row ``i`` no real query sees.
    """

    def __init__(
        self,
        model: GPT,
        batch_size: int,
        max_len: int,
        *,
        pad: list[int] | None = None,
    ) -> None:
        cfg = model.cfg
        if not 1 <= max_len <= cfg.context_length:
            raise ValueError(f"max_len must be in 1..{cfg.context_length} (the model's context), got {max_len}")
        shape = (cfg.n_layers, batch_size, cfg.n_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)
        self.n_layers, self.max_len, self.length = cfg.n_layers, max_len, 0
        self.pad = None if not pad or not any(pad) else torch.tensor(pad, device=model.device)

    @property
    def nbytes(self) -> int:
        """Bytes reserved for keys and values, used or not."""
        return 2 * self.k.numel() * self.k.element_size()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; position {end - 1} does not fit")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        if layer == self.n_layers - 1:  # the last layer has stored its keys: the step is done
            self.length = end
        if self.pad is None:
            return fused_attention(q, keys, values)
        return _padded_attention(q, keys, values, self.pad)


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Causal attention where row ``i``'s first ``pad[i]`` keys are padding, masked out.

    A padding query sees only itself (it needs *some* key, or softmax over nothing is NaN);
    its output is never used, and no real query ever sees it.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    query_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]  # [Tq, 1]
    key_pos = torch.arange(tk, device=q.device)[None, :]  # [1, Tk]
    causal = key_pos <= query_pos
    real_key = key_pos[None] >= pad[:, None, None]  # [B, 1, Tk]
    allowed = (causal[None] & real_key) | (key_pos == query_pos)[None]  # [B, Tq, Tk]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])


def last_logits(
    model: GPT, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None
) -> torch.Tensor:
    """Logits of each row's last position only, ``[batch, vocab]``. Generation never needs the
    others, and the output matrix is the largest matmul of a small model: applying it to a
    200-token prompt's every position would cost 200 times what one position costs."""
    return model.logits(model.hidden_states(tokens, positions, cache)[:, -1])


def choose_token(logits: torch.Tensor, temperature: float, top_k: int | None, seed: int | None, position: int) -> int:
    """One token from one row of logits, by the engine's own sampler: the draw ``seed`` makes
    for ``position``, the index the token will have in its sequence, as in the engine (without
    a seed, a sampled token's is drawn from torch's global generator)."""
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, seed=seed)
    return int(sample(logits[None], [params], [request_seed(params)], [position])[0])


def check_prompt(model: GPT, prompt: list[int], max_new_tokens: int, *, slide: bool) -> None:
    """A ``ValueError`` for a prompt these loops cannot continue (unless ``slide``, one whose
    answer would outgrow the context)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token (e.g. <|endoftext|>)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not slide and len(prompt) + max_new_tokens > model.cfg.context_length:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {model.cfg.context_length} tokens"
        )


@torch.no_grad()
def generate_naive(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | None = None,
    seed: int | None = None,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns only the new ones.

    Every step runs the model over the whole sequence so far and keeps only the last
    position's logits. The window slides when the sequence outgrows the model's context.
    Generation stops after ``stop_token``, by the engine's own stop rule
    (:meth:`SamplingParams.finish_reason`). Sampled (``temperature`` > 0), the same ``seed``
    gives the same tokens: token ``j`` of the sequence is drawn by ``(seed, j)``.
    """
    check_prompt(model, prompt, max_new_tokens, slide=True)
    if max_new_tokens == 0:
        return []
    rule = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    seed = request_seed(rule)  # one for the whole loop, as the engine keeps one per request
    ids, new = list(prompt), []
    while True:
        window = torch.tensor([ids[-model.cfg.context_length :]], device=model.device)
        token = choose_token(last_logits(model, window)[0], temperature, top_k, seed, len(ids))
        ids.append(token)
        new.append(token)
        if rule.finish_reason(token, len(new), stop_token):
            return new


@torch.no_grad()
def generate_kv_cache(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_token: int | None = None,
    seed: int | None = None,
) -> list[int]:
    """The same as :func:`generate_naive`, with a KV cache: one prefill, then one token per step.

    The cache is reserved for ``len(prompt) + max_new_tokens`` positions, which must fit the
    model's context (the cache cannot slide: its keys were computed at their positions).
    """
    check_prompt(model, prompt, max_new_tokens, slide=False)
    if max_new_tokens == 0:
        return []
    rule = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    seed = request_seed(rule)  # one for the whole loop, as the engine keeps one per request
    device = model.device
    cache = ContiguousKVCache(model, 1, len(prompt) + max_new_tokens)
    logits = last_logits(model, torch.tensor([prompt], device=device), cache=cache)[0]
    new: list[int] = []
    while True:
        token = choose_token(logits, temperature, top_k, seed, len(prompt) + len(new))
        new.append(token)
        if rule.finish_reason(token, len(new), stop_token):
            return new
        position = torch.tensor([[cache.length]], device=device)
        logits = last_logits(model, torch.tensor([[token]], device=device), position, cache)[0]


@torch.no_grad()
def generate_static_batch(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    *,
    stop_token: int | None = None,
    pad_token: int = 0,
) -> list[list[int]]:
    """Greedy generation for a fixed batch, the way static batching works: prompts left-padded
    so one ``[batch, 1]`` forward serves every row, until the *longest* request is done (rows
    that finish early keep their slot, and nobody joins mid-way). Returns each prompt's new
    tokens, cut at its own limit or stop token.
    """
    if not prompts:
        return []
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(limits)} max_new_tokens")
    for prompt, limit in zip(prompts, limits):
        check_prompt(model, prompt, limit, slide=False)
    device = model.device
    longest, steps = max(map(len, prompts)), max(limits)
    if steps == 0:
        return [[] for _ in prompts]
    pad = [longest - len(p) for p in prompts]
    tokens = torch.tensor([[pad_token] * n + p for n, p in zip(pad, prompts)], device=device)
    pad_t = torch.tensor(pad, device=device)
    positions = (torch.arange(longest, device=device)[None, :] - pad_t[:, None]).clamp(min=0)
    cache = ContiguousKVCache(model, len(prompts), longest + steps, pad=pad)
    logits = last_logits(model, tokens, positions, cache)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [limit == 0 for limit in limits]
    rules = [SamplingParams(max_tokens=max(limit, 1)) for limit in limits]  # (a row of limit 0 is done)
    for step in range(steps):
        next_tokens = logits.argmax(dim=-1)
        for i, token in enumerate(next_tokens.tolist()):
            if not done[i]:
                outputs[i].append(token)
                done[i] = rules[i].finish_reason(token, len(outputs[i]), stop_token) is not None
        if all(done) or step == steps - 1:
            break
        positions = (cache.length - pad_t)[:, None]
        logits = last_logits(model, next_tokens[:, None], positions, cache)
    return outputs
