"""The logits processors: each gets the rows that ask for it and no others, in their order
(logprobs from the raw rows, penalties, then the grammar's mask), and none runs on a batch
where no row asks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.data.tokenizer import get_tokenizer
from minillm.decoding.processors import PROCESSORS, process_
from minillm.decoding.sampling import SamplingParams
from minillm.decoding.structured import TokenGrammar, grammar_compiler


@dataclass
class Row:
    """A request as the processors see it (the engine's ``Sequence`` in the runner)."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [11, 12, 13])
    prompt_len: int = 2
    eos_token_id: int | None = None
    grammar: TokenGrammar | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


def test_a_batch_where_no_row_asks_runs_no_processor(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a processor ran though no row asks for it")

    for processor in PROCESSORS:
        monkeypatch.setattr(processor, "apply_", refuse)
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=0.7, top_k=5, seed=1)),
            Row(SamplingParams(stop=["x"], stop_token_ids=[3], max_tokens=3))]
    logits = torch.randn(3, 100)
    before = logits.clone()
    done = process_(rows, logits)
    assert not done.shaped and not done.reports and torch.equal(logits, before)
    assert done.logprobs(torch.tensor([0, 1, 2])) == [None, None, None]


def test_each_processor_gets_its_rows_in_order_and_logprobs_read_the_raw_row(monkeypatch) -> None:
    """Row 1 asks for all three: its logprobs come from the row before its bias, and the mask,
    applied after the bias, still rules out the token the bias pushed up."""
    tok = get_tokenizer()
    brace = tok.encode("{")[0]
    calls = []
    for processor in PROCESSORS:
        def recorded(logits, rows, asking, apply_=processor.apply_, name=type(processor).__name__):
            calls.append((name, rows))
            return apply_(logits, rows, asking)

        monkeypatch.setattr(processor, "apply_", recorded)
    rows = [Row(SamplingParams()),
            Row(SamplingParams(logprobs=2, logit_bias={brace: 100.0}), grammar=grammar_compiler(tok).compile({"type": "integer"})),
            Row(SamplingParams(presence_penalty=1.0))]
    logits = torch.randn(3, tok.n_vocab, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    done = process_(rows, logits)
    assert calls == [("Logprobs", [1]), ("Penalties", [1, 2]), ("GrammarMask", [1])] and done.shaped
    assert torch.equal(logits[0], raw[0]) and logits[1, brace] == float("-inf")
    assert logits[2, 13] == raw[2, 13] - 1.0  # the presence penalty on row 2's one output token
    tokens = torch.tensor([0, brace, 5])
    scored = done.logprobs(tokens)
    assert scored[0] is None and scored[2] is None and scored[1][0].token_id == brace
    assert scored[1][0].logprob == torch.log_softmax(raw[1], dim=-1)[brace].item()
    assert len(scored[1][0].top) == 2
