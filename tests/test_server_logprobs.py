"""Logprobs, echo, penalties and usage details through the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch
from models import tiny_model
from test_server_live import live_server, small_engine

from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer

TOLERANCE = 1e-4
GREEDY = dict(model="minillm", temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model()


@pytest.fixture(scope="module")
def client(model: GPT):
    with live_server(small_engine(model)) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def rows(model: GPT, ids: list[int]) -> torch.Tensor:
    """Row ``p``: the in-process log-softmax for the token after position ``p``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)


def token_ids(texts: list[str]) -> list[int]:
    tok = get_tokenizer()
    ids = [tok.encode(t) for t in texts]
    assert all(len(i) == 1 for i in ids), texts  # each token string maps back to its one token
    return [i[0] for i in ids]


def check_completion(model: GPT, prompt: str, text: str, logprobs, k: int) -> None:
    ids = get_tokenizer().encode(prompt)
    out = token_ids(logprobs.tokens)
    assert get_tokenizer().decode(out) == text
    want = rows(model, ids + out)[len(ids) - 1 : -1]
    for i, (token, lp, top) in enumerate(zip(out, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert lp == pytest.approx(float(want[i, token]), abs=TOLERANCE)
        best = want[i].topk(k)
        for (tok_text, value), best_id, best_value in zip(list(top.items())[:k], best.indices, best.values):
            assert token_ids([tok_text]) == [int(best_id)] and value == pytest.approx(float(best_value), abs=TOLERANCE)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(out))]


def test_completion_logprobs_equal_the_models_log_softmax(client, model: GPT) -> None:
    prompt = "Once upon a time"
    whole = client.completions.create(prompt=prompt, logprobs=3, **GREEDY)
    check_completion(model, prompt, whole.choices[0].text, whole.choices[0].logprobs, 3)
    streamed = list(client.completions.create(prompt=prompt, logprobs=3, stream=True, **GREEDY))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset
    assert values == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=TOLERANCE)


def test_logprobs_are_the_same_alone_and_in_a_crowd(client, model: GPT) -> None:
    prompt = "The little dog"
    alone = client.completions.create(prompt=prompt, logprobs=2, **GREEDY).choices[0].logprobs
    neighbours = [dict(prompt=f"Story {i}:", max_tokens=12, temperature=1.0, model="minillm",
                       frequency_penalty=1.0, logprobs=i % 3) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        futures = [pool.submit(client.completions.create, **n) for n in neighbours]
        crowd = pool.submit(client.completions.create, prompt=prompt, logprobs=2, **GREEDY).result()
        assert all(f.result().choices[0].logprobs for f in futures)
    assert crowd.choices[0].logprobs.tokens == alone.tokens
    assert crowd.choices[0].logprobs.token_logprobs == pytest.approx(alone.token_logprobs, abs=TOLERANCE)
    check_completion(model, prompt, crowd.choices[0].text, crowd.choices[0].logprobs, 2)


def test_chat_logprobs_have_the_chat_shape(client, model: GPT) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=4, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 4 and bytes(c.bytes).decode() == c.token for c in content)
    assert all([t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
               for c in content)
    streamed = list(client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=4, stream=True,
                                                   **GREEDY))
    pieces = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in pieces] == [c.token for c in content]
    assert [c.logprob for c in pieces] == pytest.approx([c.logprob for c in content], abs=TOLERANCE)
    plain = client.chat.completions.create(messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def test_echo_scores_the_prompt_without_generating(client, model: GPT) -> None:
    prompt = "Once upon a time there was a cat"
    ids = get_tokenizer().encode(prompt)
    scored = client.completions.create(model="minillm", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert token_ids(choice.logprobs.tokens) == ids
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    want = rows(model, ids)
    for p in range(1, len(ids)):
        assert choice.logprobs.token_logprobs[p] == pytest.approx(float(want[p - 1, ids[p]]), abs=TOLERANCE)
    # As an evaluation harness asks: the prompt's scores, then one generated token's.
    both = client.completions.create(model="minillm", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = both.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and both.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[1:-1] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=TOLERANCE)
    echoed = client.completions.create(model="minillm", prompt=prompt, echo=True, max_tokens=2, temperature=0)
    assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].logprobs is None


def test_penalties_and_bias_reach_the_sampler(client) -> None:
    tok = get_tokenizer()
    plain = client.completions.create(prompt="Once", **GREEDY).choices[0].text
    banned = tok.encode(plain)[0]
    biased = client.completions.create(prompt="Once", logit_bias={str(banned): -100}, **GREEDY).choices[0].text
    assert tok.encode(biased)[0] != banned
    forced = client.completions.create(prompt="Once", logit_bias={"13": 100}, **GREEDY).choices[0].text
    assert forced == "." * 6
    repeated = client.completions.create(prompt="Once", logit_bias={"13": 100}, frequency_penalty=2.0,
                                         presence_penalty=2.0, **GREEDY).choices[0].text
    assert repeated == "." * 6  # a bias of 100 outweighs penalties of at most 4 per token


def test_usage_reports_the_prefix_cache(client) -> None:
    prompt = "Once upon a time, in a land far away, there lived a little girl who loved the sea and its waves."
    client.completions.create(prompt=prompt, **GREEDY)
    again = client.completions.create(prompt=prompt, **GREEDY)
    cached = again.usage.prompt_tokens_details.cached_tokens
    block = 8  # small_engine's block size
    assert cached == (again.usage.prompt_tokens - 1) // block * block > 0


def test_refusals_and_accepted_no_ops(client) -> None:
    for extra, param in [({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
                         ({"response_format": {"type": "regex"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(prompt="hi", extra_body=extra, model="minillm")
        assert bad.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model="minillm",
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert bad.value.body["param"] == "tools"
    ok = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], model="minillm", max_tokens=2,
                                        store=False, metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=False,
                                        response_format={"type": "text"})
    assert ok.choices[0].message.content is not None
