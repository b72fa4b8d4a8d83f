"""The server's settings and wire format, without a server: flags, environment, parsing."""

from __future__ import annotations

import pytest

from minillm.cli import UsageError
from minillm.tokenizer import get_tokenizer
from server.config import ServerConfig, build_parser, env_name, parse_args
from server.protocol import ModelCard, Responses, chat_prompt, parse_chat, parse_completion
from server.wire import OpenAIError, sse

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
    (["--kv-cache-memory", "lots"], {}, "cannot read 'lots' as a memory size"),
    (["--log-level", "loud"], {}, "invalid choice: 'loud'"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_flag_is_one_line(argv, env, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        parse_args(argv, env)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--port", "70000"], "port must be in 0..65535"),
    (["--dtype", "int3"], "dtype must be one of"),
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
