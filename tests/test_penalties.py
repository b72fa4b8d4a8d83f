"""Penalties, biases and min_tokens: against a plain reference, row by row and token by token."""

import math
from collections import Counter

import pytest
import torch
from models import tiny_model

from minillm.engine import LLM, SamplingParams
from minillm.model.gpt import GPT
from minillm.decoding.penalties import adjust_logits_
from minillm.decoding.processors import PROCESSORS

EOS = 7


def reference(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: int | None) -> list[float]:
    """OpenAI's and vLLM's definitions, one token at a time in plain Python."""
    out = list(logits)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if len(output) < p.min_tokens:
        for token in [*p.stop_token_ids, *([eos] if eos is not None and not p.ignore_eos else [])]:
            out[token] = -math.inf
    counts = Counter(output)
    for token in range(len(out)):
        if p.repetition_penalty != 1 and (token in counts or token in prompt):
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= counts[token] * p.frequency_penalty + (counts[token] > 0) * p.presence_penalty
    return out


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(logit_bias={0: 100, 5: -100, 9: 3.5}),
    SamplingParams(min_tokens=4, stop_token_ids=[2, 3]),
    SamplingParams(min_tokens=4, ignore_eos=True),
    SamplingParams(min_tokens=1),  # output already long enough: nothing banned
    SamplingParams(),
]


def test_each_adjustment_matches_the_reference_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), 12, generator=g) * 3
    prompts = [torch.randint(12, (5,), generator=g).tolist() for _ in CASES]
    outputs = [torch.randint(12, (3,), generator=g).tolist() + [1, 1] for _ in CASES]
    # the requests' rows interleaved with rows of others, which must stay as they were
    got = torch.randn(2 * len(CASES), 12, generator=g)
    others = got[1::2].clone()
    got[0::2] = logits
    adjust_logits_(got, list(range(0, 2 * len(CASES), 2)), CASES, prompts, outputs, [EOS] * len(CASES))
    for i, (p, prompt, output) in enumerate(zip(CASES, prompts, outputs)):
        want = reference(logits[i].tolist(), p, prompt, output, EOS)
        assert got[2 * i].tolist() == pytest.approx(want, abs=1e-5), p
    assert torch.equal(got[2 * len(CASES) - 2], logits[-1])  # a row that adjusts nothing stays as it was
    assert torch.equal(got[1::2], others)


def test_penalties_never_touch_a_token_the_row_has_not_seen():
    logits = torch.full((1, 8), 2.0)
    p = SamplingParams(presence_penalty=1, frequency_penalty=1, repetition_penalty=2)
    adjust_logits_(logits, [0], [p], [[1]], [[3, 3]], [None])
    got = logits[0].tolist()
    assert got == [2.0, 1.0, 2.0, 2.0 / 2 - 2 - 1, 2.0, 2.0, 2.0, 2.0]


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model(context_length=96)


def greedy_reference(model: GPT, prompt: list[int], p: SamplingParams, eos: int) -> list[int]:
    """Greedy decoding with the reference adjustment, re-running the whole sequence each step."""
    ids, output = list(prompt), []
    with torch.no_grad():
        while len(output) < p.max_tokens:
            logits = model(torch.tensor([ids]))[0, -1].tolist()
            scores = reference(logits, p, prompt, output, eos)
            token = max(range(len(scores)), key=lambda t: (scores[t], -t))
            output.append(token)
            ids.append(token)
            if token == eos and not p.ignore_eos or token in p.stop_token_ids:
                break
    return output


def test_the_engine_applies_each_rows_adjustments_token_by_token(model: GPT):
    eos = LLM(model).engine.tokenizer.eot
    prompts = [[11, 12, 13], [100, 200, 300], [40, 41], [9, 9, 9, 9], [5, 6, 5, 6, 5]]
    base = dict(max_tokens=10, temperature=0)
    params = [
        SamplingParams(**base, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(**base, presence_penalty=2.0, ignore_eos=True),
        SamplingParams(**base, ignore_eos=True),  # a plain neighbour in the same batch
        SamplingParams(**base, logit_bias={eos: 100}, min_tokens=3),  # ends at once after min_tokens
        SamplingParams(**base, logit_bias={77: 40.0, 78: 39.0}, repetition_penalty=3.0, ignore_eos=True),
    ]
    outs = LLM(model).generate(prompts, params, use_tqdm=False)
    plain = SamplingParams(**base, ignore_eos=True)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == greedy_reference(model, prompt, p, eos), p
        if p.adjusts and not p.min_tokens:  # each adjustment changed what greedy decoding chose
            assert out.token_ids != greedy_reference(model, prompt, plain, eos), p
    assert len(outs[3].token_ids) == 4 and outs[3].token_ids[3] == eos
    assert eos not in outs[3].token_ids[:3]


def test_a_seeded_adjusted_request_ignores_its_neighbours(model: GPT):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=5, presence_penalty=1.0, logit_bias={3: 5}, ignore_eos=True)
    alone = LLM(model).generate([[5, 6, 7]], p, use_tqdm=False)[0].token_ids
    crowd = LLM(model).generate(
        [[1, 2], [5, 6, 7], [9] * 30],
        [SamplingParams(max_tokens=20, temperature=1.0, frequency_penalty=1.5), p, SamplingParams(max_tokens=3, temperature=0)],
        use_tqdm=False,
    )
    assert crowd[1].token_ids == alone


def test_a_batch_that_adjusts_nothing_never_adjusts(model: GPT, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a logits processor ran for a batch where no row asks")

    for processor in PROCESSORS:
        monkeypatch.setattr(processor, "apply_", refuse)
    outs = LLM(model).generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, temperature=0),
                                                     SamplingParams(max_tokens=5, temperature=0.7, seed=1)], use_tqdm=False)
    assert all(o.token_ids for o in outs)  # they ran, through a sampler that never adjusted


def test_logit_bias_outside_the_vocabulary_is_refused(model: GPT):
    with pytest.raises(ValueError, match="logit_bias"):
        LLM(model).engine.add_request("r", [1, 2], SamplingParams(logit_bias={model.cfg.vocab_size: 1}))
