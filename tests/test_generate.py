"""The teaching baselines: the KV cache and static batching give the naive loop's tokens."""

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.decoding.generate import ContiguousKVCache, generate_kv_cache, generate_naive, generate_static_batch
from minillm.decoding.sampling import SamplingParams
from minillm.engine import LLM
from minillm.model.gpt import GPT


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    # A larger init spread than GPT-2's makes logits peaky, so greedy argmax has no near-ties.
    m = GPT(ModelConfig(vocab_size=97, context_length=48, d_model=32, n_layers=2, n_heads=4)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return m


PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9], list(range(20, 40)), [42, 7]]


def test_kv_cache_matches_naive(model: GPT) -> None:
    for prompt in PROMPTS:
        assert generate_kv_cache(model, prompt, 16) == generate_naive(model, prompt, 16)


def test_kv_cache_logits_match_full_forward(model: GPT) -> None:
    """Prefill then one token at a time gives the full forward's logits at every position."""
    tokens = torch.tensor([list(range(3, 30))])
    full = model(tokens)
    cache = ContiguousKVCache(model, 1, tokens.shape[1])
    steps = [model(tokens[:, :10], cache=cache)]
    for t in range(10, tokens.shape[1]):
        steps.append(model(tokens[:, t : t + 1], torch.tensor([[t]]), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_sampled_loops_and_the_engine_draw_the_same_tokens_with_the_same_seed(model: GPT) -> None:
    """Every loop draws token ``j`` of a sequence by ``(seed, j)``, as the engine does, so one
    seed gives one continuation whichever way it is computed; another seed, another one."""
    kwargs = dict(temperature=1.0, top_k=20)
    naive = generate_naive(model, [3, 4], 12, seed=7, **kwargs)
    assert generate_kv_cache(model, [3, 4], 12, seed=7, **kwargs) == naive
    params = SamplingParams(max_tokens=12, seed=7, ignore_eos=True, **kwargs)
    assert LLM(model, block_size=8).generate([[3, 4]], params, use_tqdm=False)[0].token_ids == naive
    assert generate_kv_cache(model, [3, 4], 12, seed=8, **kwargs) != naive
    torch.manual_seed(1)
    unseeded = generate_naive(model, [3, 4], 12, **kwargs)
    torch.manual_seed(1)
    assert generate_kv_cache(model, [3, 4], 12, **kwargs) == unseeded  # one seed drawn from torch's generator


def test_stop_token_ends_generation_by_one_rule_in_every_loop(model: GPT) -> None:
    """The loops and the engine share one stop rule (``SamplingParams.finish_reason``): each
    stops at the stop token's first appearance, keeping it, and a limit of 0 gives nothing."""
    full = generate_naive(model, [1, 2, 3], 12)
    stop = full[4]
    want = full[: full.index(stop) + 1]
    assert generate_naive(model, [1, 2, 3], 12, stop_token=stop) == want
    assert generate_kv_cache(model, [1, 2, 3], 12, stop_token=stop) == want
    assert generate_static_batch(model, [[1, 2, 3]], 12, stop_token=stop) == [want]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    (engine,) = LLM(model, num_blocks=16, block_size=8).generate([[1, 2, 3]], params, use_tqdm=False)
    assert (engine.token_ids, engine.finish_reason) == (want, "stop")
    assert generate_naive(model, [1, 2, 3], 0) == generate_kv_cache(model, [1, 2, 3], 0) == []


def test_static_batch_matches_naive_with_mixed_lengths(model: GPT) -> None:
    limits = [16, 3, 9, 1, 12]
    batched = generate_static_batch(model, PROMPTS, limits)
    assert batched == [generate_naive(model, p, n) for p, n in zip(PROMPTS, limits)]


def test_padding_never_leaks_into_real_rows(model: GPT) -> None:
    """The short prompt's output must not depend on the pad token's value."""
    a = generate_static_batch(model, [[1, 2], list(range(30, 45))], 8, pad_token=0)
    b = generate_static_batch(model, [[1, 2], list(range(30, 45))], 8, pad_token=96)
    assert a == b


def test_cache_refuses_what_does_not_fit(model: GPT) -> None:
    with pytest.raises(ValueError, match="context"):
        generate_kv_cache(model, list(range(40)), 9)  # 49 > 48 positions
    with pytest.raises(ValueError, match="at least one token"):
        generate_static_batch(model, [[1], []], 4)
    cache = ContiguousKVCache(model, 1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)


def test_cache_memory_bill(model: GPT) -> None:
    cfg = model.cfg
    cache = ContiguousKVCache(model, 3, 40)
    assert cache.nbytes == 2 * cfg.n_layers * 3 * 40 * cfg.d_model * 4
