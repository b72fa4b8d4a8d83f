"""The token routes (vLLM's ``/tokenize`` and ``/detokenize``) and ``GET /v1/models/{model}``,
through aiohttp's test client over the tiny model of :mod:`test_server`."""

from __future__ import annotations

import pytest
from test_server import CONTEXT, model, run, serving, state  # noqa: F401 (model is a fixture)

from minillm.model.gpt import GPT
from minillm.data.tokenizer import get_tokenizer
from server.protocol import chat_prompt, parse_chat

TRICKY = "Once upon a time 🐈‍⬛ met a 🦊.\n\n  Tabs\there, \"quotes\", <|endoftext|> and é/e\u0301 — done\n"
CHAT = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A cat? 🐈"},
        {"role": "assistant", "content": "Once"}, {"role": "user", "content": "More."}]


def test_tokenize_is_the_tokenizers_encoding_and_detokenize_inverts_it(model: GPT) -> None:
    tokenizer = get_tokenizer()

    async def main() -> None:
        async with serving(model) as client:
            response = await client.post("/tokenize", json={"prompt": TRICKY, "return_token_strs": True})
            assert response.status == 200, await response.text()
            answer = await response.json()
            assert answer["tokens"] == tokenizer.encode(TRICKY) and len(answer["tokens"]) > 10
            assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == CONTEXT
            assert answer["token_strs"] == [tokenizer.decode([t]) for t in answer["tokens"]]
            assert tokenizer.eot not in answer["tokens"]  # "<|endoftext|>" in a prompt is text, as in completions
            back = await client.post("/detokenize", json={"tokens": answer["tokens"], "model": "minillm"})
            assert back.status == 200 and await back.json() == {"prompt": TRICKY}

            plain = await (await client.post("/tokenize", json={"prompt": "hello world", "model": "minillm",
                                                                "add_special_tokens": True})).json()
            assert plain == {"count": 2, "max_model_len": CONTEXT, "tokens": [31373, 995], "token_strs": None}
            empty = await (await client.post("/tokenize", json={"prompt": ""})).json()
            assert (empty["count"], empty["tokens"]) == (0, [])
            assert await (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}

    run(main())


def test_tokenize_a_chat_is_tokenizing_its_transcript(model: GPT) -> None:
    tokenizer = get_tokenizer()

    async def main() -> None:
        async with serving(model) as client:
            answer = await (await client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True})).json()
            assert answer["tokens"] == tokenizer.encode(chat_prompt(CHAT)) and answer["count"] == len(answer["tokens"])
            assert "".join(answer["token_strs"]).endswith("Assistant:")
            # the very prompt a chat completion would be given
            assert parse_chat({"messages": CHAT}, tokenizer, state(client).card).prompts == [answer["tokens"]]

    run(main())


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": None}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"prompt": "a", "model": 7}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [50257]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [[1, 2]]}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_bad_input_is_a_400_naming_the_field(model: GPT, path: str, body: dict, param: str) -> None:
    async def main() -> None:
        async with serving(model) as client:
            response = await client.post(path, json=body)
            assert response.status == 400, await response.text()
            error = (await response.json())["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]

    run(main())


def test_bodies_that_are_not_json_objects_and_unknown_models(model: GPT) -> None:
    async def main() -> None:
        async with serving(model) as client:
            for path, good in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
                for data in ("{not json", "[1, 2]", '"text"'):
                    response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
                    assert response.status == 400, (path, data)
                    assert (await response.json())["error"]["type"] == "invalid_request_error"
                assert (await client.post(path, json={**good, "model": "minillm"})).status == 200
                other = await client.post(path, json={**good, "model": "gpt-4"})
                assert other.status == 404
                error = (await other.json())["error"]
                assert (error["code"], error["param"]) == ("model_not_found", "model")

    run(main())


def test_one_models_card(model: GPT) -> None:
    async def main() -> None:
        async with serving(model, served_model_name="org/tiny") as client:
            listed = (await (await client.get("/v1/models")).json())["data"][0]
            card = await client.get("/v1/models/org/tiny")  # a served name may hold a "/"
            assert card.status == 200 and await card.json() == listed
            assert listed["id"] == "org/tiny" and listed["max_model_len"] == CONTEXT
            for other in ("/v1/models/minillm", "/v1/models/org", "/v1/models/org/tiny/x"):
                missing = await client.get(other)
                assert missing.status == 404, other
                error = (await missing.json())["error"]
                assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                                          "invalid_request_error")

    run(main())


def test_the_routes_want_the_api_key(model: GPT) -> None:
    async def main() -> None:
        async with serving(model, api_key="sekrit") as client:
            routes = [("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                      ("GET", "/v1/models/minillm", None)]
            for method, path, body in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    refused = await client.request(method, path, json=body, headers=headers)
                    assert refused.status == 401, path
                    assert (await refused.json())["error"]["code"] == "invalid_api_key"
                ok = await client.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
                assert ok.status == 200, path

    run(main())
