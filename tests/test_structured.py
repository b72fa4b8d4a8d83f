"""Structured output: every answer held to a schema parses and validates, and nobody else pays.

The models here are random, so they have no wish to write JSON: whatever valid JSON comes out
comes from the mask. The schemas are bounded (string lengths, enums, item counts), so a walk
through one always ends within ``max_tokens``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine import LLM
from minillm.decoding.sampling import SamplingParams
from minillm.decoding.structured import GrammarCompiler, grammar_compiler, mask_logits_, token_bias
from minillm.data.tokenizer import get_tokenizer
from models import tiny_model

SCHEMAS = {
    "record": {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "kind": {"enum": ["cat", "dog", "fox"]}}},
    "list of enums": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "nested": {"type": "object", "additionalProperties": False, "required": ["ok", "point"],
               "properties": {"ok": {"type": "boolean"},
                              "point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                       "y": {"type": "integer", "minimum": -9, "maximum": 9}}}}},
    "one of two shapes": {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{2,5}$"}]},
    "const": {"const": {"v": 1}},
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(get_tokenizer())


def run(requests: dict[str, SamplingParams], max_num_seqs: int = 32) -> dict[str, tuple]:
    """Every request to the end, together, through ``LLM.generate``: ``{id: (text, token ids,
    finish reason)}``."""
    with LLM(tiny_model(context_length=256), max_num_seqs=max_num_seqs) as llm:
        outs = llm.generate(["Once upon a time"] * len(requests), list(requests.values()), use_tqdm=False)
    return {rid: (o.text, o.token_ids, o.finish_reason) for rid, o in zip(requests, outs)}


def test_every_answer_parses_and_validates_batched_with_free_neighbours() -> None:
    """Greedy and sampled requests for each schema, in one batch beside unconstrained ones:
    every constrained answer is complete JSON that the schema accepts, finished by the
    grammar ("stop"), and the neighbours' greedy tokens are what they are alone."""
    requests = {f"{name}/{seed}": SamplingParams(max_tokens=120, temperature=0.0 if seed == 0 else 1.0, seed=seed,
                                                  json_schema=schema)
                for name, schema in SCHEMAS.items() for seed in range(4)}
    free = {f"free/{i}": SamplingParams(max_tokens=12, temperature=0.0) for i in range(3)}
    results = run({**requests, **free})
    for rid, params in requests.items():
        text, _, reason = results[rid]
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), params.json_schema)
    alone = run(free)
    assert {rid: results[rid][1] for rid in free} == {rid: alone[rid][1] for rid in free}


def test_json_object_ends_when_the_object_closes() -> None:
    """``{"type": "object"}`` (response_format json_object) leaves the keys and values free. A
    bias toward the quote and the closing brace lets a random model finish; the mask makes
    whatever it writes an object, and the request stops at the brace, with no end-of-text
    token to wait for, even under ``ignore_eos``."""
    tok = get_tokenizer()
    bias = {tok.encode(s)[0]: 8.0 for s in ['"', '"}', '}', '":']}
    requests = {f"obj/{seed}": SamplingParams(max_tokens=100, temperature=1.0, seed=seed, logit_bias=bias,
                                              ignore_eos=True, json_schema={"type": "object"}) for seed in range(6)}
    for rid, (text, ids, reason) in run(requests, max_num_seqs=8).items():
        assert reason == "stop" and isinstance(json.loads(text), dict), (rid, text)
        assert text.endswith("}") and tok.decode(ids) == text


def test_max_tokens_cuts_an_answer_short_with_finish_length() -> None:
    """Too few tokens for the value: the answer stops at max_tokens ("length"), a prefix of
    valid JSON that does not parse, as OpenAI and vLLM return it."""
    text, ids, reason = run({"short": SamplingParams(max_tokens=3, temperature=0.0, json_schema=SCHEMAS["record"])},
                            max_num_seqs=4)["short"]
    assert reason == "length" and len(ids) == 3 and text.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(SCHEMAS)), choices=st.lists(st.integers(min_value=0), min_size=60, max_size=60))
