"""The server's settings and wire format, without a server: flags, environment, parsing."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import pytest
import torch

from minillm.cli import UsageError
from minillm.model.gpt import GPT
from minillm.data.tokenizer import Tokenizer, get_tokenizer
from server.config import ServerConfig, build_parser, env_name, parse_args
from server.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, MAX_CHOICES, MAX_STOP_CHARS, MAX_STOPS, MAX_TEMPERATURE,
                             GenerationRequest, ModelCard, chat_prompt, parse_chat, parse_completion)
from server.responses import Responses
from server.wire import OpenAIError, sse
from test_server import CONTEXT, model, run, serving  # noqa: F401 (model is a fixture)

CARD = ModelCard("minillm", max_model_len=128, vocab_size=50257)


def test_flags_environment_and_precedence() -> None:
    env = {"MINILLM_PORT": "9001", "MINILLM_API_KEY": "k", "MINILLM_KV_CACHE_MEMORY": "64MiB", "MINILLM_MAX_QUEUE": "5"}
    config = parse_args([], env)
    assert (config.port, config.api_key, config.kv_cache_memory, config.max_queue) == (9001, "k", "64MiB", 5)
    assert parse_args(["--port", "9002"], env).port == 9002  # the flag wins over the variable
    assert parse_args([], {}).port == ServerConfig().port == 8000
    assert env_name("--max-num-batched-tokens") == "MINILLM_MAX_NUM_BATCHED_TOKENS"
    assert parse_args(["--max-body-bytes", "2KiB"], {}).max_body_bytes == 2048
    assert config.engine_config().kv_cache_memory == "64MiB"


def test_enforce_eager_is_a_switch_with_an_automatic_default() -> None:
    assert parse_args([], {}).enforce_eager is None  # CUDA graphs on a GPU, eager on a CPU
    assert parse_args(["--enforce-eager"], {}).engine_config().enforce_eager is True
    assert parse_args(["--no-enforce-eager"], {}).engine_config().enforce_eager is False
    assert parse_args([], {"MINILLM_ENFORCE_EAGER": "Yes"}).enforce_eager is True
    assert parse_args(["--no-enforce-eager"], {"MINILLM_ENFORCE_EAGER": "1"}).enforce_eager is False
    with pytest.raises(UsageError, match="MINILLM_ENFORCE_EAGER must be one of"):
        parse_args([], {"MINILLM_ENFORCE_EAGER": "maybe"})


@pytest.mark.parametrize("argv, env, needle", [
    (["--port", "eighty"], {}, "--port: invalid int value: 'eighty'"),
    ([], {"MINILLM_PORT": "eighty"}, "--port: invalid int value: 'eighty'"),
    (["--log-level", "loud"], {}, "invalid choice: 'loud'"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_one_line(argv, env, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        parse_args(argv, env)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--block-size", "0"], "--block-size: block_size must be >= 1"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: cannot read 'lots' as a memory size"),
    (["--port", "70000"], "port must be in 0..65535"),
    (["--dtype", "int3"], "--dtype: dtype must be one of"),
    (["--max-queue", "0"], "max_queue must be >= 1"),
    (["--api-key", ""], "api_key must not be empty"),
])
def test_impossible_settings_are_usage_errors(argv, needle) -> None:
    with pytest.raises(UsageError, match=needle):
        parse_args(argv, {})


def test_help_names_every_variable() -> None:
    text = build_parser({}).format_help()
    for name in ("MINILLM_PORT", "MINILLM_API_KEY", "MINILLM_CHECKPOINT", "MINILLM_SHUTDOWN_GRACE"):
        assert name in text


def test_prompt_shapes_and_choices() -> None:
    tok = get_tokenizer()
    req = parse_completion({"prompt": ["hello world", "Once"], "n": 2, "seed": 7, "max_tokens": 3}, tok, CARD)
    assert req.prompts == [[31373, 995], tok.encode("Once")] and req.prompt_tokens == 3
    choices = req.choices()
    assert [c[0] for c in choices] == [[31373, 995]] * 2 + [tok.encode("Once")] * 2  # index = prompt * n + j
    assert [c[1].seed for c in choices] == [7, 8, 7, 8]
    assert parse_completion({"prompt": [1, 2, 3]}, tok, CARD).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": [[1], [2, 3]]}, tok, CARD).prompts == [[1], [2, 3]]


def test_defaults_fit_the_context() -> None:
    tok = get_tokenizer()
    assert parse_completion({"prompt": "hi"}, tok, CARD).params.max_tokens == 16  # OpenAI's default
    long_prompt = [5] * 120
    assert parse_completion({"prompt": long_prompt}, tok, CARD).params.max_tokens == 8  # cut to what fits
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, CARD)
    assert chat.params.max_tokens == CARD.max_model_len - len(chat.prompts[0])
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                       "max_completion_tokens": 4}, tok, CARD).params.max_tokens == 4
    sampled = parse_completion({"prompt": "hi", "temperature": 0, "top_k": -1, "stop": "\n"}, tok, CARD).params
    assert (sampled.temperature, sampled.top_k, sampled.stop) == (0, None, ["\n"])


def test_chat_template() -> None:
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A cat?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Once, a cat."}]},
                {"role": "user", "content": "More."}]
    assert chat_prompt(messages) == "Tell stories.\n\nUser: A cat?\nAssistant: Once, a cat.\nUser: More.\nAssistant:"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),  # a boolean is not an integer
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": ["hi", ""]}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": "a"}}, "logit_bias"),
    ({"prompt": "hi", "min_tokens": 1.5}, "min_tokens"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
])
def test_more_bad_fields_name_their_param(body, param) -> None:
    with pytest.raises(OpenAIError) as err:
        parse_completion(body, get_tokenizer(), CARD)
    assert err.value.status == 400 and err.value.param == param


def test_neutral_values_of_unsupported_fields_pass() -> None:
    body = {"prompt": "hi", "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None, "echo": False}
    assert parse_completion(body, get_tokenizer(), CARD).prompts


def test_chunks_have_openai_shapes() -> None:
    chat = Responses("chatcmpl-1", "minillm", chat=True, include_usage=True)
    first = chat.chunk(0, "Hi", first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    last = chat.chunk(0, "", "stop")["choices"][0]
    assert last == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    text = Responses("cmpl-1", "minillm", chat=False)
    assert "usage" not in text.chunk(0, "x") and text.chunk(0, "x")["choices"][0]["text"] == "x"
    assert sse("[DONE]") == b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------- limits, at their edges
#
# Each limit is tested on both sides: the last value accepted, and the first refused, which must
# be a 400 naming the field. The edges come from the card and the protocol's constants, so the
# tests follow the limits rather than restating them.

LEN, VOCAB = CARD.max_model_len, CARD.vocab_size
LONG = torch.iinfo(torch.long)  # the range of a seed: the int64 that keys its draws, signed as vLLM takes it
HALF = LEN // 2


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer()


def refusal(parse: Callable[..., GenerationRequest], body: dict, tok: Tokenizer) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse(body, tok, CARD)
    assert err.value.status == 400 and err.value.type == "invalid_request_error", err.value.body()
    return err.value


# (last accepted, first refused, the param the 400 names)
COMPLETION_EDGES = {
    "max_tokens at least 1": ({"prompt": "hi", "max_tokens": 1}, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "prompt + max_tokens fits the context exactly": (
        {"prompt": [1] * HALF, "max_tokens": LEN - HALF}, {"prompt": [1] * HALF, "max_tokens": LEN - HALF + 1},
        "max_tokens"),
    "the longest prompt sets the room, wherever it is": (
        {"prompt": [[1], [1] * HALF, [1]], "max_tokens": LEN - HALF},
        {"prompt": [[1], [1] * HALF, [1]], "max_tokens": LEN - HALF + 1}, "max_tokens"),
    "a prompt leaves room for one token": ({"prompt": [1] * (LEN - 1)}, {"prompt": [1] * LEN}, "prompt"),
    "every prompt of a list leaves room": ({"prompt": [[1], [1] * (LEN - 1)]}, {"prompt": [[1], [1] * LEN]}, "prompt"),
    "token ids below the vocabulary size": ({"prompt": [VOCAB - 1]}, {"prompt": [VOCAB]}, "prompt"),
    "token ids from 0": ({"prompt": [0]}, {"prompt": [-1]}, "prompt"),
    "token ids checked in every prompt": ({"prompt": [[1], [VOCAB - 1]]}, {"prompt": [[1], [VOCAB]]}, "prompt"),
    "n at least 1": ({"prompt": "hi", "n": 1}, {"prompt": "hi", "n": 0}, "n"),
    "temperature from 0": ({"prompt": "hi", "temperature": 0}, {"prompt": "hi", "temperature": math.nextafter(0, -1)},
                           "temperature"),
    "temperature at most OpenAI's 2": ({"prompt": "hi", "temperature": MAX_TEMPERATURE},
                                       {"prompt": "hi", "temperature": math.nextafter(MAX_TEMPERATURE, 3)}, "temperature"),
    "an integer temperature a thousand digits long": ({"prompt": "hi", "temperature": 2},
                                                      {"prompt": "hi", "temperature": 10**1000}, "temperature"),
    "top_k at most a long": ({"prompt": "hi", "top_k": LONG.max}, {"prompt": "hi", "top_k": LONG.max + 1}, "top_k"),
    "at most 4 stop strings": ({"prompt": "hi", "stop": ["a"] * MAX_STOPS}, {"prompt": "hi", "stop": ["a"] * (MAX_STOPS + 1)},
                               "stop"),
    "stop strings of bounded length": ({"prompt": "hi", "stop": ["a" * MAX_STOP_CHARS]},
                                       {"prompt": "hi", "stop": ["a", "a" * (MAX_STOP_CHARS + 1)]}, "stop"),
    "top_p at most 1": ({"prompt": "hi", "top_p": 1.0}, {"prompt": "hi", "top_p": math.nextafter(1, 2)}, "top_p"),
    "top_p above 0": ({"prompt": "hi", "top_p": math.nextafter(0, 1)}, {"prompt": "hi", "top_p": 0.0}, "top_p"),
    "top_k from -1 (all tokens)": ({"prompt": "hi", "top_k": -1}, {"prompt": "hi", "top_k": -2}, "top_k"),
    "seed at most a long": ({"prompt": "hi", "seed": LONG.max}, {"prompt": "hi", "seed": LONG.max + 1}, "seed"),
    "seed at least a long": ({"prompt": "hi", "seed": LONG.min}, {"prompt": "hi", "seed": LONG.min - 1}, "seed"),
    "the last choice's seed + j fits a long": (
        {"prompt": "hi", "n": 3, "seed": LONG.max - 2}, {"prompt": "hi", "n": 3, "seed": LONG.max - 1}, "seed"),
    "stop strings non-empty": ({"prompt": "hi", "stop": ["a", "\n"]}, {"prompt": "hi", "stop": ["a", ""]}, "stop"),
    "best_of only 1": ({"prompt": "hi", "best_of": 1}, {"prompt": "hi", "best_of": 2}, "best_of"),
    "logprobs at most 5": ({"prompt": "hi", "logprobs": 5}, {"prompt": "hi", "logprobs": 6}, "logprobs"),
    "top_logprobs is chat's": ({"prompt": "hi", "logprobs": 0}, {"prompt": "hi", "top_logprobs": 1}, "top_logprobs"),
    "frequency_penalty at most 2": ({"prompt": "hi", "frequency_penalty": 2.0},
                                    {"prompt": "hi", "frequency_penalty": math.nextafter(2, 3)}, "frequency_penalty"),
    "presence_penalty at least -2": ({"prompt": "hi", "presence_penalty": -2},
                                     {"prompt": "hi", "presence_penalty": -2.001}, "presence_penalty"),
    "repetition_penalty above 0": ({"prompt": "hi", "repetition_penalty": 1e-9},
                                   {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    "logit_bias at most 100": ({"prompt": "hi", "logit_bias": {"1": 100}}, {"prompt": "hi", "logit_bias": {"1": 100.5}},
                               "logit_bias"),
    "logit_bias ids in the vocabulary": ({"prompt": "hi", "logit_bias": {str(VOCAB - 1): -100}},
                                         {"prompt": "hi", "logit_bias": {str(VOCAB): -100}}, "logit_bias"),
    "min_tokens at most max_tokens": ({"prompt": "hi", "max_tokens": 4, "min_tokens": 4},
                                      {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    "stop_token_ids are ids": ({"prompt": "hi", "stop_token_ids": [0, 13]}, {"prompt": "hi", "stop_token_ids": [-1]},
                               "stop_token_ids"),
    "max_tokens 0 only with echo": ({"prompt": "hi there", "max_tokens": 0, "echo": True},
                                    {"prompt": "hi there", "max_tokens": 0}, "max_tokens"),
    "suffix only empty": ({"prompt": "hi", "suffix": ""}, {"prompt": "hi", "suffix": "end"}, "suffix"),
    "response_format types": ({"prompt": "hi", "response_format": {"type": "json_object"}},
                              {"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format"),
    "json_schema has a name": (
        {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    "json_schema is enforceable": (
        {"prompt": "hi", "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
        {"prompt": "hi", "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
        "response_format"),
}


@pytest.mark.parametrize("accepted, refused, param", COMPLETION_EDGES.values(), ids=COMPLETION_EDGES)
def test_completion_limits_at_their_edges(accepted: dict, refused: dict, param: str, tok: Tokenizer) -> None:
    """An off-by-one hides from values far past a limit: the last value in must pass, and
    the first one out must be a 400 that names its field."""
    req = parse_completion(accepted, tok, CARD)
    assert all(len(prompt) + params.max_tokens <= LEN for prompt, params in req.choices())
    assert refusal(parse_completion, refused, tok).param == param


@pytest.mark.parametrize("prompts", [1, 2, MAX_CHOICES])
def test_choices_count_prompts_times_n(prompts: int, tok: Tokenizer) -> None:
    """The choice limit is on prompts x n, what the engine runs, not on n alone: with k
    prompts, n = MAX_CHOICES / k fills it exactly and one more choice each is refused."""
    n = MAX_CHOICES // prompts
    body = {"prompt": [[1]] * prompts, "n": n}
    assert len(parse_completion(body, tok, CARD).choices()) == MAX_CHOICES
    assert refusal(parse_completion, {**body, "n": n + 1}, tok).param == "n"
    assert refusal(parse_completion, {"prompt": [[1]] * (MAX_CHOICES + 1)}, tok).param == "prompt"  # n=1: too many prompts


def test_the_default_max_tokens_is_cut_exactly_to_the_room(tok: Tokenizer) -> None:
    """Without max_tokens a completion gets OpenAI's default while it fits, and exactly the
    room left once it does not: never more (the engine would overrun the context), never less."""
    fits = [1] * (LEN - DEFAULT_COMPLETION_MAX_TOKENS)
    assert parse_completion({"prompt": fits}, tok, CARD).params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert parse_completion({"prompt": fits + [1]}, tok, CARD).params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS - 1
    assert parse_completion({"prompt": [1] * (LEN - 1)}, tok, CARD).params.max_tokens == 1


def chat_of(tok: Tokenizer, tokens: int) -> list[dict[str, Any]]:
    """A one-message conversation whose transcript encodes to exactly ``tokens`` tokens."""
    for words in range(tokens):
        messages = [{"role": "user", "content": " ".join(["a"] * words)}]
        if len(tok.encode(chat_prompt(messages))) == tokens:
            return messages
    raise AssertionError(f"no conversation of {tokens} tokens")


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_chat_limits_at_their_edges(param: str, tok: Tokenizer) -> None:
    """The chat endpoint checks the same edges, on the transcript, naming whichever of its
    two length fields the client sent, and ``messages`` for a conversation with no room."""
    messages = chat_of(tok, HALF)
    room = LEN - HALF
    assert parse_chat({"messages": messages}, tok, CARD).params.max_tokens == room  # default: to the end
    assert parse_chat({"messages": messages, param: room}, tok, CARD).params.max_tokens == room
    assert refusal(parse_chat, {"messages": messages, param: room + 1}, tok).param == param
    assert parse_chat({"messages": messages, param: 1}, tok, CARD).params.max_tokens == 1
    assert refusal(parse_chat, {"messages": messages, param: 0}, tok).param == param
    assert parse_chat({"messages": chat_of(tok, LEN - 1)}, tok, CARD).params.max_tokens == 1
    assert refusal(parse_chat, {"messages": chat_of(tok, LEN)}, tok).param == "messages"
    assert len(parse_chat({"messages": messages, "n": MAX_CHOICES}, tok, CARD).choices()) == MAX_CHOICES
    assert refusal(parse_chat, {"messages": messages, "n": MAX_CHOICES + 1}, tok).param == "n"


BODY_LIMIT = 4096


def test_edges_through_the_server(model: GPT) -> None:  # noqa: F811 (the fixture)
    """Through HTTP: an exact context fit and a body of exactly ``--max-body-bytes`` are
    served, one token or one byte more is refused in OpenAI's error shape, and an edge seed is
    accepted by the engine itself (its int64 draws), not only by the protocol."""
    async def error(response, status: int) -> dict:
        assert response.status == status, await response.text()
        error = (await response.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        return error

    async def main() -> None:
        async with serving(model, max_body_bytes=BODY_LIMIT) as client:
            fit = {"prompt": [1] * (CONTEXT - 2), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            ok = await client.post("/v1/completions", json=fit)
            assert ok.status == 200, await ok.text()
            assert (await ok.json())["usage"]["total_tokens"] == CONTEXT
            over = await client.post("/v1/completions", json={**fit, "max_tokens": 3})
            assert (await error(over, 400))["param"] == "max_tokens"

            for seed, n in [(LONG.max - 1, 2), (LONG.min, 1)]:
                sampled = {"prompt": "hi", "max_tokens": 1, "temperature": 1.0, "seed": seed, "n": n}
                ok = await client.post("/v1/completions", json=sampled)
                assert ok.status == 200, await ok.text()
                out = await client.post("/v1/completions", json={**sampled, "seed": seed - 1 if seed < 0 else seed + 1})
                assert (await error(out, 400))["param"] == "seed"

            body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
            headers = {"Content-Type": "application/json"}
            full = body.ljust(BODY_LIMIT)  # trailing whitespace is still valid JSON
            assert (await client.post("/v1/completions", data=full, headers=headers)).status == 200
            too_big = await client.post("/v1/completions", data=full + b" ", headers=headers)
            await error(too_big, 413)

    run(main())


def test_prompts_are_counted_before_any_is_tokenized() -> None:
    """Sixty-five long prompts must cost a count, not sixty-five encodings."""
    class NoEncoding:
        def encode(self, text: str) -> list[int]:
            raise AssertionError("tokenized before counting")

    with pytest.raises(OpenAIError) as err:
        parse_completion({"prompt": ["a long story " * 100] * (MAX_CHOICES + 1)}, NoEncoding(), CARD)
    assert (err.value.status, err.value.param) == (400, "prompt")
    with pytest.raises(OpenAIError) as err:
        parse_completion({"prompt": ["a", "b"], "n": MAX_CHOICES}, NoEncoding(), CARD)
    assert (err.value.status, err.value.param) == (400, "n")
    with pytest.raises(OpenAIError) as err:  # chat's n too, checked once, before its one encoding
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": MAX_CHOICES + 1}, NoEncoding(), CARD)
    assert (err.value.status, err.value.param) == (400, "n")


@pytest.mark.parametrize("role", [["user"], {"r": 1}, 3, None])
def test_a_role_that_is_not_a_string_is_a_400(role: object, tok: Tokenizer) -> None:
    assert refusal(parse_chat, {"messages": [{"role": role, "content": "hi"}]}, tok).param == "messages"


def test_a_huge_number_is_not_echoed_back_in_full(tok: Tokenizer) -> None:
    for field in ("temperature", "top_k", "seed"):
        err = refusal(parse_completion, {"prompt": "hi", field: 10**1000}, tok)
        assert err.param == field and len(err.body()["error"]["message"]) < 200


CHAT_LOGPROBS = {
    "top_logprobs at most 20": ({"logprobs": True, "top_logprobs": 20}, {"logprobs": True, "top_logprobs": 21},
                                "top_logprobs"),
    "top_logprobs needs logprobs": ({"logprobs": True, "top_logprobs": 0}, {"top_logprobs": 2}, "top_logprobs"),
    "logprobs is a boolean in chat": ({"logprobs": False}, {"logprobs": 3}, "logprobs"),
    "echo is completions'": ({}, {"echo": True}, "echo"),
}


@pytest.mark.parametrize("accepted, refused, param", CHAT_LOGPROBS.values(), ids=CHAT_LOGPROBS)
def test_chat_logprob_fields_at_their_edges(accepted: dict, refused: dict, param: str, tok: Tokenizer) -> None:
    messages = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat({**messages, **accepted}, tok, CARD)
    assert req.params.logprobs == (accepted.get("top_logprobs", 0) if accepted.get("logprobs") else None)
    assert refusal(parse_chat, {**messages, **refused}, tok).param == param
