"""response_format through the official ``openai`` client: answers that parse and validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from models import tiny_model
from test_server_live import live_server, small_engine
from test_structured import SCHEMAS

from minillm.data.tokenizer import get_tokenizer
from minillm.decoding.sampling import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about your pet."}]


@pytest.fixture(scope="module")
def client():
    with live_server(small_engine(tiny_model())) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", ["record", "nested"])
def test_chat_answers_follow_the_schema_whole_and_streamed(client, name: str) -> None:
    whole = client.chat.completions.create(model="minillm", messages=CHAT, n=3, temperature=1.0, seed=7,
                                           max_tokens=80, response_format=schema_format(name))
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    stream = client.chat.completions.create(model="minillm", messages=CHAT, temperature=1.0, seed=7, max_tokens=80,
                                            response_format=schema_format(name), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content  # choice 0 draws with the same seed


def test_a_request_with_n_choices_is_checked_once_and_its_schema_compiled_once(client, monkeypatch) -> None:
    """The server checks the schema on arrival and the engine gives each of the three choices
    its own matcher, from one compilation; ``SamplingParams`` are checked once, each choice
    taking only its seed. Counted where llguidance compiles and where the checks run."""
    import llguidance

    real, compiled, checked = llguidance.LLMatcher, [], []

    class Counting:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

        def __new__(cls, *args, **kwargs):
            compiled.append(args[1])
            return real(*args, **kwargs)

    check = SamplingParams.__post_init__
    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: (checked.append(self), check(self))[1])
    fmt = {"type": "json_schema", "json_schema": {"name": "once", "schema": {**SCHEMAS["nested"], "title": "n=3"}}}
    whole = client.chat.completions.create(model="minillm", messages=CHAT, n=3, temperature=1.0, seed=11,
                                           max_tokens=80, response_format=fmt)
    assert len(compiled) == 1 and len(checked) == 1
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["nested"])


def test_completions_json_object_is_an_object(client) -> None:
    """vLLM's extension: response_format on the completions endpoint too. A bias toward the
    quote and the brace lets the random model close its object within the budget."""
    bias = {str(get_tokenizer().encode(s)[0]): 8 for s in ['"', '"}', '}', '":']}
    out = client.completions.create(model="minillm", prompt="Once upon a time", max_tokens=80, temperature=1.0,
                                    seed=3, logit_bias=bias, extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].text), dict)


def test_a_schema_it_cannot_enforce_is_a_400_naming_response_format(client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="minillm", messages=CHAT, max_tokens=8, response_format=bad)
    assert err.value.body["param"] == "response_format"
    ok = client.chat.completions.create(model="minillm", messages=CHAT, max_tokens=8, temperature=0)
    assert ok.choices[0].message.content  # the server is still up, serving plain text
