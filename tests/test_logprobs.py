"""Logprobs and prompt logprobs from the engine equal a log-softmax of the model's own logits."""

import pytest
import torch
from models import tiny_model

from minillm.engine import LLM, SamplingParams
from minillm.decoding.logprobs import TokenLogprobs
from minillm.model.gpt import GPT

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model(context_length=96)


def log_softmax_rows(model: GPT, ids: list[int]) -> torch.Tensor:
    """Row ``p``: the model's log-probabilities for the token after position ``p``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def check(scored: list[TokenLogprobs], rows: torch.Tensor, tokens: list[int], k: int) -> None:
    assert [s.token_id for s in scored] == tokens
    for s, row in zip(scored, rows):
        assert s.logprob == pytest.approx(float(row[s.token_id]), abs=TOLERANCE)
        assert len(s.top) == k
        values, ids = row.topk(k) if k else (row[:0], row[:0].long())
        assert [t for t, _ in s.top] == ids.tolist()  # the alternatives, most likely first
        assert [v for _, v in s.top] == pytest.approx(values.tolist(), abs=TOLERANCE)


PROMPTS = [[5, 6, 7, 8], [100, 200], list(range(300, 340)), [9] * 17]
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=1.5, top_k=3, seed=4, logprobs=2, ignore_eos=True),  # raw, not tempered
    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),  # asks for none
    SamplingParams(max_tokens=7, temperature=0.7, seed=1, logprobs=0, presence_penalty=2, ignore_eos=True),
]


@pytest.mark.parametrize("options", [{}, {"num_blocks": 14, "block_size": 4}, {"max_num_batched_tokens": 8}],
                         ids=["batched", "preempted", "chunked"])
def test_generated_logprobs_equal_the_models_log_softmax(model: GPT, options: dict):
    llm = LLM(model, **options)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert (llm.engine.stats().preemptions > 0) == ("num_blocks" in options)
    for prompt, p, out in zip(PROMPTS, PARAMS, outs):
        if p.logprobs is None:
            assert out.logprobs == []
            continue
        rows = log_softmax_rows(model, prompt + out.token_ids)[len(prompt) - 1 : -1]
        check(out.logprobs, rows, out.token_ids, p.logprobs)


def test_a_request_alone_and_in_a_batch_reports_the_same_logprobs(model: GPT):
    alone = LLM(model).generate([PROMPTS[0]], PARAMS[0], use_tqdm=False)[0]
    batched = LLM(model).generate(PROMPTS, PARAMS, use_tqdm=False)[0]
    assert alone.token_ids == batched.token_ids
    for a, b in zip(alone.logprobs, batched.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=TOLERANCE)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8},
                                     {"num_blocks": 13, "block_size": 4, "max_num_batched_tokens": 8}],
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_score_every_prompt_token_after_the_first(model: GPT, options: dict):
    """Preempted (with 13 blocks), the scored request loses its blocks in the middle of its
    prefill, several times, and scores its prompt again from the start."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=0, prompt_logprobs=1)]
    prompts = [PROMPTS[3], PROMPTS[2], PROMPTS[0]]
    llm = LLM(model, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert (llm.engine.stats().preemptions > 0) == ("num_blocks" in options)
    for prompt, p, out in list(zip(prompts, params, outs))[1:]:
        check(out.prompt_logprobs, log_softmax_rows(model, prompt)[:-1], prompt[1:], p.prompt_logprobs)
    assert outs[2].token_ids == [] and outs[2].finish_reason == "length"  # scored, nothing generated
    assert outs[0].prompt_logprobs == []


def test_a_prompt_in_the_prefix_cache_is_still_scored(model: GPT):
    llm = LLM(model, block_size=4)
    prompt = PROMPTS[2]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # fills the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    check(out.prompt_logprobs, log_softmax_rows(model, prompt)[:-1], prompt[1:], 0)


def test_speculation_steps_aside_for_a_request_with_logprobs(model: GPT):
    llm = LLM(model, speculative_draft="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=8)
    prompt = [5, 6, 7] * 8  # prompt lookup would draft plenty here
    out = llm.generate([prompt], PARAMS[0], use_tqdm=False)[0]
    check(out.logprobs, log_softmax_rows(model, prompt + out.token_ids)[len(prompt) - 1 : -1], out.token_ids, 5)
    assert llm.engine.speculator.stats.drafted == 0


def test_scoring_a_one_token_prompt_without_generating_is_refused(model: GPT):
    with pytest.raises(ValueError, match="max_tokens=0"):
        LLM(model).engine.add_request("r", [1], SamplingParams(max_tokens=0, prompt_logprobs=0))