def test_a_walk_through_the_mask_never_dead_ends(compiler: GrammarCompiler, name: str, choices: list[int]) -> None:
    """Any path the mask allows, token by token (hypothesis picks which allowed token each
    time), always leaves at least one token allowed until the value is complete, and a
    complete value validates: the mask never rules out every token, nor lets a wrong one by."""
    tok = get_tokenizer()
    grammar = compiler.compile(SCHEMAS[name])
    ids = []
    for pick in choices:
        allowed = (token_bias([grammar], tok.n_vocab)[0] == 0).nonzero().flatten().tolist()
        assert allowed
        ids.append(allowed[pick % len(allowed)])
        grammar.accept(ids[-1])
        if grammar.done:
            jsonschema.validate(json.loads(tok.decode(ids)), SCHEMAS[name])
            return  # a walk still open after 60 tokens (escapes make long strings) checked its masks


def test_the_mask_unpacks_bit_t_as_token_t(compiler: GrammarCompiler) -> None:
    """An integer's first token is a digit or a minus: the unpacked mask allows "7" and "-"
    and rules out "a" and "{" (a shifted or reversed bit order would not)."""
    tok = get_tokenizer()
    allowed = token_bias([compiler.compile({"type": "integer"})], tok.n_vocab)[0] == 0
    for text, ok in [("7", True), ("-", True), ("42", True), ("a", False), ("{", False), (" 7", False)]:
        (token,) = tok.encode(text)
        assert bool(allowed[token]) is ok, text
    assert all(tok.decode([t]).lstrip("-").isdigit() or tok.decode([t]) == "-"
               for t in allowed.nonzero().flatten().tolist())


def test_a_wrong_token_is_refused(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile({"type": "integer"})
    with pytest.raises(RuntimeError, match="not allowed"):
        grammar.accept(get_tokenizer().encode("{")[0])


def test_the_mask_wins_over_a_bias_that_kills_every_allowed_token() -> None:
    """Logits already -inf on every allowed token (a ban by min_tokens, say) must not leave
    the sampler nothing: the row chooses among the allowed tokens alone."""
    inf = float("-inf")
    logits = torch.tensor([[0.0, inf, 5.0, inf], [9.0, 9.0, 9.0, 9.0], [1.0, 2.0, 3.0, 4.0]])
    bias = torch.tensor([[inf, 0.0, inf, 0.0], [0.0, inf, 0.0, inf]])
    mask_logits_(logits, [0, 2], bias)
    assert logits[0].tolist() == [inf, 0.0, inf, 0.0]
    assert logits[1].tolist() == [9.0] * 4  # a row not held to a grammar is left alone
    assert logits[2].tolist() == [1.0, inf, 3.0, inf]


def test_a_schema_held_request_decodes_token_by_token_and_bad_schemas_are_refused(compiler: GrammarCompiler) -> None:
    """A schema's mask depends on every token before it, so no speculative draft runs ahead
    of it; a schema the matcher cannot use is a ValueError where it is compiled, naming the
    field: on arrival at the engine, which then holds nothing of the request."""
    assert SamplingParams(json_schema={"type": "object"}).token_by_token
    assert not SamplingParams().token_by_token
    for bad in [{"type": "integr"}, "not an object", {"minimum": float("nan")}, {"type": "object", "required": 3}]:
        with pytest.raises(ValueError, match="^json_schema cannot be enforced"):
            compiler.check(bad)
    with LLM(tiny_model()) as llm:
        with pytest.raises(ValueError, match="^json_schema cannot be enforced: Invalid type: integr"):
            llm.engine.add_request("bad", [1, 2], SamplingParams(json_schema={"type": "integr"}))
        assert not llm.engine.has_unfinished


def test_a_schema_compiles_once_and_each_choice_walks_its_own_copy(monkeypatch) -> None:
    """The engine's compiler is the process's one for its tokenizer: a schema checked first
    (as the server does) and then given to three choices is compiled once, counted where
    llguidance compiles it, yet each choice has its own matcher and its own valid answer."""
    import llguidance

    real, compiled = llguidance.LLMatcher, []

    class Counting:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

        def __new__(cls, *args, **kwargs):
            compiled.append(args[1])
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    schema = {**SCHEMAS["record"], "title": "compiled once"}  # a text no other test compiled
    with LLM(tiny_model(context_length=256)) as llm:
        assert llm.engine.grammars is grammar_compiler(llm.engine.tokenizer)
        llm.engine.grammars.check(schema)
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, json_schema=schema)
        outs = llm.generate(["Once upon a time"] * 3, [params.with_seed(7 + j) for j in range(3)], use_tqdm=False)
    assert len(compiled) == 1 and len({o.text for o in outs}) == 3  # one compilation, three walks
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS["record"])
